"""Backend load from each upstream's Prometheus `/metrics`, polled on an interval.

The gateway's own in-flight counts only see this replica's requests; a backend's metrics see
every replica's. Polling them gives all gateway replicas roughly the same view of load. Between
polls the estimate follows this replica's own changes:

    requests = running + waiting (at the poll) + (in-flight now − in-flight at the poll)

A polled upstream's load (`Upstream.load`) is that estimate plus the requests waiting in this
gateway for a slot on it (the backend has not seen those yet).

A sample stops being used once it is older than `stale_after_s` (a backend that stopped
answering, or answers with an error: its in-flight count here is used instead), but not while
the backend's answers come late: a server too busy to answer its /metrics within the poll's
wait is busy, and its last sample says so better than this replica's own count, which does not
see the other replicas' requests (a busy vLLM CPU server in CI, starved, answered none of its
polls for most of two minutes and looked idle after 2.5 s).

Names read (summed over label sets, e.g. per model):

    engine      running / waiting / KV usage (0..1)
    vLLM        vllm:num_requests_running / vllm:num_requests_waiting /
                vllm:kv_cache_usage_perc (older: vllm:gpu_cache_usage_perc)
    SGLang      sglang:num_running_reqs / sglang:num_queue_reqs / sglang:token_usage
    prefixgate  prefixgate:num_requests_running / prefixgate:num_requests_waiting /
                prefixgate:kv_cache_usage_perc
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.common.runtime import cancel_and_wait

log = logging.getLogger("prefixgate.load_poll")

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs",
           "prefixgate:num_requests_running")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs",
           "prefixgate:num_requests_waiting")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
            "prefixgate:kv_cache_usage_perc")
_WANTED = frozenset(RUNNING + WAITING + KV_USAGE)
_WANTED_PREFIXES = tuple(n + c for n in _WANTED for c in " {")


@dataclass(slots=True)
class Sample:
    running: float
    waiting: float
    kv_usage: float | None
    inflight_at_poll: int       # this replica's in-flight count when the sample arrived
    t: float                    # monotonic time of the sample
    late: float = 0.0           # the last poll since then whose answer came too late


def parse_metrics(text: str) -> tuple[float, float, float | None] | None:
    """(running, waiting, kv usage) from a Prometheus text page; None if it has none of them."""
    # A vLLM page runs to hundreds of lines of histograms: hand the parser only our samples.
    lines = [ln for ln in text.splitlines() if ln.startswith(_WANTED_PREFIXES)]
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for s in family.samples:
            if s.name in _WANTED:
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    if not any(n in sums for n in RUNNING + WAITING):
        return None
    running = next((sums[n] for n in RUNNING if n in sums), 0.0)
    waiting = next((sums[n] for n in WAITING if n in sums), 0.0)
    kv = next((sums[n] for n in KV_USAGE if n in sums), None)
    return running, waiting, kv


class LoadPoller:
    """Polls every upstream's /metrics every `interval_s`; `requests(up)` is the estimate above.

    A sample older than `stale_after_s` is ignored and the in-flight count is used instead;
    a poll whose answer came too late keeps the last sample in use (module doc).
    """

    def __init__(self, gw, interval_s: float, timeout_s: float | None = None,
                 path: str = "/metrics"):
        self.gw = gw
        self.interval_s = interval_s
        # a CPU server's API process shares its cores with the engine: its /metrics can take
        # most of a second while it prefills, and that is no reason to forget its load
        self.timeout_s = timeout_s or max(interval_s, 1.0)
        self.stale_after_s = 3 * interval_s + self.timeout_s
        self.path = path
        self.samples: dict[str, Sample] = {}
        self._task: asyncio.Task | None = None
        self.clock = time.monotonic     # the fleet simulator's polls run on its own clock

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for up in self.gw.upstreams:
            if up.polled is self:
                up.polled = None        # its samples would only go stale

    def requests(self, up) -> float:
        s = self._fresh(up)
        if s is None:
            return float(up.inflight)
        return max(0.0, s.running + s.waiting + up.inflight - s.inflight_at_poll)

    def kv_usage(self, up) -> float | None:
        s = self._fresh(up)
        return None if s is None else s.kv_usage

    def waiting(self, up) -> float | None:
        """The requests the backend said wait for a prefill (None: no fresh sample); the
        predicted_ttft policy counts the ones beyond this gateway's own as prefill work."""
        s = self._fresh(up)
        return None if s is None else s.waiting

    def _fresh(self, up) -> Sample | None:
        s = self.samples.get(up.name)
        if s is None or self.clock() - max(s.t, s.late) > self.stale_after_s:
            return None
        return s

    async def poll_once(self) -> None:
        ups = list(self.gw.upstreams)
        await asyncio.gather(*(self._poll(u) for u in ups))
        names = {u.name for u in ups}
        for gone in [n for n in self.samples if n not in names]:
            del self.samples[gone]

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            await self.poll_once()
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def _poll(self, up) -> None:
        if up.session is None or up.session.closed:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                async with up.session.get(up.url + self.path) as r:
                    if r.status != 200:
                        return
                    text = await r.text()
        except TimeoutError as e:
            if not isinstance(e, aiohttp.ServerTimeoutError):   # connected; the answer late
                self._answered_late(up)
            log.debug("metrics poll of %s timed out", up.name)
            return
        except Exception as e:      # a backend without /metrics, or down: fall back to in-flight
            log.debug("metrics poll of %s failed: %s", up.name, e)
            return
        parsed = parse_metrics(text)
        if parsed is not None:
            self.samples[up.name] = Sample(*parsed, up.inflight, self.clock())
            up.polled = self            # Upstream.load and kv_usage read it

    def _answered_late(self, up) -> None:
        """The backend took longer than the poll waits: busy, so its last sample stays in use,
        if it still was (one gone stale before, after errors, stays gone). A backend that
        answers nothing at all fails its health checks and is ejected."""
        s = self._fresh(up)
        if s is not None:
            s.late = self.clock()
