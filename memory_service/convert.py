"""Protobuf <-> core conversion at the edge: the block manager never sees protobuf types."""

from __future__ import annotations

import dataclasses

from pagedserve.errors import InvalidArgument
from pagedserve.memory.v1 import memory_pb2 as pb

from memory_service.identity import KvTierInfo
from memory_service.manager.block_types import (
    AllocateOp,
    AppendOp,
    BlockManagerStats,
    ForkOp,
    FreeOp,
    Op,
    OpResult,
    PoolStats,
    TierStats,
)
from memory_service.pool.kv_pool import CudaIpcHandle, KvLayout, PoolDescriptor


def layout_from_pb(msg: pb.KvLayout, default_block_size: int) -> KvLayout:
    """The caller's layout; one that KvLayout rejects is bad input (InvalidArgument)."""
    try:
        return KvLayout(
            num_layers=msg.num_layers,
            num_kv_heads=msg.num_kv_heads,
            head_dim=msg.head_dim,
            dtype=msg.dtype,
            block_size=msg.block_size or default_block_size,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def layout_to_pb(layout: KvLayout) -> pb.KvLayout:
    return pb.KvLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        block_size=layout.block_size,
    )


def descriptor_to_pb(desc: PoolDescriptor) -> pb.PoolDescriptor:
    msg = pb.PoolDescriptor(shape=list(desc.shape), dtype=desc.dtype, device=desc.device, num_bytes=desc.num_bytes)
    if desc.shm_name is not None:
        msg.shm_name = desc.shm_name
    else:
        ipc = desc.cuda_ipc
        msg.cuda_ipc.CopyFrom(
            pb.CudaIpcHandle(
                device_index=ipc.device_index,
                storage_handle=ipc.storage_handle,
                storage_size_bytes=ipc.storage_size_bytes,
                storage_offset_bytes=ipc.storage_offset_bytes,
                ref_counter_handle=ipc.ref_counter_handle,
                ref_counter_offset=ipc.ref_counter_offset,
                event_handle=ipc.event_handle,
                event_sync_required=ipc.event_sync_required,
            )
        )
    return msg


def descriptor_from_pb(msg: pb.PoolDescriptor) -> PoolDescriptor:
    """The descriptor as sent; ``mapped_pool.check_descriptor`` decides whether to trust it."""
    which = msg.WhichOneof("handle")
    ipc = None
    if which == "cuda_ipc":
        c = msg.cuda_ipc
        ipc = CudaIpcHandle(
            device_index=c.device_index,
            storage_handle=c.storage_handle,
            storage_size_bytes=c.storage_size_bytes,
            storage_offset_bytes=c.storage_offset_bytes,
            ref_counter_handle=c.ref_counter_handle,
            ref_counter_offset=c.ref_counter_offset,
            event_handle=c.event_handle,
            event_sync_required=c.event_sync_required,
        )
    return PoolDescriptor(
        shape=tuple(msg.shape),
        dtype=msg.dtype,
        device=msg.device,
        shm_name=msg.shm_name if which == "shm_name" else None,
        cuda_ipc=ipc,
    )


def tiers_to_pb(tiers: tuple[KvTierInfo, ...]) -> list[pb.KvTier]:
    return [pb.KvTier(kind=t.kind, capacity_bytes=t.capacity_bytes) for t in tiers]


def tiers_from_pb(msgs: list[pb.KvTier]) -> tuple[KvTierInfo, ...]:
    """The tiers as the service sent them; a malformed one is the service's bug (ValueError)."""
    return tuple(KvTierInfo(m.kind, m.capacity_bytes) for m in msgs)


def stats_to_pb(stats: BlockManagerStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        pools=[
            pb.PoolStats(
                name=p.name,
                num_total_blocks=p.num_total_blocks,
                num_free_blocks=p.num_free_blocks,
                num_cached_blocks=p.num_cached_blocks,
                num_used_blocks=p.num_used_blocks,
            )
            for p in stats.pools
        ],
        kv_utilization=stats.kv_utilization,
        fragmentation=stats.fragmentation,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_evictions=stats.num_evictions,
        num_copy_on_writes=stats.num_copy_on_writes,
        num_sequences=stats.num_sequences,
        num_clients=stats.num_clients,
        block_size=stats.block_size,
        tiers=[pb.TierStats(**dataclasses.asdict(t)) for t in stats.tiers],
    )


def stats_from_pb(msg: pb.StatsResponse) -> BlockManagerStats:
    pools = tuple(
        PoolStats(p.name, p.num_total_blocks, p.num_free_blocks, p.num_cached_blocks, p.num_used_blocks)
        for p in msg.pools
    )
    return BlockManagerStats(
        pools=pools,
        kv_utilization=msg.kv_utilization,
        fragmentation=msg.fragmentation,
        prefix_cache_queries=msg.prefix_cache_queries,
        prefix_cache_hits=msg.prefix_cache_hits,
        num_evictions=msg.num_evictions,
        num_copy_on_writes=msg.num_copy_on_writes,
        num_sequences=msg.num_sequences,
        num_clients=msg.num_clients,
        block_size=msg.block_size,
        tiers=tuple(TierStats(**{f.name: getattr(t, f.name) for f in dataclasses.fields(TierStats)})
                    for t in msg.tiers),
    )


