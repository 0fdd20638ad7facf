"""A KV-event subscriber built on vLLM's own classes: which blocks a memory service holds, per medium.

Run by vLLM's python (``.venv-vllm``, benchmarks/vllm_peer.py finds it), never ours: it decodes every
batch with ``msgspec.msgpack.Decoder(type=KVEventBatch)`` from ``vllm.distributed.kv_events``, as a
router built on vLLM would, so a batch it cannot decode is our wire format's bug, not its. It keeps
the index a router keeps (block hash -> parent, tokens, extra keys, per medium) and answers on its
standard streams: it prints ``ready`` once its sockets are open, then, for each ``dump`` line read,
one JSON line (below); ``quit`` or the end of its input stops it.

Sequence numbers (as vLLM's example subscriber): a batch past the next expected one asks the replay
socket for the gap; a publisher that connects again (a restart: its numbers start over at 0, its
first batch ``AllBlocksCleared``) is seen on the SUB socket's monitor, and the index is then rebuilt
from a replay from 0. A ``dump`` first catches up through the replay socket, so a subscriber that
joined after the last batch still sees it.

The dump: ``{"media": {medium: [{"hash", "parent", "token_ids", "extra_keys"}, ...]}, "history":
[[type, medium, num_blocks], ...], "num_batches", "num_restarts", "next_seq"}``, ``history`` every
event applied, in order (``medium`` None for ``AllBlocksCleared``).

    .venv-vllm/bin/python benchmarks/kv_events_subscriber.py --endpoint tcp://127.0.0.1:5557 \\
        --replay-endpoint tcp://127.0.0.1:5558
"""

from __future__ import annotations

import argparse
import json
import sys

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_MS = 5_000  # a replay that stays silent this long is asked again at the next chance


class Index:
    """The blocks each medium holds, rebuilt from decoded batches, as a prefix router keeps them."""

    def __init__(self) -> None:
        self.media: dict[str, dict[int, dict]] = {}
        self.history: list[list] = []
        self.num_batches = 0

    def apply(self, batch: KVEventBatch) -> None:
        self.num_batches += 1
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.media.clear()
                self.history.append(["AllBlocksCleared", None, 0])
            elif isinstance(event, BlockStored):
                blocks = self.media.setdefault(event.medium, {})
                parent = event.parent_block_hash
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size:(i + 1) * event.block_size]
                    extra = list(event.extra_keys[i]) if event.extra_keys else None
                    blocks[block_hash] = {"hash": block_hash, "parent": parent, "token_ids": tokens,
                                          "extra_keys": extra}
                    parent = block_hash
                self.history.append(["BlockStored", event.medium, len(event.block_hashes)])
            elif isinstance(event, BlockRemoved):
                blocks = self.media.setdefault(event.medium, {})
                for block_hash in event.block_hashes:
                    blocks.pop(block_hash, None)
                self.history.append(["BlockRemoved", event.medium, len(event.block_hashes)])

    def dump(self) -> dict:
        return {"media": {medium: list(blocks.values()) for medium, blocks in self.media.items()},
                "history": self.history, "num_batches": self.num_batches}


class Subscriber:
    """A SUB socket (bound, or connected to a publisher that binds) and a DEALER on the replay ROUTER."""

    def __init__(self, context: zmq.Context, endpoint: str, replay_endpoint: str | None, topic: str,
                 bind: bool) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.topic = topic.encode()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_socket = None
        if replay_endpoint is not None:
            self.replay_socket = context.socket(zmq.DEALER)
            self.replay_socket.setsockopt(zmq.SNDTIMEO, REPLAY_TIMEOUT_MS)
            self.replay_socket.connect(replay_endpoint)
        self.index = Index()
        self.next_seq = 0  # of the publisher connected now
        self.num_connects = 0
        self.is_restarted = False  # a publisher connected again: rebuild from a replay from 0

    def poll(self, timeout_ms: int) -> None:
        """Applies what arrived within ``timeout_ms``."""
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)
            self.num_connects += 1
            self.is_restarted = self.is_restarted or self.num_connects > 1
        if not self.sub.poll(timeout_ms):
            return
        topic, seq_bytes, payload = self.sub.recv_multipart()
        if topic != self.topic:
            return
        seq = int.from_bytes(seq_bytes, "big")
        if self.is_restarted:
            self.next_seq, self.is_restarted = 0, False
        if seq < self.next_seq:
            return  # applied already, from a replay
        if seq > self.next_seq and not self.replay(self.next_seq, seq):
            return
        self.index.apply(self.decoder.decode(payload))
        self.next_seq = seq + 1

    def catch_up(self) -> None:
        """Applies what the replay socket holds past what was applied (a subscriber that joined late)."""
        if self.is_restarted:
            self.next_seq, self.is_restarted = 0, False
        self.replay(self.next_seq, None)

    def replay(self, start_seq: int, end_seq: int | None) -> bool:
        """Applies the batches from ``start_seq`` up to ``end_seq`` (None: all) from the replay socket;
        False when it did not answer."""
        if self.replay_socket is None:
            return False
        try:
            self.replay_socket.send_multipart([b"", start_seq.to_bytes(8, "big")])
        except zmq.Again:
            return False
        while True:
            if not self.replay_socket.poll(REPLAY_TIMEOUT_MS):
                return False
            *_, seq_bytes, payload = self.replay_socket.recv_multipart()  # [b"", topic, seq, batch]
            if seq_bytes == END_OF_REPLAY:
                return True
            seq = int.from_bytes(seq_bytes, "big")
            if seq >= self.next_seq and (end_seq is None or seq < end_seq):
                self.index.apply(self.decoder.decode(payload))
                self.next_seq = seq + 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="the publisher's PUB address")
    parser.add_argument("--replay-endpoint", default=None, help="the publisher's replay ROUTER address")
    parser.add_argument("--topic", default="kv-events")
    parser.add_argument("--bind", action="store_true", help="bind the SUB socket (the publisher connects)")
    args = parser.parse_args(argv)
    context = zmq.Context()
    subscriber = Subscriber(context, args.endpoint, args.replay_endpoint, args.topic, args.bind)
    poller = zmq.Poller()
    poller.register(sys.stdin, zmq.POLLIN)
    print("ready", flush=True)
    while True:
        subscriber.poll(20)
        if not poller.poll(0):
            continue
        command = sys.stdin.readline().strip()
        if command in ("", "quit"):
            break
        if command == "dump":
            subscriber.catch_up()
            dump = subscriber.index.dump()
            print(json.dumps({**dump, "num_restarts": max(0, subscriber.num_connects - 1),
                              "next_seq": subscriber.next_seq}), flush=True)
    context.destroy(linger=0)


if __name__ == "__main__":
    main()
