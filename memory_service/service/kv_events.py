"""KV events on the wire (``--kv-events-endpoint``): a ZMQ PUB socket in vLLM's format, and a replay socket.

What the events say and when they are made: memory_service/manager/kv_events.py. This module only
sends them, from a thread of its own, so a Step never waits for a subscriber, an encoder or a socket:
the log between them is bounded (its overflow counted), and a PUB socket drops what a slow
subscriber cannot take rather than block.

The wire format is vLLM's (``vllm.distributed.kv_events``: ``ZmqEventPublisher``, ``KVEventBatch``),
so that its subscribers (llm-d's KV-cache indexer, Dynamo's KV router, vLLM's own example) read ours:

- each message is three frames: the topic (``--kv-events-topic``), the batch's sequence number (8
  bytes, big-endian, from 0 at each start, one per batch), and the batch, msgpack;
- a batch is ``[ts, [event, ...], data_parallel_rank]`` (``ts`` seconds since the epoch, a float;
  the rank always 0: one memory service is one cache);
- an event is a map, its type's name under ``type`` first, then its fields in vLLM's order (msgspec's
  layout of vLLM's tagged structs, fields at their default left out, which vLLM's own
  ``msgspec.msgpack.Decoder(type=KVEventBatch)`` decodes): ``{"type": "BlockStored", "block_hashes",
  "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"}``
  (no LoRA: ``lora_id`` and ``lora_name`` nil; ``extra_keys`` left out without a cache salt, else one
  ``[namespace key hex]`` per block), ``{"type": "BlockRemoved", "block_hashes", "medium"}``,
  ``{"type": "AllBlocksCleared"}``. Why maps: vLLM's structs are tagged but not ``array_like``, so its
  decoder refuses an event sent as an array (the layout of its older example subscriber), and a
  decoder of maps skips the fields it does not know (vLLM adds some in most releases).
- replay (``--kv-events-replay-endpoint``, a ROUTER socket): a client (a REQ socket) sends a start
  sequence number (8 bytes, big-endian) and gets every batch still buffered from there on, one
  message ``[topic, seq, batch]`` each, then ``[b"", -1 as 8 signed bytes, b""]``, as vLLM's
  ``ZmqEventPublisher`` answers. The last
  ``REPLAY_BUFFER_BATCHES`` batches are kept, ``REPLAY_BUFFER_BYTES`` at most (batches of big blocks
  can be large); the first one of a start is ``AllBlocksCleared``. Why the replay socket's own send
  limit: ZMQ's default (1,000 messages per peer) would silently drop the rest of a longer replay,
  its end marker included, and the client would wait forever; so the limit is above the most one
  replay sends, and the socket is ROUTER_MANDATORY with a bounded wait: a client that does not read
  (or asks again before reading) has its replay cut short, logged, never silently.

Endpoint: as vLLM's, an address with a wildcard host (``tcp://*:5557``) or an ``ipc://`` path is
bound; any other (``tcp://indexer:5557``) is connected to, for a subscriber that binds (llm-d's
central indexer). The replay endpoint is always bound.
"""

from __future__ import annotations

import collections
import threading
import time

import msgpack
import zmq
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pagedserve.errors import PreconditionError
from pagedserve.log import get_logger

from memory_service.manager.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventLog

log = get_logger("memory_service.kv_events")

REPLAY_BUFFER_BATCHES = 10_000
REPLAY_BUFFER_BYTES = 64 << 20  # the payloads kept for replay, in all
REPLAY_SEND_TIMEOUT_MS = 1_000  # a replay's message that finds its client's queue full waits this long
MAX_EVENTS_PER_BATCH = 1_000  # one message stays small; a backlog goes out as several
PUB_HIGH_WATER_MARK = 100_000  # messages queued per subscriber before the PUB socket drops for it
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
CLOSE_FLUSH_S = 1.0  # at a stop: the events still in the log go out, for this long at most


