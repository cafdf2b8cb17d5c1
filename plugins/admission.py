"""Admission control: concurrency caps, a priority queue, and a separate lane for long prompts.

A request holds a slot from `admit` until `on_finish` (which also runs when the client goes
away). Slots are counted globally and per upstream; when none is free the request waits in
its lane's queue, highest priority first, then first come first served.

Two lanes: a prompt longer than `long_prompt_tokens` (when a tokenizer filled `ctx.tokens`)
or `long_prompt_chars` (request body size otherwise) goes to the long lane, which may hold
at most `long_max_inflight` slots. Freed slots go to waiting short requests first, so a
short request never waits behind a long one — the point of the gateway is TTFT.

A request is routed once, before it queues (`proxy/route.py`), and waits for a slot on the
upstream it was routed to. Only when that upstream leaves while the request waits (a reload,
discovery, an ejection) is it routed again.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import math
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import cancel_and_wait
from prefixgate.common.schema import Key, non_negative, positive
from prefixgate.proxy.plugin import Plugin

log = logging.getLogger("prefixgate.admission")

PRIORITY_HEADER = "x-prefixgate-priority"
PRIORITY_RANGE = (-1000, 1000)


@dataclass(order=True)
class Waiter:
    sort: tuple                                  # (-priority, arrival): heap order
    ctx: object = field(compare=False)
    long: bool = field(compare=False)
    fut: asyncio.Future = field(compare=False)
    dead: bool = field(default=False, compare=False)   # timed out or client gone


class Admission(Plugin):
    name = "admission"
    spec = {
        "max_inflight": Key(int, None, positive),       # global cap (default: none beyond
                                                        # the sum of the per-upstream caps)
        "per_upstream": Key(int, None, positive),       # default: each upstream's max_inflight
        "max_queue": Key(int, None, non_negative),      # waiters beyond this → 429 at once
                                                        # (default: 4x the fleet's slots)
        "queue_timeout_s": Key((int, float), 30.0, positive),
        "long_prompt_tokens": Key(int, 2048, positive),
        "long_prompt_chars": Key(int, 8192, positive),
        "long_max_inflight": Key(int, None, positive),  # default: a quarter of the capacity
        "priority_header": Key(bool, True),             # honour x-prefixgate-priority
        "lanes": Key(bool, True),                       # false: one FIFO lane for all
    }

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        self.held: dict = {}                  # Upstream -> slots held
        self.total = 0
        self.long_total = 0
        # lane (is long) -> upstream -> heap of the Waiters routed to it
        self.queues: dict[bool, dict] = {False: {}, True: {}}
        self.waiting = 0
        self.rejected = {"queue_full": 0, "timeout": 0}
        self._seq = itertools.count()
        self._ticker: asyncio.Task | None = None
        gw.registry.register(_AdmissionCollector(self))

    # --- lifecycle: a slow tick notices upstreams that left and capacity that appears
    # without a release (a reload raising max_inflight) ------------------------------------
    async def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self._tick())

    async def close(self) -> None:
        await cancel_and_wait(self._ticker)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self.waiting:
                try:
                    self._reroute_departed()
                    self._dispatch()
                except Exception:      # keep ticking: waiters depend on it
                    log.exception("admission dispatch failed")

    # --- capacity --------------------------------------------------------------------------
    def cap(self, up) -> int:
        return self.cfg["per_upstream"] or up.max_inflight

    def room(self, up) -> bool:
        return self.held.get(up, 0) < self.cap(up)

    def with_room(self, upstreams: list) -> list:
        """The `with_room` hook, the router's capacity filter: the upstreams with a free slot
        here (one pass, inline)."""
        held, per = self.held, self.cfg["per_upstream"]
        return [u for u in upstreams if held.get(u, 0) < (per or u.max_inflight)]

    def global_cap(self) -> int:
        return self.cfg["max_inflight"] or max(1, sum(self.cap(u) for u in self.gw.upstreams))

    def max_queue(self) -> int:
        return self.cfg["max_queue"] if self.cfg["max_queue"] is not None else \
            4 * self.global_cap()

    def long_cap(self) -> int:
        return self.cfg["long_max_inflight"] or max(1, self.global_cap() // 4)

    # --- hooks -----------------------------------------------------------------------------
    async def admit(self, ctx) -> None:
        max_queue = self.max_queue()
        if self.waiting >= max_queue:
            if self._try_now(ctx):
                return
            self.rejected["queue_full"] += 1
            raise HTTPError(429, f"admission queue is full ({max_queue} waiting)",
                            code="queue_full", headers={"Retry-After": "1"})
        long, priority = self._is_long(ctx), self._priority(ctx)
        if not self.waiting and self._lane_has_room(long) and self.room(ctx.upstream):
            self._grant(ctx, ctx.upstream, long)      # nobody waits: no queue entry needed
            return
        w = Waiter((-priority, next(self._seq)), ctx, long,
                   asyncio.get_running_loop().create_future())
        self._enqueue(w)
        self._dispatch()
        if w.fut.done():
            return
        try:
            async with asyncio.timeout(self.cfg["queue_timeout_s"]):
                await w.fut
        except TimeoutError:
            if self._abandon(w):
                raise self._timeout_error() from None
        except asyncio.CancelledError:
            self._abandon(w)
            raise

    def on_finish(self, ctx, error) -> None:
        slot = ctx.state.pop("admission", None)
        if slot is None:
            return
        up, long = slot
        self.held[up] -= 1
        if not self.held[up]:
            del self.held[up]
        self.total -= 1
        self.long_total -= long
        if self.waiting:
            self._dispatch()

    # --- queue -----------------------------------------------------------------------------
    def _try_now(self, ctx) -> bool:
        """With a full queue, a request may still go if its upstream has a slot right now."""
        long = self._is_long(ctx)
        up = ctx.upstream
        if self.queues[long].get(up) or not self._lane_has_room(long) or not self.room(up):
            return False
        self._grant(ctx, up, long)
        return True

    def _enqueue(self, w: Waiter) -> None:
        up = w.ctx.upstream
        heapq.heappush(self.queues[w.long].setdefault(up, []), w)
        up.waiting += 1
        self.waiting += 1

    def _dispatch(self) -> None:
        """Grant slots, short lane first, best waiter first among upstreams with room."""
        for long in (False, True):
            by_upstream = self.queues[long]
            while by_upstream and self._lane_has_room(long):
                best = None
                for up, heap in list(by_upstream.items()):
                    while heap and (heap[0].dead or heap[0].fut.done()):
                        heapq.heappop(heap)      # gone; its admit() did the counting
                    if not heap:
                        del by_upstream[up]
                    elif self.room(up) and (best is None or heap[0] < best[0]):
                        best = heap
                if best is None:
                    break                        # every waiter's upstream is full
                w = heapq.heappop(best)
                w.ctx.upstream.waiting -= 1
                self.waiting -= 1
                self._grant(w.ctx, w.ctx.upstream, long)
                w.fut.set_result(None)

    def _reroute_departed(self) -> None:
        """Route again the waiters whose upstream left the set or was ejected."""
        present = set(self.gw.upstreams)
        for by_upstream in self.queues.values():
            for up in [u for u in by_upstream if not (u.healthy and u in present)]:
                for w in by_upstream.pop(up):
                    if w.dead or w.fut.done():
                        continue
                    up.waiting -= 1
                    self.waiting -= 1
                    try:
                        w.ctx.upstream = self.gw.decide(w.ctx)
                    except HTTPError:
                        w.ctx.upstream = up      # nowhere to go: it waits (and times out)
                    self._enqueue(w)

    def _lane_has_room(self, long: bool) -> bool:
        if self.total >= self.global_cap():
            return False
        return not long or self.long_total < self.long_cap()

    def _grant(self, ctx, up, long: bool) -> None:
        ctx.upstream = up
        ctx.state["admission"] = (up, long)
        self.held[up] = self.held.get(up, 0) + 1
        self.total += 1
        self.long_total += long

    def _abandon(self, w: Waiter) -> bool:
        """Drop a waiter that stops waiting; False if it was granted a slot meanwhile."""
        if w.fut.done() and not w.fut.cancelled():
            return False                  # granted: on_finish will release the slot
        w.dead = True
        w.ctx.upstream.waiting -= 1
        self.waiting -= 1
        return True

    def _timeout_error(self) -> HTTPError:
        self.rejected["timeout"] += 1
        wait = f"{self.cfg['queue_timeout_s']}s"
        if not any(u.healthy for u in self.gw.upstreams):
            return HTTPError(503, f"no healthy upstream within {wait}",
                             code="no_healthy_upstream", headers={"Retry-After": "5"})
        retry = max(1, math.ceil(self.cfg["queue_timeout_s"] / 4))
        return HTTPError(429, f"no free slot within {wait} (admission.queue_timeout_s)",
                         code="queue_timeout", headers={"Retry-After": str(retry)})

    # --- classification --------------------------------------------------------------------
    def _is_long(self, ctx) -> bool:
        if not self.cfg["lanes"]:
            return False
        if ctx.tokens is not None:
            return len(ctx.tokens) > self.cfg["long_prompt_tokens"]
        return len(ctx.raw_body) > self.cfg["long_prompt_chars"]

    def _priority(self, ctx) -> int:
        """The API key's priority when it sets one, else the header's, else 0."""
        if ctx.priority:
            return ctx.priority
        if not self.cfg["priority_header"]:
            return 0
        values = ctx.headers.getall(PRIORITY_HEADER, [])
        if not values:
            return 0
        lo, hi = PRIORITY_RANGE
        try:
            if len(values) != 1:
                raise ValueError
            prio = int(values[0])
            if not lo <= prio <= hi:
                raise ValueError
        except ValueError:
            raise HTTPError(400, f"{PRIORITY_HEADER} must be one integer in {lo}..{hi}",
                            code="invalid_priority") from None
        ctx.priority = prio
        return prio


class _AdmissionCollector:
    def __init__(self, plugin: Admission):
        self.p = plugin

    def collect(self):
        waiting = GaugeMetricFamily("prefixgate_admission_waiting", "Requests waiting for a "
                                    "slot, by lane", labels=["lane"])
        for long, name in ((False, "short"), (True, "long")):
            waiting.add_metric([name], sum(not w.dead for heap in self.p.queues[long].values()
                                           for w in heap))
        held = GaugeMetricFamily("prefixgate_admission_slots", "Slots held, by lane",
                                 labels=["lane"])
        held.add_metric(["short"], self.p.total - self.p.long_total)
        held.add_metric(["long"], self.p.long_total)
        rejected = CounterMetricFamily("prefixgate_admission_rejected", "Requests refused by "
                                       "admission", labels=["reason"])
        for reason, n in self.p.rejected.items():
            rejected.add_metric([reason], n)
        yield waiting
        yield held
        yield rejected
