"""Plugin `prefix_route`: send a request where its prefix is most likely already cached.

A scorer (DESIGN.md §2): it returns `{upstream: score}` and composes with load scorers such
as `least_inflight`. Two policies:

`chwbl` — consistent hashing with bounded loads on the hash of the prompt's first
  `prefix_blocks` blocks. Stateless: gateway replicas that see the same upstream names agree
  without talking to each other. Score 1 for the choice, 0 for the rest.

`cache_aware` — an LRU index of the blocks sent to each upstream (`prefix_index.py`); score =
  matched leading blocks / the prompt's blocks, among upstreams that are not overloaded. The
  knobs, in the spirit of SGLang's cache-aware router:

  balance_abs_threshold, balance_rel_threshold
      An upstream is *overloaded* when its load exceeds the lightest upstream's by more than
      `balance_abs_threshold` requests AND by more than `balance_rel_threshold` times. Cache
      hits are not worth queueing behind that many requests; both must hold so that light
      loads (1 vs 3) never count as imbalance and big fleets use the relative test.
  cache_threshold
      When the best match is below this fraction of the prompt, the request has no real home
      (only a short shared head matches) and goes to the least loaded upstream, which spreads
      new prefix families instead of piling them where a common preamble was seen.

Load is the gateway's in-flight count per upstream or, with `poll_metrics_s`, the backends'
own running + waiting counts (`load_poll.py`), which all gateway replicas see alike.

`index` — where cache_aware's matches come from. `approximate` (the default): the index of
  what this gateway sent where. `kv_events`: what each engine says it holds, from the KV
  events it publishes (vLLM's `--kv-events-config`; per upstream `kv_events:` in
  proxy/upstream.py), kept by `kv_subscriber.py` in the exact index (`kv_index.py`). An
  upstream is matched from the exact index only while its feed is live; the others (no
  `kv_events`, a publisher that is down, silent, or being resynced) from the approximate one,
  which keeps being fed for all of them, so falling back costs nothing. The exact index is
  keyed by token ids through the gateway's own chain, so it needs token keys (`prerender`:
  the gateway tokenizes as the engines do) and the engines' block size equal to
  `block_tokens`; a request keyed on text is matched from the approximate index alone.

Per model: upstreams that do not serve the request's model are filtered out before scoring;
the chwbl key is mixed with the model's name and cache_aware keeps one index per model (at
most MAX_MODELS, least recently used out), so two models — a base model and its LoRA adapter
on the same vLLM, whose KV blocks differ — never share a ring key or an index entry. The
block hashes themselves stay the engine's. The exact index is one for all models: an engine's
events describe its own cache, of its own model, and upstreams that do not serve the
request's model were filtered out already; LoRA adapters' blocks are not indexed
(kv_index.py), and a request for a model an upstream lists as an adapter is matched on that
upstream from the approximate index.
"""
from __future__ import annotations

import functools
from array import array
from dataclasses import dataclass

import xxhash

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from prefixgate.common.schema import ConfigError, Key, non_negative, one_of, positive
from prefixgate.plugins.prefix_route.kv_subscriber import KVEventFeeds
from prefixgate.plugins.prefix_route.load_poll import LoadPoller
from prefixgate.proxy.chain import plugin_entry
from prefixgate.proxy.plugin import Plugin

from prefixgate.plugins.prefix_route.hash_ring import HashRing
from prefixgate.plugins.prefix_route.prefix_index import PrefixIndex
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.plugins.prefix_keys import (DynamicSpans, byte_hash_chain,
                                            prompt_token_ids, render, render_parts, tail_hash)
from prefixgate.proxy.lru import LRU

MAX_MODELS = 64                   # cache_aware indexes kept (one per model routed)


def _at_least_one(v):
    return None if v >= 1 else "must be >= 1"


def _fraction(v):
    return None if 0 <= v <= 1 else "must be between 0 and 1"


SPEC = {
    "policy": Key(str, "chwbl", one_of("chwbl", "cache_aware")),
    "index": Key(str, "approximate", one_of("approximate", "kv_events")),   # cache_aware's
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
    "weight": Key((int, float), 1.0, positive),
}


@dataclass(slots=True)
class Keys:
    mode: str                 # "tokens" or "text"
    chain: list[int]          # chained block hashes, at most max_blocks
    short: int | None         # a key for a prompt without one full block (None: no key)
    cut: bool                 # the text chain stops at a dynamic value
    matched: dict | None = None   # cache_aware: upstream name -> leading blocks it holds


