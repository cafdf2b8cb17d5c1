"""One backend server and its keep-alive connection pool."""
from __future__ import annotations

from typing import Callable

import aiohttp

from prefixgate.proxy.h1pool import Pool


class Upstream:
    """A configured backend: its connection pools, in-flight count and health.

    Completions go through `pool` (proxy.h1pool: keep-alive, TCP_NODELAY, bytes passed
    through undecoded); the small control-plane requests (health polls, /v1/models,
    /metrics scrapes) use an aiohttp `session` that never decompresses either.
    """

    def __init__(self, cfg: dict, on_connect: list | None = None):
        self.cfg = cfg
        self.name: str = cfg["name"]
        self.url: str = cfg["url"]
        self.max_inflight: int = cfg["max_inflight"]
        self.timeouts: dict = cfg["timeouts"]
        self.extra_headers: dict = {str(k): str(v) for k, v in cfg["headers"].items()}
        self.inflight = 0
        self.healthy = True
        self.connections_opened = 0
        # called with (upstream, seconds) for each new connection; shared gateway-wide
        self.on_connect: list[Callable[["Upstream", float], None]] = (
            on_connect if on_connect is not None else [])
        self.session: aiohttp.ClientSession | None = None   # control plane: polls, /v1/models
        self.pool: Pool | None = None                         # data plane: completions
        # request headers the gateway sets itself, so the client's copies are dropped
        self.replaced_headers = frozenset(
            {"accept-encoding", "x-request-id", "content-type"} | {k.lower() for k in
                                                                    self.extra_headers})

    def __repr__(self) -> str:
        return f"Upstream({self.name!r}, {self.url!r})"

    async def start(self) -> None:
        self.pool = Pool(self.url, self.cfg["max_connections"], self.timeouts["connect"],
                         self._connected)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=8),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts["connect"]),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.session is not None:
            await self.session.close()

    def _connected(self, seconds: float) -> None:
        self.connections_opened += 1
        for hook in self.on_connect:
            hook(self, seconds)
