"""Load-only routing scorers: round robin and least in-flight."""
from __future__ import annotations

import itertools

from prefixgate.common.schema import Key, positive
from prefixgate.proxy.plugin import Plugin


class RoundRobin(Plugin):
    """Each request to the next upstream in turn (the baseline every router is judged by)."""
    name = "round_robin"
    spec = {"weight": Key((int, float), 1.0, positive)}

    def __init__(self, cfg, gw):
        super().__init__(cfg, gw)
        self._counter = itertools.count()

    def score(self, ctx, upstreams):
        turn = next(self._counter) % len(upstreams)
        return {u: (1.0 if i == turn else 0.0) for i, u in enumerate(upstreams)}


class LeastInflight(Plugin):
    """Prefer the upstream with the most free capacity: 1 - load / max_inflight, where the load
    (`Upstream.load`) counts the requests queued here for it too: when every upstream is full,
    the shortest queue wins."""
    name = "least_inflight"
    spec = {"weight": Key((int, float), 1.0, positive)}

    def score(self, ctx, upstreams):
        return {u: 1.0 - u.load / u.max_inflight for u in upstreams}
