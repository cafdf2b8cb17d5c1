"""KV event feeds: one per upstream, from its engine's ZMQ publisher into the exact index.

Wire format (vLLM's `ZmqEventPublisher`, which the bundled engine follows): the PUB socket at
`endpoint` sends `[topic, seq, payload]`, seq an 8-byte big-endian counter 0, 1, 2, ... per
publisher, payload a msgpack KVEventBatch (`kv_index.decode_batch`). The ROUTER socket at
`replay_endpoint` answers a DEALER's `[b"", start]` with every batch it still buffers (vLLM:
its last 10,000) whose seq >= start, as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", -1, b""]` (vLLM 0.32; before it, and in llm-d's reading, without the topic frame:
`[b"", seq, payload]` and `[b"", -1, b""]`; both are read).

A feed has applied every batch up to `last`. All catching up is one operation, `_sync`: a
replay request from `last` (from 0 at first). The answer's first batch must be `last` itself,
with the payload that was applied (a digest): that proves the publisher is the same process,
and alive; what follows is applied in order. If `last` is not there, the publisher restarted
(its batch `last` differs, or it has fewer) or has dropped it (more than its buffer went by
unseen): the feed's blocks are cleared — a *resync*, counted by reason — and rebuilt from a
replay from 0, whatever the publisher still has. A sync runs

- at start: a gateway replica that starts after the traffic catches up;
- on a gap in live sequence numbers (seq > last + 1);
- on a live seq at or below `last` that is not a batch a replay already applied (a restarted
  publisher counting from 0 again);
- after the PUB connection drops (the engine went away; it may come back as a new process,
  whose first batches can look like a continuation: the digest check tells);
- as the liveness probe, after `probe_s` without a message: answered at once with batch
  `last` alone when nothing is new.

Live messages that arrive during a replay wait in the SUB socket's queue and are read after
it; those the replay already applied are skipped.

Fallback: only a feed that is in sync is *live* (`KVEventFeeds.live`, the set of upstream
names the scorer probes). A replay unanswered within `timeout_s`, a dropped connection, a
resync in progress, an upstream without `kv_events`: not live, and the scorer uses the
approximate index for it, which is fed for every upstream all along, so the switch is free.

Each feed is one asyncio task on the gateway's loop (zmq.asyncio: the sockets' file
descriptors are polled by the loop, nothing blocks it). Applying a batch is plain Python
(decode, one xxh64 and a few dict operations per block: ~0.15 ms for a decode step's batch,
1-2 ms for a full 8k-token prefill step's on a slow core), so the feed yields to the loop
after every batch, live or replayed: requests wait at most one batch, never a whole replay.
A thread would not help: the work holds the GIL.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import xxhash
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from zmq.utils.monitor import parse_monitor_message

from prefixgate.common.runtime import cancel_and_wait
from prefixgate.plugins.prefix_route.kv_index import EventFormatError, KVEventIndex, decode_batch

log = logging.getLogger("prefixgate.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)   # the replay's end marker
QUEUE = 10_000            # live messages held while a replay runs (vLLM's buffer_steps); past
                          # that ZMQ drops them, which the next message shows as a gap
REPLAYED_KEPT = QUEUE     # digests of replayed batches kept to recognise them when read live
RECONCILE_S = 0.25        # how often the feeds are matched with the upstreams' settings


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _seq(frame: bytes) -> int | None:
    return int.from_bytes(frame, "big") if len(frame) == 8 else None


class KVEventFeed:
    """One upstream's publisher, applied to `index` under the upstream's name."""

    def __init__(self, name: str, cfg: dict, feeds: KVEventFeeds):
        self.name, self.cfg, self.feeds = name, cfg, feeds
        self.index: KVEventIndex = feeds.index
        self.last = -1                      # seq of the last batch applied
        self.last_digest: int | None = None
        self.replayed: dict[int, int] = {}  # seq -> digest, applied from a replay, oldest first
        self.pending: str | None = "start"  # why a sync is due (None: in sync)
        self.heard = 0.0                    # when the publisher was last heard from
        self.up = False
        self.received = Counter()           # batches, events
        self.replays = Counter()            # by reason: start, gap, restart, reconnect, probe
        self.resyncs = Counter()            # by reason: restart, gap
        self.gaps = self.malformed = 0
        self._sub = self._monitor = self._dealer = self._poller = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    # --- the loop ----------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            self._open()
            while True:
                if self.pending is None and time.monotonic() - self.heard >= self.feeds.probe_s:
                    self.pending = "probe"
                if self.pending is not None:
                    if not await self._sync(self.pending):
                        await asyncio.sleep(self.feeds.probe_s)     # not answering: retry later
                    continue
                await self._receive()
        finally:
            self._set_up(False)
            self._close()

    async def _receive(self) -> None:
        """Wait for live messages (or a dropped connection) until the next probe is due."""
        wait_ms = max(1, int((self.heard + self.feeds.probe_s - time.monotonic()) * 1000))
        ready = dict(await self._poller.poll(wait_ms))
        if self._monitor in ready:
            await self._on_monitor()
        while self.pending is None and self._sub.get(zmq.EVENTS) & zmq.POLLIN:
            self._on_live(await self._sub.recv_multipart())
            await asyncio.sleep(0)      # requests in between batches (a ready recv never yields)

    async def _on_monitor(self) -> None:
        while self._monitor.get(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED and self.pending is None:
                log.warning("kv_events %s: publisher %s disconnected", self.name,
                            self.cfg["endpoint"])
                self._set_up(False)     # its cache may be gone with it: the sync will tell
                self.pending = "reconnect"

    def _on_live(self, frames: list[bytes]) -> None:
        seq = _seq(frames[1]) if len(frames) == 3 else None
        if seq is None:
            self.malformed += 1
            return
        self.heard = time.monotonic()
        payload = frames[2]
        replayed = self._forget_replayed_up_to(seq)
        if seq == self.last + 1:
            self._apply(seq, payload, _digest(payload))
        elif seq > self.last + 1:
            self.gaps += 1
            self.pending = "gap"
        elif replayed != _digest(payload):     # not the batch a replay gave: a new publisher
            self._set_up(False)
            self.pending = "restart"

    def _forget_replayed_up_to(self, seq: int) -> int | None:
        """The digest replayed under `seq`, if any; older ones can no longer arrive live
        (SUB delivers in order), so they go."""
        replayed = self.replayed
        while replayed:
            oldest = next(iter(replayed))
            if oldest > seq:
                break
            digest = replayed.pop(oldest)
            if oldest == seq:
                return digest
        return None

    # --- catching up -------------------------------------------------------------------------
    async def _sync(self, reason: str) -> bool:
        """Replay from `last`; clear and rebuild from 0 when `last` cannot be continued.
        False when the publisher did not answer in time (the feed is then not live)."""
        self.replays[reason] += 1
        try:
            lost = await self._catch_up()
            if lost is not None:
                self.resyncs[lost] += 1
                log.warning("kv_events %s: %s; rebuilding its blocks from the publisher's "
                            "buffer", self.name, "publisher restarted" if lost == "restart"
                            else "batches lost beyond the publisher's buffer")
                self._reset()
                self.replays["resync"] += 1
                await self._catch_up()
        except TimeoutError:
            if self.up or self.replays["start"] == 1 == sum(self.replays.values()):
                log.warning("kv_events %s: no answer from %s within %ss; routing it by the "
                            "approximate index until it answers", self.name,
                            self.cfg["replay_endpoint"], self.feeds.timeout_s)
            self._set_up(False)
            self._reopen_dealer()       # a late answer must not be read as the next one's
            return False
        self.pending = None
        self.heard = time.monotonic()
        self._set_up(True)
        return True

    async def _catch_up(self) -> str | None:
        """Apply what the publisher has after `last`. A reason (restart, gap) when `last`
        itself is not there as it was applied; None: caught up."""
        verify = self.last >= 0
        await self._dealer.send_multipart([b"", max(self.last, 0).to_bytes(8, "big")])
        while (batch := await self._next_replayed()) is not None:
            seq, payload = batch
            digest = _digest(payload)
            if verify:
                if seq != self.last or digest != self.last_digest:
                    return "gap" if seq > self.last else "restart"
                verify = False
            elif seq > self.last:
                if self.last >= 0 and seq != self.last + 1:
                    return "gap"                # a hole in the publisher's own buffer
                self._apply(seq, payload, digest)
                self._remember_replayed(seq, digest)
                await asyncio.sleep(0)          # requests in between batches
        return "restart" if verify else None    # nothing at all: it no longer has `last`

    async def _next_replayed(self) -> tuple[int, bytes] | None:
        """The answer's next (seq, payload); None at the end marker."""
        while True:
            async with asyncio.timeout(self.feeds.timeout_s):
                frames = await self._dealer.recv_multipart()
            if frames and not frames[0]:
                frames = frames[1:]             # the empty delimiter of the ROUTER envelope
            if len(frames) in (2, 3):           # [topic,] seq, payload: the topic is ignored
                if frames[-2] == END_SEQ:
                    return None
                seq = _seq(frames[-2])
                if seq is not None:
                    return seq, frames[-1]
            self.malformed += 1

    def _remember_replayed(self, seq: int, digest: int) -> None:
        self.replayed[seq] = digest
        if len(self.replayed) > REPLAYED_KEPT:
            del self.replayed[next(iter(self.replayed))]

    def _apply(self, seq: int, payload: bytes, digest: int) -> None:
        try:
            events = decode_batch(payload)
        except EventFormatError as e:
            if not self.malformed:
                log.warning("kv_events %s: batch %d is no KVEventBatch: %s", self.name, seq, e)
            self.malformed += 1
            events = []
        self.index.apply(self.name, events)
        self.last, self.last_digest = seq, digest
        self.received["batches"] += 1
        self.received["events"] += len(events)

    def _reset(self) -> None:
        """Forget this publisher's stream: blocks, position, and the sockets' queues."""
        self._set_up(False)
        self.index.clear(self.name)
        self.last, self.last_digest = -1, None
        self.replayed.clear()
        self._close()
        self._open()

    def _set_up(self, up: bool) -> None:
        if up and not self.up:
            log.info("kv_events %s: live at seq %d (%d blocks)", self.name, self.last,
                     self.index.size(self.name))
        self.up = up
        self.feeds.set_live(self, up)

    # --- sockets -----------------------------------------------------------------------------
    def _open(self) -> None:
        zctx, cfg = self.feeds.zmq_context, self.cfg
        self._sub = zctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, QUEUE)
        self._sub.setsockopt(zmq.SUBSCRIBE, cfg["topic"].encode())
        self._connect(self._sub, cfg["endpoint"])
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.asyncio.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._reopen_dealer()

    def _reopen_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._dealer = self.feeds.zmq_context.socket(zmq.DEALER)
        self._connect(self._dealer, self.cfg["replay_endpoint"])

    @staticmethod
    def _connect(sock, endpoint: str) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)    # back off from a dead engine to 2 s
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)

    def _close(self) -> None:
        if self._sub is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
        self._sub = self._monitor = self._dealer = self._poller = None


