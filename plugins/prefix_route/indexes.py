"""The two indexes the cache_aware scorer can ask (`index:`): which upstream holds how many
leading blocks of a prompt.

`approximate` — what this gateway sent where: a `PrefixIndex` per model (at most MAX_MODELS,
  least recently used out), so two models — a base model and its LoRA adapter on the same
  vLLM, whose KV blocks differ — never share an entry. Fed on each request's first byte.

`kv_events` — what each engine says it holds: the exact index (`kv_index.py`) kept by the KV
  event feeds (`kv_subscriber.py`, one per upstream with `kv_events:`), for every upstream
  whose feed is live; the others (no `kv_events`, a publisher that is down, silent, or being
  resynced) are matched from the approximate index, which keeps being fed for all of them, so
  falling back costs nothing. The exact index is keyed by token blocks through the gateway's
  own chain, so a request keyed on text is matched from the approximate index alone. It is one
  for all models: an engine's events describe its own cache, of its own model, and upstreams
  that do not serve the request's model were filtered out already; LoRA adapters' blocks are
  not indexed, so a request for a model an upstream lists as an adapter is matched on that
  upstream from the approximate index.
"""
from __future__ import annotations

from prefixgate.plugins.prefix_route.keys import Keys
from prefixgate.plugins.prefix_route.kv_subscriber import KVEventFeeds
from prefixgate.plugins.prefix_route.prefix_index import PrefixIndex
from prefixgate.proxy.lru import LRU

MAX_MODELS = 64                   # approximate indexes kept (one per model routed)


class ApproximateIndex:
    """`index: approximate`: what this gateway sent where, per model."""

    def __init__(self, capacity: int):
        self.capacity = capacity                  # blocks per upstream and model
        self.models: LRU[str | None, PrefixIndex] = LRU(MAX_MODELS)

    def of(self, model: str | None) -> PrefixIndex:
        """The index of `model`'s prompts."""
        index = self.models.get(model)
        if index is None:
            index = PrefixIndex(self.capacity)
            self.models.put(model, index)
        return index

    def match(self, ctx, keys: Keys, upstreams) -> dict[str, int]:
        return self.of(ctx.model).match(keys.chain)

    def retain(self, upstreams) -> None:
        names = {u.name for u in upstreams}
        for index in self.models.values():
            index.retain(names)

    def size(self, name: str) -> int:
        """Blocks remembered for upstream `name`, all models."""
        return sum(index.size(name) for index in self.models.values())


class EngineIndex:
    """`index: kv_events`: the engines' word where their feed is live, else `approximate`."""

    def __init__(self, approximate: ApproximateIndex, feeds: KVEventFeeds):
        self.approximate = approximate
        self.feeds = feeds
        self._adapter_ids: dict[str, tuple] = {}     # upstream -> (its model cards, adapter ids)

    def match(self, ctx, keys: Keys, upstreams) -> dict[str, int]:
        matched = self.approximate.match(ctx, keys, upstreams)
        live = self.feeds.live
        if not live or keys.mode != "tokens":
            return matched              # the exact index is keyed by token blocks only
        exact = self.feeds.index.match(keys.chain)
        for u in upstreams:
            name = u.name
            if name in live and ctx.model not in self._adapters(u):
                m = exact.get(name)
                if m:
                    matched[name] = m
                else:
                    matched.pop(name, None)
        return matched

    def retain(self, upstreams) -> None:
        self.approximate.retain(upstreams)
        self.feeds.reconcile(upstreams)
        names = {u.name for u in upstreams}
        self._adapter_ids = {n: v for n, v in self._adapter_ids.items() if n in names}

    def _adapters(self, up) -> frozenset:
        """The LoRA adapters `up` lists (their blocks are not in the exact index)."""
        cards = up.model_cards
        seen = self._adapter_ids.get(up.name)
        if seen is None or seen[0] is not cards:
            ids = frozenset(c.get("id") for c in cards or () if c.get("parent"))
            seen = self._adapter_ids[up.name] = (cards, ids)
        return seen[1]
