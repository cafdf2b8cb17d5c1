"""Start an aiohttp app on a host/port and tell where it listens (shared by every server)."""
from __future__ import annotations

import asyncio
import logging

from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from prefixgate.proxy.errors import HTTPError

log = logging.getLogger("prefixgate.server")


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
    max_field_size, max_headers: oversized request heads are answered 431). Requests that
    do not parse get OpenAI-shaped JSON errors, like every other error.
    """
    runner = _JsonErrorRunner(app, handler_cancellation=True, access_log=None,
                              shutdown_timeout=shutdown_timeout, **handler_kw)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    return runner, url_of(bound_host, bound_port)


def protocol_error(exc: BaseException | None, status: int) -> HTTPError:
    """The JSON error for a request head aiohttp could not parse."""
    if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage)
                                         and "too many headers" in str(exc).lower()):
        return HTTPError(431, "request head too large: a header field, the request line or "
                         "the number of headers is over the limit", code="header_too_large")
    reason = exc.message if isinstance(exc, BadHttpMessage) else "malformed HTTP request"
    return HTTPError(status if 400 <= status < 500 else 400, f"bad HTTP request: {reason}",
                     code="bad_request")


class _JsonErrorHandler(web_protocol.RequestHandler):
    """aiohttp answers a request it cannot parse in plain text; answer in OpenAI's shape.
    Errors inside handlers (500) and anything after a response started keep aiohttp's path."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        log.debug("bad request from %s: %s", request.remote, exc)   # scanners: not worth more
        resp = protocol_error(exc, status).response()
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class _JsonErrorRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer      # same object; only its handler class differs
        return server
