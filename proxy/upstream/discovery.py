"""Upstream discovery by DNS: every A/AAAA record of a hostname is an upstream.

A Kubernetes headless Service (`clusterIP: None`) answers its name with one record per ready
pod, so re-resolving it on an interval lets backends join and leave without a gateway
restart. Discovered upstreams are named `ip:port` — the same names on every gateway replica,
so `prefix_route`'s hash ring agrees across replicas.

    discovery:
      dns: vllm-headless.default.svc.cluster.local
      port: 8000
      interval_s: 5
      max_inflight: 128            # any upstream setting: applies to each discovered one
      kv_events: {endpoint: "tcp://*:5557", replay_endpoint: "tcp://*:5558"}   # * = each address

A failed lookup (or an empty answer) keeps the last known set: a DNS hiccup must not take
the whole fleet out of rotation, and an upstream that really left is skipped by the health
checks until the next good answer removes it.

`kv_events` is a template: its endpoints name the host `*` (as the engines' own
`--kv-events-config` binds them), and each discovered upstream connects to its own address
on those ports.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from prefixgate.common.runtime import cancel_and_wait
from prefixgate.common.schema import ConfigError, Key, check, one_of, positive
from prefixgate.proxy.upstream.upstreams import KV_EVENTS, UPSTREAM, tcp_endpoint

log = logging.getLogger("prefixgate.discovery")

Resolver = Callable[[str, int, int], Awaitable[list[str]]]

SPEC = {
    "dns": Key(str),
    "port": Key(int, 8000, lambda p: None if 0 < p < 65536 else "must be 1..65535"),
    "scheme": Key(str, "http", one_of("http", "https")),
    "interval_s": Key((int, float), 5.0, positive),
    "family": Key(str, "any", one_of("any", "ipv4", "ipv6")),
    **{k: v for k, v in UPSTREAM.items() if k not in ("name", "url")},
    "kv_events": Key(dict, None, nested={
        **KV_EVENTS,
        "endpoint": Key(str, check=lambda e: tcp_endpoint(e, host="*")),
        "replay_endpoint": Key(str, check=lambda e: tcp_endpoint(e, host="*")),
    }),
}
FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


def validate(raw, default_timeouts: dict) -> dict:
    cfg = check(raw, SPEC, "discovery")
    if not cfg["dns"].strip():
        raise ConfigError("discovery.dns", "must be a hostname")
    cfg["timeouts"] = {**default_timeouts, **(raw.get("timeouts") or {})}
    return cfg


async def resolve(host: str, port: int, family: int) -> list[str]:
    """The host's addresses, sorted and without duplicates (the system resolver, async)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=family,
                                                         type=socket.SOCK_STREAM)
    return sorted({info[4][0] for info in infos})


class Discovery:
    """Keeps `gw.upstreams` = the static `upstreams:` + one upstream per resolved address."""

    def __init__(self, cfg: dict | None, gw, resolver: Resolver | None = None):
        self.cfg = cfg
        self.gw = gw
        self.resolver = resolver or resolve
        self.addresses: list[str] = []
        self.failures = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        if self.cfg is None:
            return
        await self.refresh()            # first answer before the gateway takes requests
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg["interval_s"])
            await self.refresh()

    async def refresh(self) -> bool:
        """Resolve once and apply the answer; True when the upstream set changed."""
        cfg = self.cfg
        try:
            async with asyncio.timeout(max(cfg["interval_s"], 2.0)):
                found = await self.resolver(cfg["dns"], cfg["port"], FAMILIES[cfg["family"]])
        except (OSError, TimeoutError) as e:
            found, reason = [], f"{type(e).__name__}: {e}"
        else:
            reason = "no addresses"
        if not found:
            self.failures += 1
            if self.failures == 1:
                log.warning("discovery: %s: %s; keeping the last %d upstream(s)",
                            cfg["dns"], reason, len(self.addresses))
            return False
        self.failures = 0
        if found == self.addresses:
            return False
        log.info("discovery: %s -> %s", cfg["dns"], ", ".join(found))
        self.addresses = found
        static = [u for u in self.gw.config["upstreams"]]
        await self.gw.set_upstreams(static + [self.upstream_config(a) for a in found])
        return True

    def upstream_config(self, address: str) -> dict:
        cfg = self.cfg
        ipv6 = ipaddress.ip_address(address.split("%")[0]).version == 6
        host = f"[{address}]" if ipv6 else address
        up = {k: cfg[k] for k in UPSTREAM if k not in ("name", "url")}
        up["name"] = f"{host}:{cfg['port']}"
        up["url"] = f"{cfg['scheme']}://{host}:{cfg['port']}"
        if up["kv_events"] is not None:         # the template's `*` is this address
            up["kv_events"] = {k: v.replace("tcp://*:", f"tcp://{host}:") if k.endswith("endpoint")
                               else v for k, v in up["kv_events"].items()}
        return up