class PrefixRoute(Plugin):
    name = "prefix_route"
    spec = SPEC

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        c = self.cfg
        self.policy = c["policy"]
        # model -> its PrefixIndex (cache_aware only)
        self.indexes: LRU | None = LRU(MAX_MODELS) if self.policy == "cache_aware" else None
        self.poller = LoadPoller(gw, c["poll_metrics_s"]) if c["poll_metrics_s"] else None
        self.feeds = self._kv_event_feeds(gw) if c["index"] == "kv_events" else None
        self._adapter_ids: dict[str, tuple] = {}     # upstream -> (its model cards, adapter ids)
        self._members = None          # the gw.upstreams list the ring was built from
        self._ring: HashRing | None = None
        self._weights: dict[str, float] = {}
        self._uniform = True
        self._spans: DynamicSpans | None = None
        self.decisions = Counter("prefixgate_route_decisions", "Routing decisions by policy and "
                                 "outcome (chwbl: home, spill, nokey; cache_aware: cache, new, "
                                 "balance, nokey)", ["policy", "outcome"], registry=gw.registry)
        self.blocks = Counter("prefixgate_route_prefix_blocks", "Prompt blocks routed (total) "
                              "and, for cache_aware, found in the chosen upstream's index "
                              "(matched)", ["kind"], registry=gw.registry)
        self._total_blocks = self.blocks.labels("total")       # children bound once: labels()
        self._matched_blocks = self.blocks.labels("matched")   # costs more than the inc()
        self._outcomes: dict[str, object] = {}
        gw.registry.register(_RouteCollector(self))

    def _kv_event_feeds(self, gw) -> KVEventFeeds:
        c = self.cfg
        if self.policy != "cache_aware":
            raise ConfigError("index", "kv_events needs policy: cache_aware (chwbl keeps no index)")
        if not any(plugin_entry(item)[0] == "prerender" for item in gw.config.get("plugins", ())):
            raise ConfigError("index", "kv_events needs token-id keys: add the `prerender` plugin "
                                       "and `model.tokenizer` (or `models.<name>.tokenizer`), the "
                                       "engines' own tokenizer and chat template")
        return KVEventFeeds(gw, c["block_tokens"], c["index_capacity"], c["kv_events_probe_s"],
                            c["kv_events_timeout_s"])

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

    # --- load ----------------------------------------------------------------------------------
    def load(self, up) -> float:
        return self.poller.load(up) if self.poller is not None else float(up.inflight + up.waiting)

    def saturated(self, up) -> bool:
        if self.poller is None:
            return False
        kv = self.poller.kv_usage(up)
        return kv is not None and kv >= self.cfg["kv_saturation"]

    # --- keys ----------------------------------------------------------------------------------
    def keys(self, ctx) -> Keys:
        """The request's prefix keys, computed once per request."""
        keys = ctx.state.get(self.name)
        if keys is None:
            keys = ctx.state[self.name] = self._compute_keys(ctx)
        return keys

    def _compute_keys(self, ctx) -> Keys:
        c = self.cfg
        spans = self._dynamic_spans(ctx)
        tokens = ctx.tokens if ctx.tokens is not None else prompt_token_ids(ctx.body)
        if tokens is not None and not (spans and _has_dynamic(ctx.body, spans)):
            bt = c["block_tokens"]
            if ctx.block_hashes is not None and ctx.block_tokens == bt:
                chain = ctx.block_hashes[:c["max_blocks"]]     # already hashed (prerender)
            else:
                chain = block_hash_chain(tokens, bt, c["max_blocks"])
                ctx.block_hashes, ctx.block_tokens = chain, bt
            short = tail_hash([], array("q", tokens).tobytes()) if not chain and tokens else None
            return Keys("tokens", chain, short, False)
        # No tokens, or a dynamic value the token ids cannot be cut at: key on the text.
        data, cut = render(ctx.body, spans)
        chain = byte_hash_chain(data, c["block_bytes"], c["max_blocks"])
        short = tail_hash([], data) if not chain and data else None
        return Keys("text", chain, short, cut)

    def _dynamic_spans(self, ctx) -> DynamicSpans | None:
        mode = self.cfg["dynamic_cut"]
        if mode == "never":
            return None
        if mode == "auto" and ctx.normalized:
            return None             # normalize moved the dynamic values out already
        if self._spans is None:
            self._spans = DynamicSpans()
        return self._spans

    # --- llama.cpp slot affinity ---------------------------------------------------------------
    async def on_request(self, ctx) -> None:
        """llama.cpp's server keeps one prompt cache per slot: pin a prefix family to a slot
        (`id_slot`, the same on every server) and ask it to reuse the cache (`cache_prompt`)."""
        slots = self.cfg["llamacpp_slots"]
        if not slots or "id_slot" in ctx.body:
            return
        key = self.route_key(self.keys(ctx))
        if key is None:
            return
        ctx.body["id_slot"] = ring_position(key, ctx.model) % slots
        ctx.body["cache_prompt"] = True
        ctx.body_changed = True

    def route_key(self, keys: Keys) -> int | None:
        """The hash of the prompt's first `prefix_blocks` blocks (or of its only, partial one)."""
        if keys.chain:
            return keys.chain[min(self.cfg["prefix_blocks"], len(keys.chain)) - 1]
        return keys.short

    # --- scoring -------------------------------------------------------------------------------
    def score(self, ctx, upstreams):
        self._sync_members()
        keys = self.keys(ctx)
        if not keys.chain and keys.short is None:
            return self._least_loaded(ctx, upstreams, "nokey")
        if self.policy == "chwbl":
            return self._score_chwbl(ctx, keys, upstreams)
        if not keys.chain:
            return self._least_loaded(ctx, upstreams, "nokey")
        return self._score_cache_aware(ctx, keys, upstreams)

    def _loads(self, upstreams) -> dict:
        if self.poller is None:
            return {u: u.inflight + u.waiting for u in upstreams}
        return {u: self.poller.load(u) for u in upstreams}

    def _score_chwbl(self, ctx, keys: Keys, upstreams):
        chain = keys.chain
        key = self.route_key(keys)
        loads = self._loads(upstreams)
        by_name = {u.name: u for u in upstreams}
        eligible = None
        if self.poller is not None:
            eligible = lambda name: not self.saturated(by_name[name])    # noqa: E731
        total_weight = (len(upstreams) if self._uniform else
                        sum(self._weights[u.name] for u in upstreams))
        chosen, home = self._ring.choose(ring_position(key, ctx.model),
                                         {u.name: load for u, load in loads.items()},
                                         self._weights, total_weight,
                                         self.cfg["load_factor"], eligible)
        ctx.route_info.update(policy="chwbl", key=f"{key:016x}", home=home, blocks=len(chain),
                              mode=keys.mode)
        self._decided(ctx, "home" if chosen == home else "spill")
        return {by_name[chosen]: 1.0}

    def _score_cache_aware(self, ctx, keys: Keys, upstreams):
        c = self.cfg
        n = len(keys.chain)
        matched = keys.matched = self._match(ctx, keys, upstreams)
        loads = self._loads(upstreams)
        lightest = min(loads.values())
        abs_t, rel_t = c["balance_abs_threshold"], c["balance_rel_threshold"]
        good, best, excluded = [], 0, 0
        for u in upstreams:
            m = matched.get(u.name)
            if m is None:
                continue
            load = loads[u]
            if (load - lightest > abs_t and load > lightest * rel_t) or self.saturated(u):
                excluded = max(excluded, m)          # overloaded: its cache is not worth it
                continue
            good.append((u, m))
            best = max(best, m)
        ctx.route_info.update(policy="cache_aware", blocks=n, best_match=best, mode=keys.mode)
        if best / n >= c["cache_threshold"]:
            self._decided(ctx, "cache")
            # ties in match go to the lighter upstream (then at random, in the gateway)
            return {u: m / n - 1e-9 * loads[u] for u, m in good}
        outcome = "balance" if excluded > best and excluded / n >= c["cache_threshold"] else "new"
        return self._least_loaded(ctx, upstreams, outcome, loads, matched)

    def _match(self, ctx, keys: Keys, upstreams) -> dict[str, int]:
        """Leading blocks of the prompt each upstream holds: from its engine's KV events while
        its feed is live, else from what this gateway sent there."""
        matched = self._index(ctx.model).match(keys.chain)
        feeds = self.feeds
        if feeds is None or not feeds.live or keys.mode != "tokens":
            return matched              # the exact index is keyed by token blocks only
        live, exact = feeds.live, feeds.index.match(keys.chain)
        for u in upstreams:
            name = u.name
            if name in live and ctx.model not in self._adapters(u):
                m = exact.get(name)
                if m:
                    matched[name] = m
                else:
                    matched.pop(name, None)
        return matched

    def _adapters(self, up) -> frozenset:
        """The LoRA adapters `up` lists (their blocks are not in the exact index)."""
        cards = up.model_cards
        seen = self._adapter_ids.get(up.name)
        if seen is None or seen[0] is not cards:
            ids = frozenset(c.get("id") for c in cards or () if c.get("parent"))
            seen = self._adapter_ids[up.name] = (cards, ids)
        return seen[1]

    def _least_loaded(self, ctx, upstreams, outcome, loads=None, matched=None):
        """The least loaded upstreams (not saturated); among them a partial match wins."""
        loads = loads or self._loads(upstreams)
        ok = [u for u in upstreams if not self.saturated(u)] if self.poller else upstreams
        lightest = min(loads[u] for u in ok or upstreams)
        ctx.route_info.setdefault("policy", self.policy)
        self._decided(ctx, outcome)
        matched = matched or {}
        return {u: 1.0 + 1e-6 * matched.get(u.name, 0)
                for u in ok or upstreams if loads[u] == lightest}

    def _sync_members(self) -> None:
        """Rebuild the ring (and prune the index) when the upstream set changed."""
        ups = self.gw.upstreams
        if ups is self._members:
            return
        self._members = ups
        self._weights = {u.name: float(u.cfg.get("weight", 1.0)) for u in ups}
        self._uniform = all(w == 1.0 for w in self._weights.values())
        self._ring = HashRing(sorted(self._weights.items()), self.cfg["virtual_nodes"])
        for index in (self.indexes or {}).values():
            index.retain(self._weights)
        if self.feeds is not None:
            self.feeds.reconcile(ups)
            self._adapter_ids = {n: v for n, v in self._adapter_ids.items() if n in self._weights}

    # --- after the choice ----------------------------------------------------------------------
    def on_first_byte(self, ctx) -> None:
        """The chosen upstream has answered, so it has computed the prompt: remember that.

        Recording now rather than at the choice keeps the index truthful (a request that
        failed over, or failed, is recorded where it really ran, or not at all). A P/D
        request's prompt was computed by its prefill upstream (proxy/pd.py).
        """
        self.record(ctx)

    def record(self, ctx, up=None) -> None:
        up = up or ctx.prefill_upstream or ctx.upstream
        if up is None:
            return
        keys = self.keys(ctx)
        self._total_blocks.inc(len(keys.chain))
        if self.indexes is not None and keys.chain:
            index = self._index(ctx.model)
            matched = keys.matched     # from score(), if it ran
            if matched is None:
                matched = index.match(keys.chain)
            self._matched_blocks.inc(matched.get(up.name, 0))
            index.insert(up.name, keys.chain)

    def _index(self, model: str | None) -> PrefixIndex:
        """The cache_aware index of `model`'s prompts."""
        index = self.indexes.get(model)
        if index is None:
            index = PrefixIndex(self.cfg["index_capacity"])
            self.indexes.put(model, index)
        return index

    def _decided(self, ctx, outcome: str) -> None:
        info = ctx.route_info
        info["outcome"] = outcome
        counter = self._outcomes.get(outcome)
        if counter is None:
            counter = self._outcomes[outcome] = self.decisions.labels(self.policy, outcome)
        counter.inc()
        header = f"{self.policy}; outcome={outcome}; blocks={info.get('blocks', 0)}"
        if "key" in info:
            header += f"; key={info['key']}; home={info['home']}"
        if "best_match" in info:
            header += f"; matched={info['best_match']}"
        ctx.response_headers["x-prefixgate-route"] = header


