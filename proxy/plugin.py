"""The plugin contract (DESIGN.md §2): the Plugin base class and its hooks.

A plugin is a class with a short `name`, built from its YAML mapping. Every hook is optional;
the gateway calls only the hooks a plugin actually defines, so an unused hook costs nothing.
Routing plugins return scores and the gateway adds them up with each plugin's `weight`, so
scorers compose (prefix affinity + load) instead of branching inside one router.
"""
from __future__ import annotations

from prefixgate.common.schema import Key, check

HOOKS = ("start", "on_request", "score", "admit", "on_first_byte", "on_chunk", "on_finish", "close")


class Plugin:
    """Base class. Subclasses set `name` and `spec` (allowed keys) and override hooks."""
    name = "plugin"
    spec: dict[str, Key] = {}

    def __init__(self, cfg: dict, gw):
        self.gw = gw
        self.cfg = check(cfg, self.spec)
        self.weight = float(self.cfg.get("weight", 1.0))

    # Hooks (all optional; shown here for documentation, detected by override):
    # async def start(self) -> None                                   when the gateway starts
    #                                                                 (start background tasks)
    # async def on_request(self, ctx: RequestContext) -> None        rewrite ctx.body or raise HTTPError
    # def score(self, ctx, upstreams: list[Upstream]) -> dict[Upstream, float]   routing plugins
    # async def admit(self, ctx) -> None                              wait for a slot or raise HTTPError
    # def on_first_byte(self, ctx) -> None
    # def on_chunk(self, ctx, data: bytes) -> None                    cheap and sync: hot path
    # def on_finish(self, ctx, error: Exception | None) -> None
    # async def close(self) -> None
