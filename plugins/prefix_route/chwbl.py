"""`policy: chwbl` — consistent hashing with bounded loads on the prompt's prefix key.

The key is the hash of the prompt's first `prefix_blocks` blocks, mixed with the request's
model (`keys.ring_position`); the ring (`hash_ring.py`) sends it to its home upstream unless
the home's load is over `load_factor` times its share, or its polled KV cache is saturated.
Stateless: gateway replicas that see the same upstream names agree without talking to each
other. Score 1 for the choice, 0 for the rest.
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

    def members_changed(self, upstreams) -> None:
        self._weights = {u.name: float(u.cfg.get("weight", 1.0)) for u in upstreams}
        self._uniform = all(w == 1.0 for w in self._weights.values())
        self._ring = HashRing(sorted(self._weights.items()), self.virtual_nodes)

    def choose(self, ctx, keys: Keys, upstreams) -> dict:
        key = self.keys.route_key(keys)
        by_name = {u.name: u for u in upstreams}
        total_weight = (len(upstreams) if self._uniform else
                        sum(self._weights[u.name] for u in upstreams))
        chosen, home = self._ring.choose(ring_position(key, ctx.model),
                                         {u.name: u.load for u in upstreams},
                                         self._weights, total_weight, self.load_factor,
                                         lambda name: not self.saturated(by_name[name]))
        ctx.route_info.update(policy="chwbl", key=f"{key:016x}", home=home,
                              blocks=len(keys.chain), mode=keys.mode)
        self.decided(ctx, "home" if chosen == home else "spill")
        return {by_name[chosen]: 1.0}
