"""The indexes the simulator's cache-aware policies differ by, behind the gateway's scorer.

All three policies run `prefix_route`'s cache_aware scorer — its `cache_threshold`, its
balance thresholds, its load view — and only the index it asks "which upstream holds how
many leading blocks of this chain" differs:

    cache_aware  the plugin's own `PrefixIndex`: what this gateway replica sent where
    exact        a `KVEventIndex` fed by every engine's KV events (llm-d's precise scorer)
    oracle       each engine's block manager, asked directly: the best this scorer can choose
                 at each request (a greedy choice: two runs whose choices part can end a
                 percent or two either side of each other, so exact can end above it)

The approximate index keeps one index per model (`ApproximateIndex.models`); the simulated
requests have no model (None), so `install` puts the index there. (The gateway's own
`index: kv_events` reaches a KVEventIndex through ZMQ feeds, `kv_subscriber.py`, and takes
its matches for every upstream whose feed is live: with all feeds live, what the exact policy
gets here.) The exact index remembers as many blocks per engine as the engine's KV cache has,
so its capacity never forgets a block the engine still holds.
"""
from __future__ import annotations

from prefixgate.plugins.prefix_route.kv_index import KVEventIndex
from prefixgate.plugins.prefix_route.plugin import PrefixRoute


class EventFedIndex(KVEventIndex):
    """A KV-event index as the scorer's index: it learns from events alone, so the scorer's
    note of where it sent a prompt (`insert`) is dropped."""

    def insert(self, name: str, chain: list[int]) -> None:
        pass


class CacheOracle:
    """What each engine's prefix cache really holds, now."""

    def __init__(self, block_managers: dict):
        self.block_managers = block_managers          # upstream name -> BlockManager

    def match(self, chain: list[int]) -> dict[str, int]:
        out = {}
        for name, bm in self.block_managers.items():
            cached = bm.cached
            n = 0
            for h in chain:
                if h not in cached:
                    break
                n += 1
            if n:
                out[name] = n
        return out

    def insert(self, name: str, chain: list[int]) -> None:
        pass

    def retain(self, names) -> None:
        pass

    def size(self, name: str) -> int:
        return len(self.block_managers[name].cached)


def install(gw, index) -> None:
    """Make `index` the cache_aware index of `gw`'s prefix_route (for requests without a
    model)."""
    route = next(p for p in gw.chain.plugins if isinstance(p, PrefixRoute))
    if route.approximate is None:
        raise ValueError("only the cache_aware scorer consults an index")
    route.approximate.models.put(None, index)
