"""Swapping the plugin chain (with upstreams and settings) on a reload.

A reload keeps every plugin whose settings did not change (its state — prefix tables, rate
counters — survives) and builds only the changed ones. Plugins register Prometheus metrics
and connect hooks on the gateway, so each plugin's registrations are recorded: a new
registry then carries over the kept plugins' collectors and the changed ones' replacements
without "duplicated timeseries" clashes. Requests already running hold the chain they
started with (`ctx.chain`); plugins dropped by a reload are closed once those finish.
"""
from __future__ import annotations

import asyncio
import logging

from prefixgate.proxy import isolation
from prefixgate.proxy.auth import Auth
from prefixgate.proxy.chain import TrackingRegistry, build_chain
from prefixgate.proxy.rate_limits import RateLimits

log = logging.getLogger("prefixgate.reload")


async def apply(gw, cfg: dict) -> None:
    """Switch `gw` to the validated config `cfg`, or raise ConfigError and change nothing."""
    owned = gw.plugin_owned
    old_chain, old_registry, old_hooks = gw.chain, gw.registry, list(gw.on_connect)
    old_entries = list(gw.plugin_keys)
    new_auth = Auth(cfg["auth"])
    plugin_hooks = {id(h) for _, hooks in owned.values() for h in hooks}
    reuse: dict = {}
    for key, p in old_entries:
        reuse.setdefault(key, []).append(p)

    registry = TrackingRegistry()
    for c in old_registry.base:
        registry.register(c)
    gw.registry = registry
    gw.on_connect[:] = [h for h in old_hooks if id(h) not in plugin_hooks]
    try:
        chain = build_chain(gw, cfg["plugins"], reuse)
    except Exception:
        gw.registry, gw.on_connect[:] = old_registry, old_hooks
        gw.plugin_keys = old_entries
        raise
    kept = {id(p) for _, p in gw.plugin_keys}
    fresh = [p for _, p in gw.plugin_keys if p not in [q for _, q in old_entries]]
    dropped = [p for _, p in old_entries if id(p) not in kept]

    for p in fresh:
        if hasattr(p, "start"):
            await p.start()
    gw.chain = chain
    gw.auth = new_auth
    gw.isolation = isolation.for_config(cfg, new_auth.keys)
    old_limits, gw.limits = gw.limits, RateLimits(cfg["rate_limits"], new_auth.keys,
                                                  old=gw.limits)
    await old_limits.close()            # its store connection, unless the new one took it
    gw.retries = cfg["retries"]
    gw.health.reconfigure(cfg["health"])
    discovery, restart = _discovery_for(gw, cfg)
    if restart:
        await gw.discovery.close()
        gw.discovery = discovery
    found = [] if restart or discovery is None or discovery.cfg is None else [
        discovery.upstream_config(a) for a in discovery.addresses]   # keep what DNS gave
    await _apply_upstreams(gw, cfg["upstreams"] + found)
    _warn_restart_only(gw.config, cfg)
    gw.config = cfg
    if restart:
        await discovery.start()     # resolves once, then adds its upstreams to the static ones
    asyncio.get_running_loop().create_task(_retire(gw, old_chain, dropped))
    log.warning("config reloaded: %d upstream(s), %d plugin(s) (%d rebuilt)",
                len(gw.upstreams), len(chain.plugins), len(fresh))


def _discovery_for(gw, cfg: dict):
    """(the discovery to use, whether it is new) — rebuilt only when its settings changed."""
    current = getattr(gw, "discovery", None)
    if current is None or cfg.get("discovery") == gw.config.get("discovery"):
        return current, False
    return type(current)(cfg.get("discovery"), gw), True


async def _apply_upstreams(gw, configs: list[dict]) -> None:
    await gw.set_upstreams(configs)
    by_name = {c["name"]: c for c in configs}
    for up in gw.upstreams:           # kept pools take the new limits, timeouts and headers
        c = by_name.get(up.name)
        if c is not None and c != up.cfg:
            up.cfg = c
            up.max_inflight = c["max_inflight"]
            up.role = c["role"]
            up.timeouts = c["timeouts"]
            up.extra_headers = {str(k): str(v) for k, v in c["headers"].items()}
            up.replaced_headers = up.replaced_headers | {k.lower() for k in up.extra_headers}
            up.set_model_cards(up.model_cards)      # a static `models:` list may have changed


def _warn_restart_only(old: dict, new: dict) -> None:
    for key in ("listen", "admin_listen", "bundled", "model", "access_log", "tracing"):
        if old.get(key) != new.get(key):
            log.warning("config key %r changed: it takes effect after a restart", key)
    for key in ("max_body_bytes", "max_header_bytes", "max_line_bytes", "max_headers"):
        if old["limits"][key] != new["limits"][key]:
            log.warning("limits.%s changed: it takes effect after a restart", key)


async def _retire(gw, chain, dropped: list, poll_s: float = 0.1) -> None:
    """Close the plugins a reload dropped once no request runs on their chain."""
    while chain.active:
        await asyncio.sleep(poll_s)
    owned = gw.plugin_owned
    for p in dropped:
        owned.pop(p, None)
        if hasattr(p, "close"):
            try:
                await p.close()
            except Exception:
                log.exception("closing plugin %s after a reload failed", p.name)