def encode_event(event: KvEvent) -> dict:
    """One event in vLLM's layout (the module docstring)."""
    if isinstance(event, BlockStored):
        encoded = {"type": "BlockStored", "block_hashes": event.block_hashes,
                   "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                   "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None}
        if event.namespace is not None:
            encoded["extra_keys"] = [[event.namespace]] * len(event.block_hashes)
        return encoded
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def is_bound_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or an ipc/inproc path is bound, any other address connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """Publishes a ``KvEventLog`` (the module docstring); ``start`` binds, ``close`` flushes and stops.

    Args:
        events: the log the block manager and the tiers write to.
        endpoint: the PUB socket's address.
        replay_endpoint: the ROUTER socket's address (None: no replay).
        topic: the first frame of every message.
    """

    def __init__(self, events: KvEventLog, endpoint: str, replay_endpoint: str | None, topic: str) -> None:
        self.events = events
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._context = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque()  # (seq, payload), oldest first
        self._num_buffer_bytes = 0  # of the payloads in _buffer
        self.num_batches = 0  # sent; the next one's sequence number
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> None:
        """Opens the sockets here (a bad or taken address fails the service's start), then sends from a
        thread of its own, which alone uses them from then on; the first batch is ``AllBlocksCleared``."""
        pub = self._context.socket(zmq.PUB)
        pub.set_hwm(PUB_HIGH_WATER_MARK)
        pub.setsockopt(zmq.LINGER, int(CLOSE_FLUSH_S * 1000))
        try:
            if is_bound_endpoint(self.endpoint):
                pub.bind(self.endpoint)
            else:
                pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A whole replay fits the queue; past it a send waits, then fails (the module docstring).
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_BUFFER_BATCHES + 1)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDTIMEO, REPLAY_SEND_TIMEOUT_MS)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            pub.close(0)
            if self._replay is not None:
                self._replay.close(0)
            self._context.term()
            raise PreconditionError(
                f"kv_events: cannot open {self.endpoint} or {self.replay_endpoint}: {exc}") from None
        self._pub = pub
        self.events.cleared()
        self._thread.start()
        log.info("kv_events_started", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint,
                 topic=self._topic.decode())

    def close(self) -> None:
        """Sends what the log still holds (for ``CLOSE_FLUSH_S`` at most), then closes the sockets."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(CLOSE_FLUSH_S + 1.0)
        if not self._thread.is_alive():  # else it is stuck in a send: the process exit ends it
            self._context.destroy(linger=int(CLOSE_FLUSH_S * 1000))
        log.info("kv_events_stopped", num_batches=self.num_batches, num_events=self.events.num_events,
                 num_dropped_events=self.events.num_dropped_events)

    def _run(self) -> None:
        flush_until = None
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            events = self.events.take(timeout_s=0.05)
            for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                self._send(events[start:start + MAX_EVENTS_PER_BATCH])
            if self._stopping.is_set():
                flush_until = flush_until or time.monotonic() + CLOSE_FLUSH_S
                if not events or time.monotonic() > flush_until:
                    return

    def _send(self, events: list[KvEvent]) -> None:
        seq = self.num_batches
        payload = msgpack.packb([time.time(), [encode_event(e) for e in events], 0])
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self._num_buffer_bytes += len(payload)
        while len(self._buffer) > REPLAY_BUFFER_BATCHES or self._num_buffer_bytes > REPLAY_BUFFER_BYTES:
            self._num_buffer_bytes -= len(self._buffer.popleft()[1])
        self.num_batches += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", num_frames=len(frames))
            return
        client, delimiter, start = frames
        start_seq = int.from_bytes(start, "big")
        try:
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, delimiter, self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, delimiter, b"", END_OF_REPLAY, b""))
        except zmq.ZMQError as exc:  # Again: its queue stayed full; EHOSTUNREACH: it left
            log.warning("kv_events_replay_cut_short", start_seq=start_seq, error=str(exc))


class KvEventCollector(Collector):
    """``pagedserve_memory_kv_events_*``: events made, dropped (the log full: its backlog is replaced by
    ``AllBlocksCleared``, so a subscriber's index then lacks the blocks cached before, never holds
    false ones; memory_service/manager/kv_events.py), and batches sent."""

    def __init__(self, publisher: KvEventPublisher) -> None:
        self._publisher = publisher

    def collect(self):
        events = self._publisher.events
        yield CounterMetricFamily("pagedserve_memory_kv_events", "KV events made (blocks stored, removed, cleared)",
                                  value=events.num_events)
        yield CounterMetricFamily("pagedserve_memory_kv_events_dropped",
                                  "KV events dropped because the publisher fell behind",
                                  value=events.num_dropped_events)
        yield CounterMetricFamily("pagedserve_memory_kv_event_batches", "KV event batches published",
                                  value=self._publisher.num_batches)
