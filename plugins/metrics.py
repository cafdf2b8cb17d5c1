"""Prometheus metrics for the gateway: TTFT, TPOT, queueing, connects, status, goodput."""
from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from prefixgate.common.schema import Key, positive
from prefixgate.proxy import pd
from prefixgate.proxy.observe import breakdown
from prefixgate.proxy.plugin import Plugin

# TTFT spans a cached 5 ms hit to a queued 60 s long-context prefill
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.35, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                1.0, 2.0)


class Metrics(Plugin):
    """Client-visible latencies, measured at the gateway.

    TTFT is from the request's arrival to the first response byte written to the client;
    TPOT is (last byte - first byte) / (SSE events - 1). Goodput counts successful requests
    whose TTFT (and TPOT, when `slo_tpot_ms` is set) meet the SLO.
    """
    name = "metrics"
    spec = {
        "slo_ttft_ms": Key((int, float), 500.0, positive),
        "slo_tpot_ms": Key((int, float), None, positive),
    }

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        reg = gw.registry
        self.slo_ttft = self.cfg["slo_ttft_ms"] / 1000.0
        self.slo_tpot = self.cfg["slo_tpot_ms"] / 1000.0 if self.cfg["slo_tpot_ms"] else None
        self.ttft = Histogram("prefixgate_ttft_seconds", "Time to first byte of the response, "
                              "measured at the gateway", ["upstream"],
                              buckets=LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("prefixgate_tpot_seconds", "Time per output token (SSE event) "
                              "after the first", ["upstream"], buckets=TPOT_BUCKETS, registry=reg)
        self.queue = Histogram("prefixgate_queue_seconds", "Time spent waiting for admission",
                               buckets=LATENCY_BUCKETS, registry=reg)
        self.connect = Histogram("prefixgate_upstream_connect_seconds", "Time to open a new "
                                 "upstream connection", ["upstream"],
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.requests = Counter("prefixgate_requests", "Requests by final status and model "
                                "(the model only when an upstream serves it, else empty)",
                                ["status", "model"], registry=reg)
        self.stages = Histogram("prefixgate_stage_seconds", "Time to first byte taken apart: "
                                "gateway (own work), queue (admission), connect (pool wait + "
                                "TCP connect), upstream_ttft (request written -> first byte)",
                                ["stage"], buckets=LATENCY_BUCKETS, registry=reg)
        self._stage_children = [(s, self.stages.labels(s)) for s in breakdown.STAGES]
        self.goodput = Counter("prefixgate_goodput", "Successful requests meeting the TTFT "
                               "(and TPOT) SLO", registry=reg)
        # prefill/decode disaggregation (proxy/pd.py)
        self.pd_prefill = Histogram("prefixgate_pd_prefill_seconds", "P/D: a request's prefill "
                                    "legs, written -> answered (summed over its tries), by the "
                                    "prefill upstream that served it", ["upstream"],
                                    buckets=LATENCY_BUCKETS, registry=reg)
        self.pd_decode_ttft = Histogram("prefixgate_pd_decode_ttft_seconds", "P/D: the decode "
                                        "leg, written -> first byte", ["upstream"],
                                        buckets=LATENCY_BUCKETS, registry=reg)
        self.pd_requests = Counter("prefixgate_pd_requests", "P/D requests by outcome: pd "
                                   "(answered by a prefill/decode pair), fallback (prefill legs "
                                   "failed: computed plain on a decode upstream), failed (a 5xx)",
                                   ["protocol", "outcome"], registry=reg)
        reg.register(_InflightCollector(gw))
        gw.on_connect.append(self._observe_connect)
        # (metric, label values) -> its child: a lookup here costs a fraction of labels()
        self._children: dict = {}

    def _child(self, metric, *values: str):
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[metric, values] = metric.labels(*values)
        return child

    def _observe_connect(self, upstream, seconds: float) -> None:
        self._child(self.connect, upstream.name).observe(seconds)

    def on_finish(self, ctx, error):
        # a model no upstream serves is the client's free text: not a label (cardinality)
        model = ctx.model if ctx.upstream is not None and ctx.model is not None else ""
        self._child(self.requests, str(ctx.status or 0), model).inc()
        queued = ctx.since("plugins_done", "admitted")
        if queued is not None:
            self.queue.observe(queued)
        if ctx.pd is not None:
            self._observe_pd(ctx)
        ttft = ctx.since("received", "first_byte")
        if ttft is None or ctx.upstream is None:
            return
        name = ctx.upstream.name
        self._child(self.ttft, name).observe(ttft)
        stages = breakdown.segments(ctx)
        for stage, child in self._stage_children:
            child.observe(stages[stage])
        tpot = None
        if ctx.chunks > 1 and "done" in ctx.t:
            tpot = ctx.since("first_byte", "done") / (ctx.chunks - 1)
            self._child(self.tpot, name).observe(tpot)
        if error is None and ctx.status == 200 and ttft <= self.slo_ttft and (
                self.slo_tpot is None or tpot is None or tpot <= self.slo_tpot):
            self.goodput.inc()

    def _observe_pd(self, ctx) -> None:
        if ctx.pd != pd.FALLBACK and ctx.prefill_upstream is None:
            return                  # refused before its legs (429, 503 ...): not P/D's doing
        if ctx.pd == pd.FALLBACK:
            protocol, outcome = (self.gw.config.get("pd") or {}).get("protocol", ""), "fallback"
        else:
            protocol, outcome = ctx.pd, "failed" if (ctx.status or 500) >= 500 else "pd"
        self.pd_requests.labels(protocol, outcome).inc()
        if ctx.prefill_upstream is not None:
            self.pd_prefill.labels(ctx.prefill_upstream.name).observe(ctx.prefill_s)
        decode_ttft = ctx.since("upstream_sent", "first_byte")
        if outcome != "fallback" and decode_ttft is not None and ctx.upstream is not None:
            self.pd_decode_ttft.labels(ctx.upstream.name).observe(decode_ttft)


class _InflightCollector:
    """`prefixgate_inflight{upstream}` read at scrape time, so upstreams may come and go."""

    def __init__(self, gw):
        self.gw = gw

    def collect(self):
        family = GaugeMetricFamily("prefixgate_inflight", "Requests in flight per upstream",
                                   labels=["upstream"])
        for up in self.gw.upstreams:
            family.add_metric([up.name], up.inflight)
        yield family