@functools.lru_cache(maxsize=1024)
def _model_salt(model: str) -> int:
    return xxhash.xxh64_intdigest(model.encode("utf-8", "surrogatepass"))


def ring_position(key: int, model: str | None) -> int:
    """Where a prefix key sits on the ring for `model`: the same prompt to two models lands
    on unrelated homes (None: the key itself, as before models were routed)."""
    return key if model is None else key ^ _model_salt(model)


def _has_dynamic(body: dict, spans: DynamicSpans) -> bool:
    return any(spans.first(p) >= 0 for p in render_parts(body))


class _RouteCollector:
    """Index size and load per upstream (and the KV event feeds), read at scrape time."""

    def __init__(self, plugin: PrefixRoute):
        self.plugin = plugin

    def collect(self):
        p = self.plugin
        load = GaugeMetricFamily("prefixgate_route_upstream_load", "Load the router sees per "
                                 "upstream (requests)", labels=["upstream"])
        for u in p.gw.upstreams:
            load.add_metric([u.name], p.load(u))
        yield load
        if p.indexes is not None:
            size = GaugeMetricFamily("prefixgate_route_index_blocks", "Prefix blocks the "
                                     "cache_aware index remembers per upstream (all models)",
                                     labels=["upstream"])
            for u in p.gw.upstreams:
                size.add_metric([u.name], sum(i.size(u.name) for i in p.indexes.values()))
            yield size
        if p.feeds is not None:
            yield from p.feeds.collect()
