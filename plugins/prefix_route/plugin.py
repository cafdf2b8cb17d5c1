"""Plugin `prefix_route`: send a request where its prefix is most likely already cached.

A scorer (DESIGN.md §2): it returns `{upstream: score}` and composes with load scorers such
as `least_inflight`. The plugin reads its settings and builds its pieces:

    keys.py         the request's prefix keys (token or text block chains, the model salt)
    scorer.py       what every policy shares: the load view, the least-loaded fallback, the
                    decisions counter and the `x-prefixgate-route` header
    chwbl.py        `policy: chwbl`, consistent hashing with bounded loads (hash_ring.py)
    cache_aware.py  `policy: cache_aware`, the longest cached prefix among upstreams not
                    overloaded, matched in the index `index:` chooses (indexes.py)
    predicted_ttft.py  `policy: predicted_ttft`, the least predicted time to first token,
                    from the same index, the prefill work queued per upstream
                    (prefill_queue.py) and each upstream's learned speed (ttft_model.py)
    llamacpp.py     `llamacpp_slots`: a llama.cpp slot per prefix family
    sessions.py     `session:` (on by default): a session's requests — a session header,
                    `prompt_cache_key`, Claude Code's `metadata.user_id` — to one upstream,
                    by rendezvous hashing
    parity.py       `parity:` (on by default): the cached tokens predicted for the chosen
                    upstream against those its answer reports, per upstream and model
    load_poll.py    `poll_metrics_s`: the backends' own load, which every scorer reads
                    through `Upstream.load` (all gateway replicas see it alike)

Where a prompt ran is recorded on the request's first byte (the approximate index). Per
model: upstreams that do not serve the request's model are filtered out before scoring, the
chwbl key is mixed with the model's name and the approximate index is kept per model; the
block hashes themselves stay the engine's.
"""
from __future__ import annotations

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from prefixgate.common.schema import ConfigError, Key, non_negative, one_of, positive
from prefixgate.plugins.prefix_route.cache_aware import CacheAware
from prefixgate.plugins.prefix_route.chwbl import Chwbl
from prefixgate.plugins.prefix_route.indexes import ApproximateIndex, EngineIndex
from prefixgate.plugins.prefix_route.keys import Keys, PrefixKeys
from prefixgate.plugins.prefix_route.kv_subscriber import KVEventFeeds
from prefixgate.plugins.prefix_route.llamacpp import SlotPinning
from prefixgate.plugins.prefix_route.load_poll import LoadPoller
from prefixgate.plugins.prefix_route.parity import SPEC as PARITY_SPEC
from prefixgate.plugins.prefix_route.parity import Parity
from prefixgate.plugins.prefix_route.predicted_ttft import PredictedTTFT
from prefixgate.plugins.prefix_route.scorer import PrefixScorer
from prefixgate.plugins.prefix_route.sessions import SPEC as SESSION_SPEC
from prefixgate.proxy.plugin import Need, Plugin


def _at_least_one(v):
    return None if v >= 1 else "must be >= 1"


def _fraction(v):
    return None if 0 <= v <= 1 else "must be between 0 and 1"


SPEC = {
    "policy": Key(str, "chwbl", one_of("chwbl", "cache_aware", "predicted_ttft")),
    # cache_aware's and predicted_ttft's
    "index": Key(str, "approximate", one_of("approximate", "kv_events")),
    "kv_events_probe_s": Key((int, float), 2.0, positive),   # a silent feed is probed this often
    "kv_events_timeout_s": Key((int, float), 1.0, positive),  # unanswered this long: not live
    "block_tokens": Key(int, 16, positive),       # vLLM's default KV block size
    "block_bytes": Key(int, 64, positive),        # text fallback: ~16 tokens of English
    "max_blocks": Key(int, 512, positive),        # blocks hashed per request (8k tokens)
    "prefix_blocks": Key(int, 4, positive),       # chwbl: K, the blocks that make the key
    "load_factor": Key((int, float), 1.25, lambda v: None if v > 1 else "must be > 1"),
    "virtual_nodes": Key(int, 160, positive),     # per unit of upstream weight
    "index_capacity": Key(int, 65536, positive),  # cache_aware: blocks per upstream and model
    "cache_threshold": Key((int, float), 0.3, _fraction),
    "balance_abs_threshold": Key((int, float), 4, non_negative),
    "balance_rel_threshold": Key((int, float), 1.25, _at_least_one),
    "poll_metrics_s": Key((int, float), 0, non_negative),   # 0: gateway in-flight counts only
    "kv_saturation": Key((int, float), 0.98, _fraction),     # polled KV usage that means "full"
    "dynamic_cut": Key(str, "auto", one_of("auto", "always", "never")),
    "llamacpp_slots": Key(int, 0, non_negative),  # llama.cpp server: slots per server (0: off)
    # predicted_ttft: the home keeps a request predicted this much slower than the best
    "tie_ms": Key((int, float), 20.0, non_negative),
    "tie_fraction": Key((int, float), 1.0, non_negative),
    # predicted_ttft: a new upstream's speed before it answered (unset: the fleet's fit)
    "prior_tokens_per_second": Key((int, float, type(None)), None, positive),
    "prior_overhead_ms": Key((int, float, type(None)), None, non_negative),
    "fit_half_life_s": Key((int, float), 15.0, positive),   # how fast old answers fade
    "session": Key(dict, dict, nested=SESSION_SPEC),   # session affinity (sessions.py): on
    "parity": Key(dict, dict, nested=PARITY_SPEC),     # predicted vs reported cache (parity.py)
    "weight": Key((int, float), 1.0, positive),
}


