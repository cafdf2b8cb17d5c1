"""Start an aiohttp app on a host/port and tell where it listens (shared by every server)."""
from __future__ import annotations

import asyncio

from aiohttp import web


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Stop a background task and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                    shutdown_timeout: float = 60.0, **handler_kw) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0 = a free port); return the runner and the base URL.

    handler_cancellation=True: when a client disconnects, its handler is cancelled at once,
    so an upstream stream (or an engine sequence) is closed instead of running on.
    `runner.cleanup()` stops listening, then gives running handlers `shutdown_timeout`
    seconds to finish. `handler_kw` go to aiohttp's request handler (max_line_size,
    max_field_size, max_headers: oversized request heads are answered 400).
    """
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=shutdown_timeout, **handler_kw)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, url_of(bound_host, bound_port)