def op_from_pb(msg: pb.SequenceOp) -> Op:
    which = msg.WhichOneof("op")
    if which == "append":
        return AppendOp(msg.append.seq_id, list(msg.append.token_ids))
    if which == "allocate":
        a = msg.allocate
        return AllocateOp(a.seq_id, list(a.prompt_token_ids), a.max_num_new_tokens, a.priority, a.namespace,
                          a.skip_cache_read)
    if which == "free":
        return FreeOp(msg.free.seq_id)
    if which == "fork":
        return ForkOp(msg.fork.parent_seq_id, msg.fork.child_seq_id)
    raise InvalidArgument("ops[]: a SequenceOp must set one of allocate, append, free, fork")


def op_to_pb(op: Op) -> pb.SequenceOp:
    if isinstance(op, AppendOp):
        return pb.SequenceOp(append=pb.AppendOp(seq_id=op.seq_id, token_ids=op.token_ids))
    if isinstance(op, AllocateOp):
        return pb.SequenceOp(
            allocate=pb.AllocateOp(
                seq_id=op.seq_id,
                prompt_token_ids=op.prompt_token_ids,
                max_num_new_tokens=op.max_num_new_tokens,
                priority=op.priority,
                namespace=op.namespace,
                skip_cache_read=op.skip_cache_read,
            )
        )
    if isinstance(op, FreeOp):
        return pb.SequenceOp(free=pb.FreeOp(seq_id=op.seq_id))
    return pb.SequenceOp(fork=pb.ForkOp(parent_seq_id=op.parent_seq_id, child_seq_id=op.child_seq_id))


def result_to_pb(result: OpResult) -> pb.OpResult:
    return pb.OpResult(
        ok=result.ok,
        block_ids=result.block_ids,
        num_cached_tokens=result.num_cached_tokens,
        num_new_tokens=result.num_new_tokens,
        copies=[pb.BlockCopy(src=s, dst=d) for s, d in result.copies],
        loading=result.loading,
    )


def result_from_pb(msg: pb.OpResult) -> OpResult:
    return OpResult(
        ok=msg.ok,
        block_ids=list(msg.block_ids),
        num_cached_tokens=msg.num_cached_tokens,
        num_new_tokens=msg.num_new_tokens,
        copies=[(c.src, c.dst) for c in msg.copies],
        loading=msg.loading,
    )


def appends_from_pb(batch: pb.AppendBatch) -> list[AppendOp]:
    """Unpack an AppendBatch into one AppendOp per sequence (InvalidArgument on inconsistent arrays)."""
    seq_ids, counts, tokens = batch.seq_ids, batch.num_tokens, batch.token_ids
    if len(seq_ids) != len(counts):
        raise InvalidArgument(f"appends: {len(seq_ids)} seq_ids but {len(counts)} num_tokens")
    if sum(counts) != len(tokens) or any(n < 1 for n in counts):
        raise InvalidArgument(f"appends: num_tokens must be >= 1 each and sum to len(token_ids) = {len(tokens)}")
    if all(n == 1 for n in counts):  # the decode step: one token each
        return [AppendOp(seq_id, [token]) for seq_id, token in zip(seq_ids, tokens)]
    ops, start = [], 0
    for seq_id, n in zip(seq_ids, counts):
        ops.append(AppendOp(seq_id, list(tokens[start : start + n])))
        start += n
    return ops


def appends_to_pb(ops: list[AppendOp]) -> pb.AppendBatch:
    tokens: list[int] = []
    for op in ops:
        tokens.extend(op.token_ids)
    return pb.AppendBatch(
        seq_ids=[op.seq_id for op in ops], num_tokens=[len(op.token_ids) for op in ops], token_ids=tokens
    )


def append_results_to_pb(results: list[OpResult]) -> pb.AppendBatchResult:
    new_block_ids: list[int] = []
    copies = []
    for index, result in enumerate(results):
        if result.block_ids:
            new_block_ids.extend(result.block_ids)
        for src, dst in result.copies:
            copies.append(pb.BlockCopy(src=src, dst=dst, seq_index=index))
    return pb.AppendBatchResult(
        ok=[r.ok for r in results],
        num_new_blocks=[len(r.block_ids) for r in results],
        new_block_ids=new_block_ids,
        copies=copies,
    )


def append_results_from_pb(msg: pb.AppendBatchResult) -> list[OpResult]:
    copies: dict[int, list[tuple[int, int]]] = {}
    for c in msg.copies:
        copies.setdefault(c.seq_index, []).append((c.src, c.dst))
    results, start = [], 0
    block_ids = msg.new_block_ids
    for index, (ok, n) in enumerate(zip(msg.ok, msg.num_new_blocks)):
        results.append(OpResult(ok, list(block_ids[start : start + n]) if n else [], 0, 0, copies.get(index, [])))
        start += n
    return results
