"""Prometheus metrics for the engine, named like vLLM's (`prefixgate:` for `vllm:`).

Gauges and counters are read from the engine's own state when scraped (one collector, so
they can never drift from it); latency histograms are observed as requests progress, from
the stamps every RequestOutput carries (the same ones the server's `Server-Timing` header is
made of, so the two agree): arrival = add_request, after tokenization, as vLLM's. Each server
gets its own registry, so several engines can live in one process (tests do that).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixgate.backend.engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, kv=None):
        self.engine = engine
        self.kv = kv                    # a kv_transfer.KVTransferStats, or None

    def collect(self):
        s = self.engine.stats()
        yield _gauge("prefixgate:num_requests_running", "Requests in the running batch.",
                     s["running"])
        yield _gauge("prefixgate:num_requests_waiting", "Requests waiting to be scheduled.",
                     s["waiting"])
        yield _gauge("prefixgate:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                     s["kv_cache_usage"])
        yield _counter("prefixgate:prefix_cache_queries",
                       "Prompt tokens looked up in the prefix cache.", s["prefix_queries"])
        yield _counter("prefixgate:prefix_cache_hits",
                       "Prompt tokens served from the prefix cache.", s["prefix_hits"])
        yield _counter("prefixgate:num_preemptions", "Sequences preempted (recomputed later).",
                       s["preemptions"])
        yield _gauge("prefixgate:kv_transfer_held_blocks",
                     "KV blocks held for a decode engine's pull (prefill side).",
                     s["kv_held_blocks"])
        yield from _cache_pin_metrics(s)
        yield from _spec_decode_metrics(self.engine.spec_stats())
        yield from _kv_offload_metrics(s)
        yield from _kv_events_metrics(s)
        kv = self.kv
        if kv is None:
            return
        for name, doc, value in (
                ("kv_transfers_served",
                 "Prompt KV pulls this engine answered in full (prefill side).", kv.served),
                ("kv_transfers_pulled",
                 "Prompt KV pulls this engine made (decode side).", kv.pulled),
                ("kv_transfer_failures", "KV pulls that failed (either side).", kv.failed),
                ("kv_transfer_expired_holds",
                 "Held prompt KV freed by --kv-transfer-timeout, never pulled.", kv.expired),
                ("kv_transfer_sent_bytes", "KV bytes sent to decode engines.", kv.bytes_sent),
                ("kv_transfer_received_bytes",
                 "KV bytes pulled from prefill engines.", kv.bytes_received),
                ("kv_transfer_send_seconds",
                 "Seconds spent answering pulls (request to 'done').", kv.seconds_sent),
                ("kv_transfer_pull_seconds",
                 "Seconds spent pulling (connect to last byte).", kv.seconds_pulled)):
            yield _counter("prefixgate:" + name, doc, value)


def _cache_pin_metrics(s: dict):
    """cache_control pins (backend/cache_pins.py): how many blocks are pinned and when the
    pins end, in seconds from the scrape (0 with no pin)."""
    yield _gauge("prefixgate:cache_pinned_blocks",
                 "KV blocks pinned by cache_control marks until their ttl.",
                 s["cache_pinned_blocks"])
    yield _gauge("prefixgate:cache_pin_soonest_expiry_seconds",
                 "Seconds until the soonest pin ends (0: no pin).", s["cache_pin_soonest_expiry_s"])
    yield _gauge("prefixgate:cache_pin_latest_expiry_seconds",
                 "Seconds until the latest pin ends (0: no pin).", s["cache_pin_latest_expiry_s"])
    yield _counter("prefixgate:cache_pin_dropped_blocks",
                   "Pinned KV blocks reused before their ttl because nothing else was free.",
                   s["cache_pin_dropped_blocks"])


def _spec_decode_metrics(spec: dict | None):
    """vLLM's speculative decoding counters: acceptance rate = accepted / draft tokens, mean
    acceptance length = 1 + accepted / drafts (tokens a drafted step yields)."""
    if spec is None:
        return
    for name, doc in (("num_drafts", "Drafts verified (one per sequence per step)."),
                      ("num_draft_tokens", "Draft tokens verified."),
                      ("num_accepted_tokens", "Draft tokens accepted.")):
        yield _counter("prefixgate:spec_decode_" + name, doc, spec[name])
    per_pos = CounterMetricFamily("prefixgate:spec_decode_num_accepted_tokens_per_pos",
                                  "Drafts whose token at this position (0-based) was accepted.",
                                  labels=["position"])
    for pos, n in enumerate(spec["num_accepted_tokens_per_pos"]):
        per_pos.add_metric([str(pos)], n)
    yield per_pos


def _kv_offload_metrics(s: dict):
    """The second KV tier's (backend/kv_tier.py), when it is on; counters get `_total` on
    exposition (prefixgate:kv_offload_stored_blocks_total ...)."""
    if "kv_offload_usage" not in s:
        return
    yield _gauge("prefixgate:kv_offload_usage_perc",
                 "Fraction of second KV tier slots in use (0..1).", s["kv_offload_usage"])
    for name, doc in (
            ("stored_blocks", "KV blocks copied into the second tier."),
            ("loaded_blocks", "KV blocks loaded back from the second tier on a prefix hit."),
            ("hit_tokens", "Prompt tokens served from the second tier."),
            ("corrupted_blocks", "Second tier blocks that failed their checksum (recomputed).")):
        yield _counter("prefixgate:kv_offload_" + name, doc, s["kv_offload_" + name])


def _kv_events_metrics(s: dict):
    """The KV event publisher's (backend/kv_events.py), when it is on; exposed with `_total`
    (prefixgate:kv_events_published_total ...)."""
    if "kv_events_published_batches" not in s:
        return
    for name, key, doc in (
            ("kv_event_batches_published", "published_batches",
             "KV event batches sent on the PUB socket."),
            ("kv_events_published", "published_events",
             "KV events (BlockStored, BlockRemoved) sent."),
            ("kv_event_batches_dropped", "dropped_batches",
             "KV event batches dropped: the publisher's queue was full "
             "(their seq numbers are skipped).")):
        yield _counter("prefixgate:" + name, doc, s["kv_events_" + key])


def _gauge(name, doc, value):
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name, doc, value):
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class EngineMetrics:
    def __init__(self, engine: LLMEngine, kv_stats=None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, kv_stats))
        self.ttft = self._latency("prefixgate:time_to_first_token_seconds",
                                  "Engine arrival (add_request) to first token sampled.")
        self.tpot = self._latency("prefixgate:time_per_output_token_seconds",
                                  "Time between output tokens.")
        self.queue = self._latency("prefixgate:request_queue_time_seconds",
                                   "Engine arrival (add_request) to first scheduled.")
        self.prefill = self._latency("prefixgate:request_prefill_time_seconds",
                                     "First scheduled to first token sampled.")
        self._last_token: dict[str, float] = {}

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        """Called after each engine step with its outputs."""
        for out in outputs:
            last = self._last_token.get(out.request_id)
            if last is None:    # an output always carries a token: this is the first
                self.ttft.observe(out.first_token_time - out.arrival_time)
                self.queue.observe(out.first_scheduled_time - out.arrival_time)
                self.prefill.observe(out.first_token_time - out.first_scheduled_time)
            elif out.token_ids:
                self.tpot.observe((now - last) / len(out.token_ids))
            if out.finished:
                self._last_token.pop(out.request_id, None)
            else:
                self._last_token[out.request_id] = now

    def forget(self, request_id: str) -> None:
        """Drop the state of a request that ended without a finished output (aborted)."""
        self._last_token.pop(request_id, None)
