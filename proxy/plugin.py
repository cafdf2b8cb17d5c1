"""The plugin contract and registry (DESIGN.md §2).

A plugin is a class with a short `name`, built from its YAML mapping. Every hook is optional;
the gateway calls only the hooks a plugin actually defines, so an unused hook costs nothing.
Routing plugins return scores and the gateway adds them up with each plugin's `weight`, so
scorers compose (prefix affinity + load) instead of branching inside one router.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from prefixgate.proxy.config import ConfigError, Key, check

if TYPE_CHECKING:
    from prefixgate.proxy.context import RequestContext
    from prefixgate.proxy.upstream import Upstream

# short name -> "module:Class"; imported lazily so a config only pays for what it uses
BUILTIN = {
    "round_robin": "prefixgate.plugins.balance:RoundRobin",
    "least_inflight": "prefixgate.plugins.balance:LeastInflight",
    "metrics": "prefixgate.plugins.metrics:Metrics",
    "normalize": "prefixgate.plugins.normalize.plugin:Normalize",
    "prerender": "prefixgate.plugins.prerender:Prerender",
    "prefix_route": "prefixgate.plugins.prefix_route.plugin:PrefixRoute",
    "admission": "prefixgate.plugins.admission:Admission",
}

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


def resolve(name: str) -> type[Plugin]:
    """A built-in short name, or `package.module:Class` for a third-party plugin."""
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ConfigError("", f"unknown plugin {name!r} (built-in: {', '.join(sorted(BUILTIN))}; "
                              "or give module:Class)")
    module, _, cls = target.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as e:
        raise ConfigError("", f"cannot load plugin {name!r}: {e}") from None


def build(items: list, gw) -> list[Plugin]:
    """Build the chain from the config's `plugins:` list, in order."""
    chain = []
    for i, item in enumerate(items):
        name, cfg = (item, {}) if isinstance(item, str) else next(iter(item.items()))
        try:
            chain.append(resolve(name)(cfg or {}, gw))
        except ConfigError as e:
            raise e.under(f"plugins[{i}].{name}") from None
    return chain


class Chain:
    """The built plugins, with each hook pre-bound to the plugins that define it."""

    def __init__(self, plugins: list[Plugin]):
        self.plugins = plugins
        for hook in HOOKS:
            setattr(self, hook, [getattr(p, hook) for p in plugins if hasattr(p, hook)])
        self.scorers = [p for p in plugins if hasattr(p, "score")]
