"""Upstream health: active `/health` probes, passive ejection, recovery.

`Upstream.healthy` is the one flag the router honours. It goes false when
- `unhealthy_threshold` probes in a row fail (no answer below 500 within `timeout_s`), or
- a connection to the upstream cannot be opened (refused, unreachable: nothing to wait for), or
- `max_5xx` answers in a row are 5xx or broken streams (a sick backend that still accepts);
and true again when, after at least `eject_s`, `healthy_threshold` probes in a row succeed
(or, with active probes off, as soon as `eject_s` has passed: one request then tests it).

Probes use their own small connection pool, so a saturated request pool cannot make a busy
upstream look dead.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixgate.common.runtime import cancel_and_wait
from prefixgate.common.schema import Key, non_negative, positive

log = logging.getLogger("prefixgate.health")

SPEC = {
    "interval_s": Key((int, float), 5.0, non_negative),   # 0 turns active probes off
    "timeout_s": Key((int, float), 2.0, positive),
    "path": Key(str, "/health"),
    "unhealthy_threshold": Key(int, 2, positive),          # failed probes in a row → eject
    "healthy_threshold": Key(int, 2, positive),            # good probes in a row → back
    "max_5xx": Key(int, 5, positive),                      # 5xx/broken answers in a row → eject
    "eject_on_connect_error": Key(bool, True),
    "eject_s": Key((int, float), 5.0, non_negative),       # shortest time out after an ejection
}


@dataclass
class State:
    probe_fails: int = 0
    probe_oks: int = 0
    bad_answers: int = 0
    ejected_at: float | None = None
    reason: str = ""
    ejections: int = 0
    last_probe: str = ""


class Health:
    def __init__(self, cfg: dict, gw):
        self.cfg = cfg
        self.gw = gw
        self.states: dict = {}           # Upstream -> State
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        gw.registry.register(self)     # its metrics: `collect`

    def state(self, up) -> State:
        st = self.states.get(up)
        if st is None:
            st = self.states[up] = State()
        return st

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=32, force_close=True),
            skip_auto_headers=("User-Agent",))
        # the model lists first, so the first requests already go where their model is
        await asyncio.gather(*(self.refresh_models(u) for u in self.gw.upstreams))
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._session is not None:
            await self._session.close()

    def reconfigure(self, cfg: dict) -> None:
        self.cfg = cfg       # the loop reads cfg on every round

    async def _run(self) -> None:
        last_probe = 0.0
        while True:
            interval = self.cfg["interval_s"]
            # wake often enough to end ejections on time even when probing is slow or off
            await asyncio.sleep(min(interval or 1.0, 1.0, self.cfg["eject_s"] or 1.0))
            try:
                last_probe = await self._round(interval, last_probe)
            except Exception:          # a bug here must not end health checking for good
                log.exception("health check round failed")

    async def _round(self, interval: float, last_probe: float) -> float:
        ups = list(self.gw.upstreams)
        for gone in set(self.states) - set(ups):
            del self.states[gone]
        now = time.monotonic()
        if interval and now - last_probe >= interval:
            await asyncio.gather(*(self._probe(u) for u in ups))
            return now
        if not interval:
            for up in ups:
                self._maybe_restore(up, probe_ok=None)
        return last_probe

    async def _probe(self, up) -> None:
        st = self.state(up)
        try:
            async with asyncio.timeout(self.cfg["timeout_s"]):
                async with self._session.get(up.url + self.cfg["path"]) as r:
                    await r.read()
                    # any answer below 500 means the server is up (a hosted API may have
                    # no /health and say 404; llama.cpp says 503 while loading)
                    ok, what = r.status < 500, f"HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            ok, what = False, "timeout" if isinstance(e, TimeoutError) else type(e).__name__
        st.last_probe = what
        if ok:
            st.probe_fails = 0
            st.probe_oks += 1
            self._maybe_restore(up, probe_ok=True)
            await self.refresh_models(up)
        else:
            st.probe_oks = 0
            st.probe_fails += 1
            if up.healthy and st.probe_fails >= self.cfg["unhealthy_threshold"]:
                self.eject(up, f"{st.probe_fails} failed probes ({what})")

    async def refresh_models(self, up) -> None:
        """Learn what `up` serves from its GET /v1/models (kept as it was when that fails:
        a hiccup must not make its models unroutable)."""
        try:
            async with asyncio.timeout(self.cfg["timeout_s"]):
                async with up.session.get(up.url + "/v1/models", headers=up.extra_headers) as r:
                    payload = await r.json(content_type=None) if r.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return
        cards = payload.get("data") if isinstance(payload, dict) else None
        if isinstance(cards, list):
            up.set_model_cards([c for c in cards if isinstance(c, dict)
                                and isinstance(c.get("id"), str)])

    def _maybe_restore(self, up, probe_ok: bool | None) -> None:
        st = self.state(up)
        if up.healthy or st.ejected_at is None:
            return
        if time.monotonic() - st.ejected_at < self.cfg["eject_s"]:
            return
        if probe_ok is None or st.probe_oks >= self.cfg["healthy_threshold"]:
            up.healthy = True
            st.ejected_at, st.bad_answers, st.probe_fails = None, 0, 0
            log.warning("upstream %s is healthy again (was: %s)", up.name, st.reason)
            st.reason = ""

    # --- passive signals (called by the gateway for every exchange) -------------------------
    def eject(self, up, reason: str) -> None:
        st = self.state(up)
        if up.healthy:
            st.ejections += 1
            log.warning("upstream %s ejected: %s", up.name, reason)
        up.healthy = False
        st.ejected_at, st.reason, st.probe_oks = time.monotonic(), reason, 0

    def connect_failed(self, up, error: str) -> None:
        if self.cfg["eject_on_connect_error"]:
            self.eject(up, f"cannot connect: {error}")
        else:
            self.bad_answer(up, error)

    def bad_answer(self, up, what: str) -> None:
        """A 5xx, a reset or a broken stream."""
        st = self.state(up)
        st.bad_answers += 1
        if up.healthy and st.bad_answers >= self.cfg["max_5xx"]:
            self.eject(up, f"{st.bad_answers} failed answers in a row (last: {what})")

    def good_answer(self, up) -> None:
        st = self.states.get(up)
        if st is not None:
            st.bad_answers = 0

    def report(self, up) -> dict:
        st = self.state(up)
        out = {"healthy": up.healthy, "inflight": up.inflight, "ejections": st.ejections}
        if not up.healthy:
            out["reason"] = st.reason
        if st.last_probe:
            out["last_probe"] = st.last_probe
        return out

    def collect(self):
        """`prefixgate_upstream_healthy{upstream}` and `prefixgate_upstream_ejections_total`
        (Prometheus asks at each scrape)."""
        healthy = GaugeMetricFamily("prefixgate_upstream_healthy", "1 while the upstream "
                                    "receives requests, 0 while it is ejected", labels=["upstream"])
        ejections = CounterMetricFamily("prefixgate_upstream_ejections", "Times the upstream "
                                        "was taken out of rotation", labels=["upstream"])
        for up in self.gw.upstreams:
            healthy.add_metric([up.name], 1.0 if up.healthy else 0.0)
            ejections.add_metric([up.name], self.state(up).ejections)
        return [healthy, ejections]
