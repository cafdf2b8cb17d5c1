"""Building the plugin chain from the config's `plugins:` list.

Each plugin's declared needs (`Plugin.needs`: RequestContext fields) must be provided by a
plugin of the chain (every on_request hook runs before routing); a chain where one is not
fails to build, naming the setting that asked for it.

Plugins register Prometheus metrics and connect hooks on the gateway, so each plugin's
registrations are recorded (`gw.plugin_owned`): a reload (proxy/config/reload.py) can then
carry the kept plugins' collectors over to a new registry and build only the changed ones.
"""
from __future__ import annotations

import importlib
import json

from prometheus_client import CollectorRegistry

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.plugin import HOOKS, Plugin

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


# what a chain always has: a router, and a bounded FIFO wait for a slot when every upstream
# is full (a burst queues as it would at vLLM instead of being refused); (hook, plugin) pairs,
# each added only when no configured plugin has the hook
FALLBACKS = (("score", "round_robin"),
             ("admit", {"admission": {"lanes": False, "priority_header": False}}))


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


class Chain:
    """The built plugins, with each hook pre-bound to the plugins that define it."""

    def __init__(self, plugins: list[Plugin]):
        self.plugins = plugins
        for hook in HOOKS:
            setattr(self, hook, [getattr(p, hook) for p in plugins if hasattr(p, hook)])
        self.scorers = [p for p in plugins if hasattr(p, "score")]
        # streams keep their last chunks for a plugin that reads their usage at the end
        self.keeps_tail = any(getattr(p, "keeps_stream_tail", False) for p in plugins)
        self.active = 0             # requests running on this chain (a reload waits for them)


class TrackingRegistry(CollectorRegistry):
    """A registry that remembers who registered what: `base` (the gateway) or `recording`."""

    def __init__(self):
        super().__init__()
        self.base: list = []
        self.recording: list | None = None

    def register(self, collector) -> None:
        super().register(collector)
        (self.recording if self.recording is not None else self.base).append(collector)


def _key(item) -> str:
    return json.dumps(item, sort_keys=True, default=str)


def build_chain(gw, items: list, reuse: dict | None = None) -> Chain:
    """The chain for `items` (and the FALLBACKS it needs); plugins in `reuse`
    ({key: [plugin]}) are kept as they are."""
    entries = [_entry(gw, i, item, reuse) for i, item in enumerate(items)]
    # getattr: a third-party plugin need not subclass Plugin
    provided = {field for _, p in entries for field in getattr(p, "provides", ())}
    for i, (item, (_, p)) in enumerate(zip(items, entries)):
        missing = next((n for n in getattr(p, "needs", ()) if n.field not in provided), None)
        if missing is not None:
            raise ConfigError(missing.key, missing.why).under(
                f"plugins[{i}].{plugin_entry(item)[0]}")
    for hook, item in FALLBACKS:
        if not any(hasattr(p, hook) for _, p in entries):
            entries.append(_entry(gw, len(entries), item, reuse))
    gw.plugin_keys = entries
    return Chain([p for _, p in entries])


def _entry(gw, i: int, item, reuse: dict | None) -> tuple[str, Plugin]:
    """(config key, plugin): the kept plugin for an unchanged item, else a new one."""
    key = _key(item)
    kept = (reuse or {}).get(key)
    if not kept:
        return key, _build_one(gw, i, item)
    p = kept.pop(0)
    cols, hooks = gw.plugin_owned[p]
    gw.registry.recording = []        # still the plugin's, not the gateway's
    try:
        for c in cols:
            gw.registry.register(c)
    finally:
        gw.registry.recording = None
    gw.on_connect.extend(hooks)
    return key, p


def plugin_entry(item) -> tuple[str, dict | None]:
    """A `plugins:` item (a name, or a one-key mapping of name to settings) as (name, settings)."""
    return (item, {}) if isinstance(item, str) else next(iter(item.items()))


def _build_one(gw, i: int, item):
    name, cfg = plugin_entry(item)
    registry = gw.registry
    registry.recording = cols = []
    n_hooks = len(gw.on_connect)
    try:
        p = resolve(name)(cfg or {}, gw)
    except ConfigError as e:
        raise e.under(f"plugins[{i}].{name}") from None
    finally:
        registry.recording = None
    gw.plugin_owned[p] = (cols, gw.on_connect[n_hooks:])
    return p
