"""The plugin contract (DESIGN.md §2): the Plugin base class, its hooks and its declared needs.

A plugin is a class with a short `name`, built from its YAML mapping. Every hook is optional;
the gateway calls only the hooks a plugin actually defines, so an unused hook costs nothing.
Routing plugins return scores and the gateway adds them up with each plugin's `weight`, so
scorers compose (prefix affinity + load) instead of branching inside one router.

Plugins meet through named RequestContext fields, never by looking each other up: a plugin
declares the fields it fills (`provides`) and those another plugin must fill (`needs`), and
the chain checks at build time that every need is met.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixgate.common.schema import Key, check

HOOKS = ("start", "on_request", "score", "with_room", "admit", "on_first_byte", "on_chunk",
         "on_finish", "close")


@dataclass(frozen=True)
class Need:
    """A RequestContext field that another plugin of the chain must provide."""
    field: str      # e.g. "tokens"
    key: str        # the setting that makes the plugin need it (the error names it)
    why: str        # the error's message when no plugin of the chain provides it


class Plugin:
    """Base class. Subclasses set `name` and `spec` (allowed keys) and override hooks."""
    name = "plugin"
    spec: dict[str, Key] = {}
    provides: frozenset[str] = frozenset()   # RequestContext fields its on_request fills
    needs: tuple[Need, ...] = ()             # set per instance when settings decide them
    keeps_stream_tail = False                # on_finish reads ctx.tail (a stream's last chunks)

    def __init__(self, cfg: dict, gw):
        self.gw = gw
        self.cfg = check(cfg, self.spec)
        self.weight = float(self.cfg.get("weight", 1.0))

    # Hooks (all optional; shown here for documentation, detected by override):
    # async def start(self) -> None                      when the gateway starts (background
    #                                                    tasks)
    # async def on_request(self, ctx) -> None            rewrite ctx.body, fill the fields it
    #                                                    `provides`, or raise HTTPError
    # def score(self, ctx, upstreams) -> dict[Upstream, float]       routing plugins
    # def with_room(self, upstreams) -> list[Upstream]   the routing filter "has a free slot"
    #                                                    (instead of in flight < max_inflight)
    # async def admit(self, ctx) -> None                 wait for a slot or raise HTTPError
    # def on_first_byte(self, ctx) -> None
    # def on_chunk(self, ctx, data: bytes) -> None       cheap and sync: hot path
    # def on_finish(self, ctx, error: Exception | None) -> None
    # async def close(self) -> None