class KVEventFeeds:
    """The feeds of every upstream that has `kv_events`, kept in step with the upstream set
    (discovery, reloads): a feed starts for each new one, and one whose upstream left or whose
    settings changed is closed and its blocks dropped (`index.remove`)."""

    def __init__(self, gw, block_tokens: int, capacity: int, probe_s: float, timeout_s: float):
        self.gw = gw
        self.index = KVEventIndex(block_tokens, capacity)
        self.probe_s, self.timeout_s = probe_s, timeout_s
        self.live: set[str] = set()         # upstreams scored from the exact index
        self.feeds: dict[str, KVEventFeed] = {}
        self.zmq_context: zmq.asyncio.Context | None = None
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()     # feeds of upstreams that left

    async def start(self) -> None:
        self.zmq_context = zmq.asyncio.Context()
        self.reconcile(self.gw.upstreams)
        if not self.feeds and self.gw.config.get("discovery") is None:
            log.warning("prefix_route has index: kv_events, but no upstream has `kv_events:` "
                        "(its publisher's endpoints): all are routed by the approximate index")
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for feed in list(self.feeds.values()):
            await feed.close()
        await asyncio.gather(*self._closing)
        self.feeds.clear()
        self.live.clear()
        if self.zmq_context is not None:
            self.zmq_context.destroy(linger=0)
            self.zmq_context = None

    async def _watch(self) -> None:
        # a reload changes a kept upstream's settings in place, after the list is swapped
        while True:
            await asyncio.sleep(RECONCILE_S)
            self.reconcile(self.gw.upstreams)

    def reconcile(self, upstreams) -> None:
        if self.zmq_context is None:
            return                          # not started (or closed)
        wanted = {u.name: u.cfg["kv_events"] for u in upstreams if u.cfg.get("kv_events")}
        for name in [n for n, f in self.feeds.items() if wanted.get(n) != f.cfg]:
            feed = self.feeds.pop(name)
            self.live.discard(name)
            self.index.remove(name)
            closing = asyncio.get_running_loop().create_task(feed.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        for name, cfg in wanted.items():
            if name not in self.feeds:
                feed = self.feeds[name] = KVEventFeed(name, cfg, self)
                feed.start()
        self.index.retain(self.feeds)

    def set_live(self, feed: KVEventFeed, up: bool) -> None:
        if self.feeds.get(feed.name) is feed:   # a closing feed no longer speaks for its name
            (self.live.add if up else self.live.discard)(feed.name)

    def collect(self):
        """The feeds' metric families, read at scrape time."""
        feeds = sorted(self.feeds.items())
        up = GaugeMetricFamily("prefixgate_route_kv_events_up", "1 while the upstream's KV event "
                               "feed is in sync and routes by the exact index", labels=["upstream"])
        received = CounterMetricFamily("prefixgate_route_kv_events_received", "KV event batches "
                                       "and events applied", labels=["upstream", "kind"])
        replays = CounterMetricFamily("prefixgate_route_kv_events_replays", "Replay requests by "
                                      "reason (start, gap, restart, reconnect, probe, resync)",
                                      labels=["upstream", "reason"])
        gaps = CounterMetricFamily("prefixgate_route_kv_events_gaps", "Gaps in live sequence "
                                   "numbers", labels=["upstream"])
        resyncs = CounterMetricFamily("prefixgate_route_kv_events_resyncs", "Exact index cleared "
                                      "and rebuilt, by reason (restart, gap)",
                                      labels=["upstream", "reason"])
        ignored = CounterMetricFamily("prefixgate_route_kv_events_ignored_blocks", "Stored blocks "
                                      "not indexed (another block size, unknown parent, LoRA)",
                                      labels=["upstream"])
        malformed = CounterMetricFamily("prefixgate_route_kv_events_malformed", "Messages or "
                                        "batches that could not be read", labels=["upstream"])
        blocks = GaugeMetricFamily("prefixgate_route_kv_index_blocks", "Blocks the exact index "
                                   "holds per upstream (from its KV events)", labels=["upstream"])
        for name, f in feeds:
            up.add_metric([name], 1.0 if f.up else 0.0)
            for kind in ("batches", "events"):
                received.add_metric([name, kind], f.received[kind])
            for reason, n in sorted(f.replays.items()):
                replays.add_metric([name, reason], n)
            gaps.add_metric([name], f.gaps)
            for reason in ("restart", "gap"):
                resyncs.add_metric([name, reason], f.resyncs[reason])
            engine = self.index.engines.get(name)
            ignored.add_metric([name], engine.ignored if engine is not None else 0)
            malformed.add_metric([name], f.malformed)
            blocks.add_metric([name], self.index.size(name))
        yield from (up, received, replays, gaps, resyncs, ignored, malformed, blocks)
