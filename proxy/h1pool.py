"""A lean HTTP/1.1 client pool for the data path: one keep-alive pool per upstream.

Why not aiohttp's ClientSession here: on a proxied request it costs ~150 µs of CPU (request
objects, tracing hooks, StreamReader plumbing), about as much as everything else the gateway
does. This pool writes the request in one `transport.write`, parses the response with
llhttp (via `httptools`) in C, and hands body bytes to the reader as they arrive. The
control plane (health polls, /v1/models, /metrics scrapes) still uses aiohttp.
"""
from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
import time
from collections import deque
from typing import Callable

import httptools
from yarl import URL

READ_PAUSE_BYTES = 256 * 1024      # stop reading the upstream while this much is unread


class UpstreamError(Exception):
    """The connection failed, was refused or reset, or the upstream spoke broken HTTP."""

    def __init__(self, message: str, sent_nothing: bool = False, connect: bool = False):
        super().__init__(message)
        self.sent_nothing = sent_nothing     # no response byte arrived: safe to retry
        self.connect = connect               # no connection could be opened at all


class Response:
    """A response whose status and headers have arrived; the body is read as it comes."""

    def __init__(self, conn: "Connection"):
        self._conn: Connection | None = conn
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.error: UpstreamError | None = None
        self.got_bytes = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._waiter: asyncio.Future | None = None
        self._headers_done: asyncio.Future = conn.loop.create_future()

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None

    @property
    def content_type(self) -> str:
        value = self.header(b"content-type") or b""
        return value.split(b";", 1)[0].strip().lower().decode("latin-1")

    def is_eof(self) -> bool:
        return self.complete and not self._chunks

    async def read(self) -> bytes:
        """The body bytes received so far and not yet read; b"" once the body is complete."""
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        if self._buffered >= READ_PAUSE_BYTES and self._conn is not None:
            self._conn.resume()
        self._buffered = 0
        return data

    async def read_all(self) -> bytes:
        parts = []
        while chunk := await self.read():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Done with this response. Unfinished: drop the connection so the upstream stops."""
        conn, self._conn = self._conn, None
        if conn is not None and not self.complete:
            conn.abort()

    # --- called by the connection --------------------------------------------------------
    def _on_headers(self, status: int) -> None:
        self.status = status
        if not self._headers_done.done():
            self._headers_done.set_result(None)

    def _on_body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered >= READ_PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def _on_complete(self) -> None:
        self.complete = True
        self._conn = None
        self._wake()

    def _on_error(self, error: UpstreamError) -> None:
        self.error = error
        if not self._headers_done.done():
            self._headers_done.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One keep-alive connection; parses responses with llhttp as bytes arrive."""

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.reused = False

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if self.resp is not None:
            self.resp.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"invalid HTTP response from upstream: {e}"))
            self.abort()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.resp is not None:
            resp = self.resp
            if resp._headers_done.done() and self._body_until_close(resp):
                self.resp = None
                resp._on_complete()
            else:
                self._fail(UpstreamError(
                    "upstream closed the connection" + (f": {exc}" if exc else ""),
                    sent_nothing=not resp.got_bytes))

    # llhttp callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp._on_headers(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._on_body(body)

    def on_message_complete(self) -> None:
        resp, self.resp = self.resp, None
        keep_alive = self.parser.should_keep_alive()
        if resp is not None:
            resp._on_complete()
        if keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.abort()

    # helpers
    @staticmethod
    def _body_until_close(resp: Response) -> bool:
        """A body with neither length nor chunking ends when the connection closes."""
        return (resp.header(b"content-length") is None
                and b"chunked" not in (resp.header(b"transfer-encoding") or b"").lower())

    def _fail(self, error: UpstreamError) -> None:
        resp, self.resp = self.resp, None
        if resp is not None:
            resp._on_error(error)

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            self.transport.close()


class Pool:
    """Keep-alive connections to one upstream, at most `limit` open at once."""

    def __init__(self, url: str, limit: int, connect_timeout: float,
                 on_connect: Callable[[float], None] | None = None):
        parsed = URL(url)
        self.host, self.port = parsed.host, parsed.port
        self.ssl = ssl_mod.create_default_context() if parsed.scheme == "https" else None
        self.host_header = parsed.raw_authority
        self.base_path = parsed.raw_path.rstrip("/")
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.on_connect = on_connect
        self.loop = asyncio.get_event_loop()
        self.idle: deque[Connection] = deque()
        self.open: set[Connection] = set()
        self.waiters: deque[asyncio.Future] = deque()
        self.connecting = 0
        self.connections_opened = 0

    async def request(self, method: str, path: str, headers: list[tuple[str, str]],
                      body: bytes) -> Response:
        """Send a request; return once the response's status and headers have arrived.

        A reused keep-alive connection the upstream closed meanwhile is retried once on a
        fresh connection (the upstream never saw the request).
        """
        head = self._head(method, path, headers, len(body))
        for attempt in (0, 1):
            conn = await self._acquire(fresh=attempt == 1)
            resp = Response(conn)
            conn.resp = resp
            conn.transport.write(head + body if body else head)
            try:
                await resp._headers_done
                return resp
            except UpstreamError as e:
                if not (conn.reused and e.sent_nothing and attempt == 0):
                    raise
            except asyncio.CancelledError:
                resp.close()
                raise
        raise AssertionError("unreachable")

    def _head(self, method: str, path: str, headers: list[tuple[str, str]], length: int) -> bytes:
        lines = [f"{method} {self.base_path}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        lines.append(f"Content-Length: {length}\r\n\r\n")
        return "".join(lines).encode("latin-1")

    async def _acquire(self, fresh: bool) -> Connection:
        while not fresh and self.idle:
            conn = self.idle.pop()                 # most recently used: least likely stale
            if not conn.closed and not conn.transport.is_closing():
                conn.reused = True
                return conn
        while len(self.open) + self.connecting >= self.limit:
            waiter = self.loop.create_future()
            self.waiters.append(waiter)
            try:
                conn = await waiter
            except asyncio.CancelledError:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                    self._release(waiter.result())     # handed over just as we gave up
                raise
            if conn is not None:
                conn.reused = True
                return conn
        return await self._connect()

    async def _connect(self) -> Connection:
        t0 = time.monotonic()
        self.connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            self._wake_one()
            raise UpstreamError(f"connect timeout after {self.connect_timeout}s",
                                sent_nothing=True, connect=True) from None
        except OSError as e:
            self._wake_one()
            raise UpstreamError(f"cannot connect: {e.strerror or e}", sent_nothing=True,
                                connect=True) from None
        finally:
            self.connecting -= 1
        self.open.add(conn)
        self.connections_opened += 1
        if self.on_connect is not None:
            self.on_connect(time.monotonic() - t0)
        return conn

    def _release(self, conn: Connection) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self.idle.append(conn)

    def _forget(self, conn: Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            try:
                self.idle.remove(conn)
            except ValueError:
                pass
            self._wake_one()

    def _wake_one(self) -> None:
        """A connection slot came free: let one waiter open a connection of its own."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        for conn in list(self.open):
            conn.abort()