# `index: kv_events` matches token blocks: another plugin of the chain must tokenize
TOKEN_KEYS = Need("tokens", "index", "kv_events needs token-id keys: add the `prerender` plugin "
                  "and `model.tokenizer` (or `models.<name>.tokenizer`), the engines' own "
                  "tokenizer and chat template")


class PrefixRoute(Plugin):
    name = "prefix_route"
    spec = SPEC

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        c = self.cfg
        self.policy = c["policy"]
        self.keying = PrefixKeys(c)
        self.poller = LoadPoller(gw, c["poll_metrics_s"]) if c["poll_metrics_s"] else None
        self.feeds = self._kv_event_feeds(gw) if c["index"] == "kv_events" else None
        self.needs = (TOKEN_KEYS,) if self.feeds is not None else ()
        # what this gateway sent where (not for chwbl): fed on the first byte
        self.approximate = (ApproximateIndex(c["index_capacity"])
                            if self.policy != "chwbl" else None)
        self.scorer = self._scorer(gw)
        self.predicted = self.scorer if isinstance(self.scorer, PredictedTTFT) else None
        self.parity = (Parity(gw.registry, c) if c["parity"]["enabled"]
                       and self.approximate is not None else None)
        # predicted_ttft learns from a stream's usage event, its last; parity compares it
        self.keeps_stream_tail = self.predicted is not None or self.parity is not None
        self.slots = SlotPinning(self.keying, c["llamacpp_slots"]) if c["llamacpp_slots"] else None
        self.blocks = Counter("prefixgate_route_prefix_blocks", "Prompt blocks routed (total) "
                              "and, but for chwbl, found in the chosen upstream's index "
                              "(matched)", ["kind"], registry=gw.registry)
        self._total_blocks = self.blocks.labels("total")       # children bound once: labels()
        self._matched_blocks = self.blocks.labels("matched")   # costs more than the inc()
        gw.registry.register(_RouteCollector(self))

    def _kv_event_feeds(self, gw) -> KVEventFeeds:
        c = self.cfg
        if self.policy == "chwbl":
            raise ConfigError("index", "kv_events needs policy: cache_aware or predicted_ttft "
                                       "(chwbl keeps no index)")
        return KVEventFeeds(gw, c["block_tokens"], c["index_capacity"], c["kv_events_probe_s"],
                            c["kv_events_timeout_s"])

    def _scorer(self, gw) -> PrefixScorer:
        if self.policy == "chwbl":
            return Chwbl(gw, self.keying, self.cfg)
        index = (self.approximate if self.feeds is None else
                 EngineIndex(self.approximate, self.feeds))
        if self.policy == "predicted_ttft":
            return PredictedTTFT(gw, self.keying, self.cfg, index)
        return CacheAware(gw, self.keying, self.cfg, index)

    # --- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self.poller is not None:
            await self.poller.start()
        if self.feeds is not None:
            await self.feeds.start()

    async def close(self) -> None:
        if self.poller is not None:
            await self.poller.close()
        if self.feeds is not None:
            await self.feeds.close()

    # --- hooks ---------------------------------------------------------------------------------
    async def on_request(self, ctx) -> None:
        if self.slots is not None:
            self.slots.pin(ctx)

    def score(self, ctx, upstreams):
        return self.scorer.score(ctx, upstreams)

    def on_first_byte(self, ctx) -> None:
        """The chosen upstream has answered, so it has computed the prompt: remember that.

        Recording now rather than at the choice keeps the index truthful (a request that
        failed over, or failed, is recorded where it really ran, or not at all). A P/D
        request's prompt was computed by its prefill upstream (proxy/pd.py).
        """
        if self.parity is not None and ctx.upstream is not None:
            # what the index predicted, taken before this request joins it
            self.parity.predict(ctx, self.keys(ctx), ctx.upstream)
        self.record(ctx)
        if self.predicted is not None:
            self.predicted.answered(ctx)

    def on_finish(self, ctx, error) -> None:
        """predicted_ttft: off its upstream's queue if it failed, else learn from it; parity:
        the predicted cached tokens against the answer's."""
        if self.predicted is not None:
            self.predicted.finished(ctx, error)
        if self.parity is not None:
            self.parity.compare(ctx, error)

    def keys(self, ctx) -> Keys:
        """The request's prefix keys, computed once per request."""
        return self.keying.of(ctx)

    def record(self, ctx, up=None) -> None:
        """`up` (default: where the request ran) has computed the prompt: count its blocks
        and remember them in the approximate index."""
        up = up or ctx.prefill_upstream or ctx.upstream
        if up is None:
            return
        keys = self.keys(ctx)
        self._total_blocks.inc(len(keys.chain))
        if self.approximate is not None and keys.chain:
            index = self.approximate.of(ctx.model)
            matched = keys.matched     # from score(), if it ran
            if matched is None:
                matched = index.match(keys.chain)
            self._matched_blocks.inc(matched.get(up.name, 0))
            index.insert(up.name, keys.chain)


class _RouteCollector:
    """Index size and load per upstream (and the KV event feeds), read at scrape time."""

    def __init__(self, plugin: PrefixRoute):
        self.plugin = plugin

    def collect(self):
        p = self.plugin
        load = GaugeMetricFamily("prefixgate_route_upstream_load", "Load the router sees per "
                                 "upstream (requests)", labels=["upstream"])
        for u in p.gw.upstreams:
            load.add_metric([u.name], u.load)
        yield load
        if p.approximate is not None:
            size = GaugeMetricFamily("prefixgate_route_index_blocks", "Prefix blocks the "
                                     "approximate index remembers per upstream (all models)",
                                     labels=["upstream"])
            for u in p.gw.upstreams:
                size.add_metric([u.name], p.approximate.size(u.name))
            yield size
        if p.feeds is not None:
            yield from p.feeds.collect()
        if p.predicted is not None:
            yield from p.predicted.model.collect()
