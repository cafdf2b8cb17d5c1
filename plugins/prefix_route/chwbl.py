"""`policy: chwbl` — consistent hashing with bounded loads on the prompt's prefix key.

The key is the hash of the prompt's first `prefix_blocks` blocks, mixed with the request's
model (`keys.ring_position`); the ring (`hash_ring.py`) sends it to its home upstream unless
the home's load is over `load_factor` times its share, or its polled KV cache is saturated.
Stateless: gateway replicas that see the same upstream names agree without talking to each
other.

Score: every candidate by its rank in the ring's order for the key (`HashRing.rank`), 1 / (1 +
rank): 1 for the choice (the first on the ring under its bound and not saturated), 1/2 for the
next such one — where the key spills when its home is over the bound, so where its prefix
already is next most likely —, and so on; those under the bound but saturated rank after
them, and those over the bound last.
"""
from __future__ import annotations

from prefixgate.plugins.prefix_route.hash_ring import HashRing
from prefixgate.plugins.prefix_route.keys import Keys, PrefixKeys, ring_position
from prefixgate.plugins.prefix_route.scorer import PrefixScorer


class Chwbl(PrefixScorer):
    policy = "chwbl"

    def __init__(self, gw, keys: PrefixKeys, cfg: dict):
        super().__init__(gw, keys, cfg)
        self.load_factor = cfg["load_factor"]
        self.virtual_nodes = cfg["virtual_nodes"]
        self._ring: HashRing | None = None
        self._weights: dict[str, float] = {}
        self._uniform = True
        self._reciprocals: list[float] = []
        self._by_name: dict = {}

    def members_changed(self, upstreams) -> None:
        self._weights = {u.name: float(u.cfg.get("weight", 1.0)) for u in upstreams}
        self._uniform = all(w == 1.0 for w in self._weights.values())
        self._ring = HashRing(sorted(self._weights.items()), self.virtual_nodes)
        self._reciprocals = [1.0 / r for r in range(1, len(upstreams) + 1)]   # rank r's score
        self._by_name = {u.name: u for u in upstreams}

    def choose(self, ctx, keys: Keys, upstreams) -> dict:
        key = self.keys.route_key(keys)
        total_weight = (len(upstreams) if self._uniform else
                        sum(self._weights[u.name] for u in upstreams))
        saturated = {u.name for u in upstreams if u.polled is not None and self.saturated(u)}
        by_name = self._by_name
        ranked, home = self._ring.rank(ring_position(key, ctx.model),
                                       {u.name: u.load for u in upstreams},
                                       None if self._uniform else self._weights, total_weight,
                                       self.load_factor, saturated)
        ctx.route_info.update(policy="chwbl", key=f"{key:016x}", home=home,
                              blocks=len(keys.chain), mode=keys.mode)
        self.decided(ctx, "home" if ranked[0] == home else "spill")
        scores = dict(zip(map(by_name.__getitem__, ranked), self._reciprocals))
        if len(scores) < len(upstreams):       # off the ring (not yet a member): last
            scores = {**dict.fromkeys(upstreams, 0.0), **scores}
        return scores
