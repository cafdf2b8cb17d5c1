"""What the gateway and the bundled engine's server share: starting an aiohttp app and telling
where it listens, the event loop, JSON request bodies, OpenAI-shaped errors, readiness."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web, web_protocol
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from prefixgate.common.errors import HTTPError, shape_for
from prefixgate.common.procfs import held_by

log = logging.getLogger("prefixgate.server")


def install_uvloop() -> None:
    """Make uvloop the event loop of this process's asyncio.run() calls, when it is installed."""
    try:
        import uvloop  # optional: not on Windows
    except ImportError:
        return
    uvloop.install()


def run_on_uvloop(coro):
    """asyncio.run(coro) on a uvloop loop when uvloop is installed, leaving the process's
    event loop policy as it was (the caller may be a test, not a process of its own)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Stop a background task and wait until it has finished unwinding."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def parse_json_object(raw: bytes) -> dict:
    """A request body that must be one JSON object; anything else is a 400 naming why."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise HTTPError(400, "request JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object", code="invalid_json")
    return body


def encode_body(body: dict) -> bytes:
    """A JSON body as it is sent on (to an upstream)."""
    try:
        return json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:     # a lone surrogate (\\ud800) from the client: keep it escaped
        return json.dumps(body).encode()


def json_errors_middleware(
        reasons: Callable[[web.Request, int], str | None] | None = None, *,
        passthrough: tuple[type[BaseException], ...] = (),
        internal_message: str | Callable[[Exception], str] = "internal error",
        logger: logging.Logger = log):
    """An aiohttp middleware answering every error in JSON, in the shape of the path's API
    (errors.shape_for: OpenAI's, or Anthropic's on the Messages API).

    HTTPError -> its response; aiohttp's own errors (404/405 from the router, 413 ...) -> the
    same shape, with `reasons(request, status)` as the message when it gives one (else
    aiohttp's reason); `passthrough` exceptions and cancellation (the client hung up) go on
    up; anything else is logged and answered 500 with `internal_message` (a string, or a
    function of the exception), code internal_error.
    """
    @web.middleware
    async def json_errors(request: web.Request, handler):
        try:
            return await handler(request)
        except HTTPError as e:
            return e.response(shape=shape_for(request.path))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = reasons(request, e.status) if reasons is not None else None
            return HTTPError(e.status, reason or e.reason).response(
                shape=shape_for(request.path))
        except asyncio.CancelledError:
            raise
        except passthrough:
            raise
        except Exception as e:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            message = internal_message if isinstance(internal_message, str) else internal_message(e)
            return HTTPError(500, message, code="internal_error").response(
                shape=shape_for(request.path))
    return json_errors


async def wait_ready(url: str, path: str = "/v1/models", timeout: float = 30, proc=None, *,
                     what: str | None = None, interval: float = 0.1,
                     own_port: bool = True) -> float:
    """Poll `url + path` until it answers 200; RuntimeError after `timeout` seconds, or as
    soon as `proc` (the child serving `url`: an asyncio subprocess or a subprocess.Popen) has
    exited. `what` names the server in those errors (default: its URL). Returns when
    (time.monotonic()) it first answered at all: a server listens before it is ready.
    With `proc` and `own_port`, only its own listener counts: another process that took the
    port between its choice and the child's bind (common/procfs.py) is never taken for it.
    (`own_port=False` for a child whose port some other process serves, e.g. a container's.)"""
    what = what or url
    deadline = time.monotonic() + timeout
    answered, stranger = None, ""
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            code = None if proc is None else proc.poll() if hasattr(proc, "poll") else \
                proc.returncode
            if code is not None:
                raise RuntimeError(f"{what} exited with {code}{stranger}")
            try:
                async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if own_port and not _listens(proc, url):
                        stranger = (f" (another process answered on its port: it was taken "
                                    f"before {what} could listen)")
                    else:
                        answered = answered or time.monotonic()
                        if r.status == 200:
                            return answered
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(interval)
    raise RuntimeError(f"{what} not ready after {timeout}s{stranger}")


def _listens(proc, url: str) -> bool:
    """Whether `url`'s port is `proc`'s own listener (True without a proc, or where /proc
    cannot tell)."""
    return proc is None or held_by(proc.pid, urlsplit(url).port or 80) is not False


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that is free now (for a child process to listen on; any other process
    may take it before the child binds it: `listening_socket` closes that window)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def distinct_free_ports(host: str = "127.0.0.1") -> Callable[[], int]:
    """free_port() for ports chosen together: each call a port no earlier call gave (the
    kernel may offer a port it has just released again, so two free_port() calls can give
    one port twice: two endpoints of one engine on one address)."""
    given: set[int] = set()

    def next_port() -> int:
        port = free_port(host)
        while port in given:
            port = free_port(host)
        given.add(port)
        return port
    return next_port


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A socket listening on host:port (0: a free port) for a child to serve on (handed down
    with Popen's pass_fds, named by the engine's --listen-fd): the port is held from the
    moment it is chosen, so no other process can take it while the child starts.
    Connections wait in its backlog meanwhile."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def start_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, *,
                    shutdown_timeout: float = 60.0, reuse_port: bool = False,
                    sock: socket.socket | None = None,
                    **handler_kw) -> tuple[web.AppRunner, str]:
    """Listen on host:port (0 = a free port), or serve on `sock` (a listening socket, e.g. one
    a launcher handed down: `listening_socket`); return the runner and the base URL.

    handler_cancellation=True: when a client disconnects, its handler is cancelled at once,
    so an upstream stream (or an engine sequence) is closed instead of running on.
    `runner.cleanup()` stops listening, then gives running handlers `shutdown_timeout`
    seconds to finish. `handler_kw` go to aiohttp's request handler (max_line_size,
    max_field_size, max_headers: oversized request heads are answered 431). Requests that
    do not parse get OpenAI-shaped JSON errors, like every other error. `reuse_port`: bind
    with SO_REUSEPORT, beside other processes of the same user on the same port (the workers of
    `prefixgate serve --workers N`: the kernel spreads connections among them).
    """
    runner = _JsonErrorRunner(app, handler_cancellation=True, access_log=None,
                              shutdown_timeout=shutdown_timeout, **handler_kw)
    await runner.setup()
    site = web.SockSite(runner, sock) if sock is not None else \
        web.TCPSite(runner, host, port, backlog=1024, reuse_port=reuse_port or None)
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
