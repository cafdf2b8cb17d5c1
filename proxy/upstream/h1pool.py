"""A lean HTTP/1.1 client pool for the data path: one keep-alive pool per upstream.

Why not aiohttp's ClientSession here: on a proxied request it costs ~150 µs of CPU (request
objects, tracing hooks, StreamReader plumbing), about as much as everything else the gateway
does. This pool writes the request in one `transport.write`, parses the response with
llhttp (via `httptools`) in C, and hands body bytes to the reader as they arrive. The
control plane (health polls, /v1/models, /metrics scrapes) still uses aiohttp.

A request body is either bytes (the data path: written with the head in that one write) or
an async iterable of bytes (uploads: streamed with back-pressure, never held whole).
"""
from __future__ import annotations

import asyncio
import socket
import ssl as ssl_mod
import time
from collections import deque
from collections.abc import AsyncIterable, Callable

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

    def __init__(self, conn: Connection):
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
        self.sent_at = time.monotonic()      # made just before its request head is written

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

    def __init__(self, pool: Pool):
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.closed = False
        self.reused = False
        self.interim = False         # inside a 1xx response (100 Continue): not the answer
        self.sending = False         # a streamed request body is not fully written yet
        self.write_paused = False    # the transport's buffer is above its high-water mark
        self._drain_waiter: asyncio.Future | None = None

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

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._forget(self)
        self._wake_drain()
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
            status = self.parser.get_status_code()
            if status < 200:             # 100 Continue, 103 Early Hints: the answer follows
                self.interim = True
                self.resp.headers.clear()
                return
            self.resp._on_headers(status)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._on_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        resp, self.resp = self.resp, None
        keep_alive = self.parser.should_keep_alive()
        if resp is not None:
            resp._on_complete()
        # answered before the request body was all sent: the framing is lost, never reuse
        if keep_alive and not self.closed and not self.sending:
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

    async def drain(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        while self.write_paused and not self.closed:
            self._drain_waiter = self.loop.create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None

    def _wake_drain(self) -> None:
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    async def send_body(self, body: AsyncIterable[bytes], length: int | None) -> None:
        """Write a streamed request body: as is (`length` bytes), or chunk-encoded (None).

        Stops quietly once the connection closes (the response carries the reason). Once
        `sending` is False the connection may serve another request: touch it no more (so
        the iterator is not read past `length` bytes)."""
        write, sent = self.transport.write, 0
        if length == 0:
            self.sending = False
            return
        async for chunk in body:
            if self.closed:
                return
            if not chunk:
                continue                 # an empty chunk would end a chunked body
            sent += len(chunk)
            if length is None:
                self.transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
            elif sent > length:
                raise ValueError(f"request body is longer than its length {length}")
            else:
                write(chunk)
                if sent == length:
                    self.sending = False
                    return
            if self.write_paused:
                await self.drain()
        if length is not None:
            raise ValueError(f"request body ended after {sent} of {length} bytes")
        if not self.closed:
            write(b"0\r\n\r\n")
            self.sending = False

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
            if self.transport.get_write_buffer_size():
                self.transport.abort()   # unsent request bytes: close() would wait for them
            else:
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
                      body: bytes | AsyncIterable[bytes], *,
                      length: int | None = None) -> Response:
        """Send a request; return once the response's status and headers have arrived.

        `body` bytes: a reused keep-alive connection the upstream closed meanwhile is retried
        once on a fresh connection (the upstream never saw the request). `body` an async
        iterable of bytes: streamed (see `_request_streamed`), with `length` as its
        Content-Length, or chunk-encoded when `length` is None.
        """
        if not isinstance(body, (bytes, bytearray, memoryview)):
            return await self._request_streamed(method, path, headers, body, length)
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

    async def _request_streamed(self, method: str, path: str, headers: list[tuple[str, str]],
                                body: AsyncIterable[bytes], length: int | None) -> Response:
        """Stream `body` while watching for the response.

        A streamed body cannot be replayed, so it never goes on an idle keep-alive connection:
        one the upstream closed meanwhile would fail the request with the body half consumed.
        It takes a fresh connection, or one handed over by a request finishing right now
        (never idle, so not stale). No retry: once the body is being read, every UpstreamError
        has `sent_nothing` False.

        Answered before the body is all sent (an upstream rejecting it early with 413/400):
        sending stops, the response is returned, and the connection is closed after it.
        The body iterator raising (the client went away mid-upload): the connection is
        closed, and the error raised as is.
        """
        conn = await self._acquire(fresh=True)
        resp = Response(conn)
        conn.resp = resp
        conn.sending = True
        conn.transport.write(self._head(method, path, headers, length))
        sender = self.loop.create_task(conn.send_body(body, length))
        sender.add_done_callback(_retrieve)
        try:
            await asyncio.wait((sender, resp._headers_done), return_when=asyncio.FIRST_COMPLETED)
            if sender.done() and not sender.cancelled() and sender.exception() is not None:
                raise sender.exception()              # the body iterator failed
            await resp._headers_done                  # sent; or answered (early) or failed
            return resp
        except BaseException as e:
            if isinstance(e, UpstreamError):
                e.sent_nothing = False           # the body is (partly) consumed: no retry
            resp._headers_done.cancel()          # nobody awaits it any more
            resp.close()
            conn.abort()
            raise
        finally:
            sender.cancel()          # a no-op once sent; else stops sending after an answer

    def _head(self, method: str, path: str, headers: list[tuple[str, str]],
              length: int | None) -> bytes:
        lines = [f"{method} {self.base_path}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        lines.append(f"Content-Length: {length}\r\n\r\n" if length is not None
                     else "Transfer-Encoding: chunked\r\n\r\n")
        return "".join(lines).encode("latin-1")

    async def _acquire(self, fresh: bool) -> Connection:
        while not fresh and self.idle:
            conn = self.idle.pop()                 # most recently used: least likely stale
            if not conn.closed and not conn.transport.is_closing():
                conn.reused = True
                return conn
        while len(self.open) + self.connecting >= self.limit:
            if fresh and self.idle:      # all slots taken, some idle: retire the oldest one
                self.idle.popleft().abort()
                continue
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


def _retrieve(task: asyncio.Task) -> None:
    """Mark a body sender's outcome as seen (it is acted on, or moot, in the request)."""
    if not task.cancelled():
        task.exception()
