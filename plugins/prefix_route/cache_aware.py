"""`policy: cache_aware` — send a prompt where most of its leading blocks are cached.

Score = matched leading blocks / the prompt's blocks, from the index handed in (`indexes.py`:
approximate, or the engines' KV events), among upstreams that are not overloaded (nor
saturated); those that are, and those that hold none of it, score 0 — less 1e-9 per request
of load, so that equal matches go to the lighter upstream. The knobs, in the spirit of
SGLang's cache-aware router:

  balance_abs_threshold, balance_rel_threshold
      An upstream is *overloaded* when its load exceeds the lightest upstream's by more than
      `balance_abs_threshold` requests AND by more than `balance_rel_threshold` times. Cache
      hits are not worth queueing behind that many requests; both must hold so that light
      loads (1 vs 3) never count as imbalance and big fleets use the relative test.
  cache_threshold
      When the best match is below this fraction of the prompt, the request has no real home
      (only a short shared head matches) and goes to the least loaded upstream, which spreads
      new prefix families instead of piling them where a common preamble was seen.

Outcomes: `cache` (a home found), `new` (none), `balance` (the best home was overloaded),
`nokey` (a prompt without one full block). Without a home (new, balance, nokey) the scores
are the least-loaded fallback's (scorer.py).
"""
from __future__ import annotations

from prefixgate.plugins.prefix_route.keys import Keys, PrefixKeys
from prefixgate.plugins.prefix_route.scorer import PrefixScorer


class CacheAware(PrefixScorer):
    policy = "cache_aware"

    def __init__(self, gw, keys: PrefixKeys, cfg: dict, index):
        super().__init__(gw, keys, cfg)
        self.index = index           # match(ctx, keys, upstreams) -> {name: leading blocks}
        self.cache_threshold = cfg["cache_threshold"]

    def members_changed(self, upstreams) -> None:
        self.index.retain(upstreams)

    def choose(self, ctx, keys: Keys, upstreams) -> dict:
        if not keys.chain:
            return self.least_loaded(ctx, upstreams, "nokey")
        n = len(keys.chain)
        matched = keys.matched = self.index.match(ctx, keys, upstreams)
        loads = {u: u.load for u in upstreams}
        lightest = min(loads.values())
        good, best, excluded = {}, 0, 0
        for u in upstreams:
            m = matched.get(u.name)
            if m is None:
                continue
            if self.overloaded(loads[u], lightest) or self.saturated(u):
                excluded = max(excluded, m)          # overloaded: its cache is not worth it
                continue
            good[u] = m
            best = max(best, m)
        ctx.route_info.update(policy="cache_aware", blocks=n, best_match=best, mode=keys.mode)
        if best / n >= self.cache_threshold:
            self.decided(ctx, "cache")
            # ties in match go to the lighter upstream (then at random, in the gateway)
            scores = {u: -1e-9 * load for u, load in loads.items()}
            for u, m in good.items():
                scores[u] += m / n
            return scores
        home_overloaded = excluded > best and excluded / n >= self.cache_threshold
        return self.least_loaded(ctx, upstreams, "balance" if home_overloaded else "new",
                                 loads, matched)
