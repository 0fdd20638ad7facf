"""The disk tier's faults on real processes (the goal: "no wrong tokens, nothing lost beyond the
cache, a clear log line").

A memory service with the tier and a compute service attached to it, started by
``pagedserve.stack`` as ``pagedserve up`` starts them (no gateway: prompts go to the compute
service's Generate as token ids), greedy. Three scenarios, one after the other on one directory:

1. ``sigkill_mid_write``: wave 1's prompts answered one at a time, then wave 2's sent together and
   the memory service SIGKILLed while the writer is on their blocks (a quarter written, at a
   ``.tmp-`` file seen); a new memory service on the same directory (the compute service
   re-attaches), both waves sent again.
2. ``corrupt_files``: the memory service stopped (SIGTERM); one byte flipped in the payload of a
   block file of wave 1's first prompt (only the checksum can tell), a block file of its second
   prompt cut to half; a new memory service on the directory, wave 1 sent again. Only the memory
   service reads the directory, so a new compute service would add nothing here but its start
   (the ``warm_restart`` figure restarts both).
3. ``full_disk``: the directory's file system shrunk to what it holds plus two block files, the
   tier's budget (``--kv-disk-bytes``, default 10 GiB) far above it; wave 3 (new prompts) sent,
   its blocks' writes find ENOSPC: the tier lowers its budget to what it holds and evicts its least
   recently used files to write them (``disk_tier.py``), so they are written (``blocks_written``,
   counted from the bytes written: evictions keep the number of files flat), not dropped.

The file system is a tmpfs mounted for the phase (``mount -t tmpfs``, resized by ``remount``): here
(a container whose root has CAP_SYS_ADMIN) that is what really returns ENOSPC, where an RLIMIT_FSIZE
would give EFBIG and a budget above the free space of a 68 GB disk would take minutes to reach.
Without the privilege the first two scenarios run on a plain directory and ``full_disk`` says why
it was skipped.

"Same tokens" compares with cold answers: every prompt is first sent in a cache namespace of its
own (another ``cache_salt``), where nothing of it is cached, in the pool or the tier. In float32
(``--fault-dtype``'s default): in bfloat16 a prompt's last token computed alone on a cached prefix
rounds differently from the same token as a row of the whole prompt's prefill (another GEMM shape),
and on random-token prompts, whose next-token distributions are flat, that flips greedy near-ties:
measured with the default model, 2 of 3 prompts served from the *pool's* prefix cache, no tier
involved, differed from their cold answers from the second token on. float32 answers are the same
on either path, so there a difference can only be wrong KV. A prompt is
``prompt_blocks`` full blocks and one token and generates fewer than a block's tokens, so its
block files are exactly its full blocks; the files a prompt wrote are those that appear after it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from pagedserve.compute.v1 import compute_pb2, compute_pb2_grpc
from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
from pagedserve.process import check_health, wait_until
from pagedserve.stack import COMPUTE_SERVICE, StackConfig, memory_process, start_stack

from memory_service.tier.disk_tier import FILE_SUFFIX, HEADER_SIZE, TMP_PREFIX

BLOCK_SIZE = 16
COLD_SALT = "tierbench-cold"  # the namespace of the cold answers
TIER_EVENTS = ("kv_tier_opened", "kv_tier_partial_writes_removed", "kv_tier_file_removed", "kv_tier_write_failed",
               "kv_tier_budget_lowered", "kv_tier_read_failed", "kv_tier_load_failed")
SERVING = health_pb2.HealthCheckResponse.SERVING
WAIT_S = 600.0  # for a write-behind or a restart on a loaded machine


@dataclass(frozen=True)
class FaultSizes:
    """How much each wave sends.

    Args:
        prompt_blocks: full blocks of each prompt (it has one token more).
        num_prompts: wave 1 (at least 2: the corrupt scenario damages two prompts' files).
        num_writes: wave 2, in flight when the memory service is killed.
        num_full_disk: wave 3, sent to the full disk.
        max_tokens: generated per prompt, < BLOCK_SIZE (no generated token completes a block).
        fs_bytes: the tmpfs's size until the full-disk scenario shrinks it.
    """

    prompt_blocks: int = 64
    num_prompts: int = 2
    num_writes: int = 3
    num_full_disk: int = 2
    max_tokens: int = 8
    fs_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        if self.num_prompts < 2 or self.prompt_blocks < 2 or not 1 <= self.max_tokens < BLOCK_SIZE:
            raise ValueError(f"fault sizes out of range: {self}")

    @property
    def num_blocks(self) -> int:
        """A pool that holds every block of every answer twice (cold and not), so that nothing is
        evicted before the writer copied it."""
        return 2 * (self.num_prompts + self.num_writes + self.num_full_disk) * (self.prompt_blocks + 1) + 16


QUICK_FAULTS = FaultSizes(prompt_blocks=4, num_prompts=2, num_writes=2, num_full_disk=2, max_tokens=4,
                          fs_bytes=64 << 20)


class Engines:
    """A memory service with the disk tier on ``tier_dir`` and a compute service attached to it."""

    def __init__(self, model: str, dtype: str | None, tier_dir: Path, sizes: FaultSizes) -> None:
        self.sizes = sizes
        memory = ("--max-num-blocks", str(sizes.num_blocks), "--block-size", str(BLOCK_SIZE),
                  "--kv-disk-dir", str(tier_dir))
        compute = ("--block-size", str(BLOCK_SIZE), "--memory-retry-interval-s", "0.2",
                   "--memory-ping-interval-s", "0.2", *(("--dtype", dtype) if dtype else ()))
        self.stack = start_stack(StackConfig(model=model, memory_args=memory, compute_args=compute,
                                             ready_timeout_s=WAIT_S), with_gateway=False)
        self._channel = grpc.insecure_channel(self.stack.compute_address)
        self._stub = compute_pb2_grpc.ComputeStub(self._channel)

    @property
    def memory_address(self) -> str:
        assert self.stack.memory is not None
        return self.stack.memory.address

    def generate(self, prompt: list[int], salt: str = "") -> tuple[list[int], int]:
        """One greedy request: (its tokens, its prompt tokens served from the cache)."""
        params = compute_pb2.SamplingParams(max_tokens=self.sizes.max_tokens, temperature=0.0, ignore_eos=True)
        tokens, num_cached = [], 0
        for reply in self._stub.Generate(compute_pb2.GenerateRequest(prompt_token_ids=prompt, params=params,
                                                                     cache_salt=salt), timeout=WAIT_S):
            tokens += reply.token_ids
            if reply.HasField("usage"):
                num_cached = reply.usage.cached_prompt_tokens
        return tokens, num_cached

    def disk(self) -> memory_pb2.TierStats:
        with grpc.insecure_channel(self.memory_address) as channel:
            stats = memory_pb2_grpc.MemoryManagerStub(channel).Stats(memory_pb2.StatsRequest(), timeout=30)
        return next(t for t in stats.tiers if t.kind == "disk")

    def integrity_ok(self) -> bool:
        with grpc.insecure_channel(self.memory_address) as channel:
            reply = memory_pb2_grpc.MemoryManagerStub(channel).CheckIntegrity(memory_pb2.CheckIntegrityRequest(),
                                                                              timeout=30)
        return reply.ok

    def tier_log_lines(self) -> list[str]:
        """The tier's events in the current memory service's log (JSON lines)."""
        assert self.stack.memory is not None and self.stack.memory.log_file is not None
        lines = []
        for line in self.stack.memory.log_file.read_text(errors="replace").splitlines():
            try:
                event = json.loads(line).get("event")
            except (json.JSONDecodeError, AttributeError):
                continue
            if event in TIER_EVENTS:
                lines.append(line)
        return lines

    def restart_memory(self) -> None:
        """A new memory service on the socket and directory of the stopped (or killed) one; back once
        the compute service re-attached."""
        wait_until(lambda: self._compute_health() != SERVING, 30, "the compute service to see the memory service gone")
        self.stack.restart_memory()
        wait_until(lambda: self._compute_health() == SERVING, WAIT_S, "the compute service to re-attach")

    def _compute_health(self) -> int | None:
        return check_health(self.stack.compute_address, COMPUTE_SERVICE)

    def stop(self) -> None:
        self._channel.close()
        self.stack.stop()


def block_files(directory: Path) -> set[str]:
    return {name for name in os.listdir(directory) if name.endswith(FILE_SUFFIX)}


def partial_files(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(TMP_PREFIX)]


def wait_for_files(directory: Path, num_files: int) -> None:
    """Until the write-behind has written ``num_files`` block files there."""
    wait_until(lambda: len(block_files(directory)) >= num_files, WAIT_S, f"{num_files} block files in the tier",
               interval_s=0.02)


def send_and_compare(engines: Engines, prompts: list[list[int]], cold: dict[int, list[int]]) -> dict[str, Any]:
    """Each prompt alone, its tokens against its cold answer."""
    different, cached = [], []
    for i, prompt in enumerate(prompts):
        tokens, num_cached = engines.generate(prompt)
        if tokens != cold[id(prompt)]:
            different.append(i)
        cached.append(num_cached)
    return {"same_tokens": not different, "different": different, "cached_tokens": cached,
            "cached_share": round(sum(cached) / sum(len(p) for p in prompts), 3)}


def kill_while_writing(engines: Engines, tier_dir: Path, wave: list[list[int]]) -> dict[str, Any]:
    """Sends ``wave`` together and SIGKILLs the memory service once the writer starts on its blocks."""
    before = block_files(tier_dir)
    outcomes: list[str] = []

    def send(prompt: list[int]) -> None:
        try:
            engines.generate(prompt)
            outcomes.append("OK")
        except grpc.RpcError as exc:
            outcomes.append(exc.code().name)

    threads = [threading.Thread(target=send, args=(p,), daemon=True) for p in wave]
    for thread in threads:
        thread.start()
    # The kill comes once a quarter of the wave's blocks are written (the writer is busy with the
    # rest), at the first temporary file seen after that (a write in progress; the writer writes a
    # step's blocks in a burst), or when every block is written (no write is left to cut), or 30 s on.
    num_blocks = len(wave) * engines.sizes.prompt_blocks
    wait_until(lambda: len(block_files(tier_dir) - before) >= max(1, num_blocks // 4), WAIT_S,
               "the writer on the wave's blocks", interval_s=0.001)
    deadline = time.monotonic() + 30.0
    while (time.monotonic() < deadline and not partial_files(tier_dir)
           and len(block_files(tier_dir) - before) < num_blocks):
        time.sleep(0.0005)
    assert engines.stack.memory is not None
    engines.stack.memory.kill()
    written = len(block_files(tier_dir) - before)
    partial = len(partial_files(tier_dir))
    for thread in threads:
        thread.join(WAIT_S)
    return {"wave_blocks": num_blocks, "wave_blocks_written_at_kill": written,
            "partial_files_at_kill": partial, "requests_failed_by_kill": sum(o != "OK" for o in outcomes)}


def corrupt(tier_dir: Path, flip: str, truncate: str) -> None:
    path = tier_dir / flip
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + (len(data) - HEADER_SIZE) // 2] ^= 0x40
    path.write_bytes(data)
    path = tier_dir / truncate
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def run_faults(model: str, dtype: str | None, root: Path, sizes: FaultSizes, vocab: int, first_token: int,
               seed: int) -> dict[str, Any]:
    """The three scenarios (module docstring); returns the ``faults`` section of the JSON."""
    rng = random.Random(seed)
    length = sizes.prompt_blocks * BLOCK_SIZE + 1

    def wave(num: int) -> list[list[int]]:
        return [[rng.randrange(first_token, vocab) for _ in range(length)] for _ in range(num)]

    first, second, third = wave(sizes.num_prompts), wave(sizes.num_writes), wave(sizes.num_full_disk)
    mount_point = root / "faults"
    mount_point.mkdir()
    mount_error = _run(["mount", "-t", "tmpfs", "-o", f"size={sizes.fs_bytes},mode=0700", "tmpfs", str(mount_point)])
    tier_dir = mount_point / "tier"
    result: dict[str, Any] = {"filesystem": "tmpfs" if mount_error is None else "directory",
                              "prompt_tokens": length, "pool_blocks": sizes.num_blocks}
    engines: Engines | None = None
    try:
        engines = Engines(model, dtype, tier_dir, sizes)
        cold = {id(p): engines.generate(p, COLD_SALT)[0] for p in (*first, *second, *third)}
        num_files = (len(first) + len(second) + len(third)) * sizes.prompt_blocks
        wait_for_files(tier_dir, num_files)
        files_of: list[set[str]] = []  # wave 1's prompts' block files
        for prompt in first:
            before = block_files(tier_dir)
            engines.generate(prompt)
            num_files += sizes.prompt_blocks
            wait_for_files(tier_dir, num_files)
            files_of.append(block_files(tier_dir) - before)

        # 1. SIGKILL mid-write.
        killed = kill_while_writing(engines, tier_dir, second)
        engines.restart_memory()
        scenario = send_and_compare(engines, first, cold)
        again = send_and_compare(engines, second, cold)
        # Wave 2's write-behind first: a temporary file counted while it still writes is not the
        # killed service's.
        num_files += len(second) * sizes.prompt_blocks
        wait_for_files(tier_dir, num_files)
        disk = engines.disk()
        result["sigkill_mid_write"] = {
            "same_tokens": scenario["same_tokens"] and again["same_tokens"], **killed,
            "wave1_cached_share": scenario["cached_share"], "wave2_cached_share": again["cached_share"],
            "wave1_different": scenario["different"], "wave2_different": again["different"],
            "wave2_cached_tokens": again["cached_tokens"],
            "partial_files_left": len(partial_files(tier_dir)), "files_removed": disk.num_bad_files,
            "write_errors": disk.num_write_errors, "integrity_ok": engines.integrity_ok(),
            "log_lines": engines.tier_log_lines()}

        # 2. A flipped and a truncated file, found by a new memory service.
        assert engines.stack.memory is not None
        engines.stack.memory.stop()
        flipped, truncated = sorted(files_of[0])[len(files_of[0]) // 2], sorted(files_of[1])[len(files_of[1]) // 2]
        corrupt(tier_dir, flipped, truncated)
        engines.restart_memory()
        scenario = send_and_compare(engines, first, cold)
        disk = engines.disk()
        result["corrupt_files"] = {
            **scenario, "flipped": flipped, "truncated": truncated, "files_removed": disk.num_bad_files,
            "write_errors": disk.num_write_errors, "integrity_ok": engines.integrity_ok(),
            "log_lines": engines.tier_log_lines()}

        # 3. A full disk.
        if mount_error is not None:
            result["full_disk"] = {"skipped": f"no tmpfs here: {mount_error}"}
        else:
            wait_for_files(tier_dir, num_files)  # the two damaged blocks, recomputed and written again
            disk = engines.disk()
            file_bytes = disk.num_bytes // disk.num_blocks
            page = os.sysconf("SC_PAGE_SIZE")
            st = os.statvfs(mount_point)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            size = used + 2 * -(-file_bytes // page) * page
            resize_error = _run(["mount", "-o", f"remount,size={size}", str(mount_point)])
            if resize_error is not None:
                result["full_disk"] = {"skipped": f"tmpfs not resized: {resize_error}"}
            else:
                errors_before, bad_before = disk.num_write_errors, disk.num_bad_files
                written_before = disk.num_bytes_written

                def num_written() -> int:  # files written during it (evictions make room: count bytes)
                    return (engines.disk().num_bytes_written - written_before) // file_bytes

                scenario = send_and_compare(engines, third, cold)
                wait_until(lambda: engines.disk().num_write_errors - errors_before + num_written()
                           >= len(third) * sizes.prompt_blocks, WAIT_S, "every block of wave 3 written or dropped")
                disk = engines.disk()
                again = send_and_compare(engines, third, cold)  # served on, the disk still full
                result["full_disk"] = {
                    **scenario, "same_tokens": scenario["same_tokens"] and again["same_tokens"], "fs_bytes": size,
                    "fs_free_bytes_before": size - used, "write_errors": disk.num_write_errors - errors_before,
                    "blocks_written": num_written(), "block_files": len(block_files(tier_dir)),
                    "files_removed": disk.num_bad_files - bad_before,
                    "integrity_ok": engines.integrity_ok(),
                    "log_lines": [line for line in engines.tier_log_lines()
                                  if "kv_tier_write_failed" in line or "kv_tier_budget_lowered" in line],
                    "fresh_service_starts": starts_on(mount_point / "fresh", engines.stack.directory)}
    finally:
        if engines is not None:
            engines.stop()
        if mount_error is None:
            if _run(["umount", str(mount_point)]) is not None:
                _run(["umount", "-l", str(mount_point)])
    return {"faults": result}


def starts_on(tier_dir: Path, run_dir: Path) -> bool:
    """Whether a memory service starts (SERVING) with its tier on a new directory of the full disk."""
    service = memory_process(run_dir / "fresh-memory.sock", ["--max-num-blocks", "4", "--kv-disk-dir", tier_dir],
                             log_file=run_dir / "fresh-memory.log")
    try:
        service.wait_ready(WAIT_S)
    except RuntimeError:
        return False
    finally:
        service.stop()
    return True


def _run(command: list[str]) -> str | None:
    """Runs a mount command: None when it worked, else its error."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return f"{command[0]}: {exc.strerror}"
    return None if done.returncode == 0 else (done.stderr.strip() or f"{command[0]} exited {done.returncode}")
