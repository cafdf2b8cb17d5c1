"""One backend server and its keep-alive connection pool."""
from __future__ import annotations

import time
from typing import Callable

import aiohttp


class Upstream:
    """A configured backend: its pool (one ClientSession), in-flight count and health.

    The session never decompresses (bytes pass through as the backend sent them) and keeps
    connections alive; aiohttp sets TCP_NODELAY on every connection it opens.
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
        self.session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return f"Upstream({self.name!r}, {self.url!r})"

    async def start(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(self._connect_start)
        trace.on_connection_create_end.append(self._connect_end)
        connector = aiohttp.TCPConnector(limit=self.cfg["max_connections"],
                                         keepalive_timeout=60, enable_cleanup_closed=False)
        self.session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            trace_configs=[trace],
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts["connect"]),
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _connect_start(self, session, ctx, params) -> None:
        ctx.t0 = time.monotonic()

    async def _connect_end(self, session, ctx, params) -> None:
        self.connections_opened += 1
        elapsed = time.monotonic() - ctx.t0
        for hook in self.on_connect:
            hook(self, elapsed)
