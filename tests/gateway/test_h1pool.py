"""The data-path HTTP/1.1 pool against real loopback servers, well- and ill-behaved."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket

import pytest

from prefixgate.proxy.upstream.h1pool import Pool, UpstreamError

JSON = [("Content-Type", "application/json")]


async def raw_server(respond):
    """A TCP server whose connection handler is `respond(reader, writer)`."""
    server = await asyncio.start_server(respond, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


async def test_keepalive_reuses_one_connection(standin):
    pool = Pool(standin.url, limit=4, connect_timeout=2)
    for _ in range(10):
        resp = await pool.request("POST", "/v1/completions", JSON, b'{"prompt": "x"}')
        assert resp.status == 200 and resp.content_type == "application/json"
        assert b"tok0" in await resp.read_all()
    assert pool.connections_opened == 1 and standin.connections == 1
    pool.close()


async def test_streamed_body_arrives_in_pieces(make_standin):
    up = await make_standin(tokens=3, gap=0.2)
    pool = Pool(up.url, limit=4, connect_timeout=2)
    resp = await pool.request("POST", "/v1/chat/completions", JSON, b'{"stream": true}')
    assert resp.content_type == "text/event-stream"
    first = await resp.read()
    assert first.startswith(b"data: ") and b"tok1" not in first
    rest = await resp.read_all()
    assert rest.endswith(b"data: [DONE]\n\n") and resp.is_eof()
    pool.close()


async def test_stale_keepalive_connection_is_retried_on_a_fresh_one():
    async def once_then_close(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()               # keep-alive promised, then closed while idle
    server, url = await raw_server(once_then_close)
    pool = Pool(url, limit=4, connect_timeout=2)
    for _ in range(3):
        resp = await pool.request("POST", "/", [], b"{}")
        assert await resp.read_all() == b"ok"
        await asyncio.sleep(0.1)
    assert pool.connections_opened == 3
    pool.close()
    server.close()


@pytest.mark.parametrize("answer,body", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n",
     b"abcde"),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil close", b"until close"),
])
async def test_body_framings(answer, body):
    async def respond(reader, writer):
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()
    server, url = await raw_server(respond)
    pool = Pool(url, limit=1, connect_timeout=2)
    resp = await pool.request("POST", "/", [], b"{}")
    assert await resp.read_all() == body
    pool.close()
    server.close()


async def test_refused_garbage_and_reset_raise_upstream_error():
    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"\x00\x01 this is not HTTP\r\n\r\n")
        await writer.drain()

    async def reset(reader, writer):
        await read_request(reader)
        writer.transport.abort()
    for handler in (garbage, reset):
        server, url = await raw_server(handler)
        pool = Pool(url, limit=1, connect_timeout=2)
        with pytest.raises(UpstreamError):
            await pool.request("POST", "/", [], b"{}")
        pool.close()
        server.close()
    server, url = await raw_server(reset)
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamError, match="cannot connect") as e:
        await Pool(url, limit=1, connect_timeout=2).request("POST", "/", [], b"{}")
    assert e.value.sent_nothing


async def test_connection_limit_is_respected(make_standin):
    up = await make_standin(first_delay=0.1)
    pool = Pool(up.url, limit=2, connect_timeout=2)

    async def one():
        resp = await pool.request("POST", "/v1/completions", JSON, b'{"prompt": "x"}')
        return await resp.read_all()
    results = await asyncio.gather(*(one() for _ in range(6)))
    assert all(b"tok0" in r for r in results)
    assert pool.connections_opened == 2
    pool.close()


async def test_closing_an_unfinished_response_drops_the_connection(make_standin):
    up = await make_standin(tokens=100, gap=0.05)
    pool = Pool(up.url, limit=2, connect_timeout=2)
    resp = await pool.request("POST", "/v1/chat/completions", JSON, b'{"stream": true}')
    await resp.read()
    resp.close()
    for _ in range(50):
        if up.aborted:
            break
        await asyncio.sleep(0.02)
    assert up.aborted == 1 and not pool.open
    pool.close()


# --- streamed request bodies (uploads) ---------------------------------------------------

def kernel_send_buffer_max() -> int:
    """How much the kernel may buffer for one sending socket (Linux: tcp_wmem's maximum)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            return int(f.read().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 * 1024 * 1024


class Body:
    """An async iterable of bytes that counts what it handed out, and may fail midway."""

    def __init__(self, data: bytes = b"", chunk: int = 65536, *, total: int | None = None,
                 fail_after: int | None = None):
        self.data, self.chunk = data, chunk
        self.total = len(data) if total is None else total
        self.fail_after = fail_after
        self.produced = 0

    async def __aiter__(self):
        filler = b"\xab" * self.chunk
        sizes = (self.chunk, 1, 7000, 300)          # irregular pieces, a 1-byte one too
        i = 0
        while self.produced < self.total:
            if self.fail_after is not None and self.produced >= self.fail_after:
                raise ConnectionResetError("the client went away mid-upload")
            n = min(sizes[i % len(sizes)], self.total - self.produced)
            piece = self.data[self.produced:self.produced + n] if self.data else filler[:n]
            i += 1
            self.produced += n
            yield piece
            await asyncio.sleep(0)


async def hashing_upstream():
    """An aiohttp upstream: POST /sha answers the sha256 and framing of the body it read."""
    from aiohttp import web

    from prefixgate.common.runtime import start_app
    failures: list[str] = []

    async def sha(request):
        digest, n = hashlib.sha256(), 0
        try:
            async for chunk in request.content.iter_any():
                digest.update(chunk)
                n += len(chunk)
        except BaseException as e:      # the upload was cut off (handler cancelled, or
                                        # the payload found incomplete)
            failures.append(type(e).__name__)
            raise
        return web.json_response({"sha": digest.hexdigest(), "n": n,
                                  "te": request.headers.get("Transfer-Encoding"),
                                  "cl": request.headers.get("Content-Length")})
    app = web.Application()
    app.router.add_post("/sha", sha)
    runner, url = await start_app(app, "127.0.0.1", 0)
    return runner, url, failures


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_streamed_body_arrives_byte_identical(chunked):
    runner, url, _ = await hashing_upstream()
    pool = Pool(url, limit=4, connect_timeout=2)
    data = os.urandom(2 * 1024 * 1024 + 17)
    body = Body(data)
    resp = await pool.request("POST", "/sha", [("Content-Type", "audio/wav")], body,
                              length=None if chunked else len(data))
    got = json.loads(await resp.read_all())
    assert resp.status == 200
    assert got["sha"] == hashlib.sha256(data).hexdigest() and got["n"] == len(data)
    assert (got["te"], got["cl"]) == (("chunked", None) if chunked else (None, str(len(data))))
    # the connection went back to the pool: a bytes request reuses it
    resp = await pool.request("POST", "/sha", [], b"abc")
    assert json.loads(await resp.read_all())["sha"] == hashlib.sha256(b"abc").hexdigest()
    assert pool.connections_opened == 1
    pool.close()
    await runner.cleanup()


async def stalling_upstream():
    """A raw upstream that reads a request's head, then nothing until `go` is set; then
    reads the Content-Length body and answers 200 with the byte count."""
    go, received = asyncio.Event(), [0]

    async def respond(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await go.wait()
        while received[0] < length:
            chunk = await reader.read(1 << 20)
            if not chunk:
                return
            received[0] += len(chunk)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%d"
                     % (len(str(length)), length))
        await writer.drain()
        writer.close()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)   # inherited on accept
    sock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(respond, sock=sock)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}", go, received


async def test_streamed_body_has_back_pressure():
    """An upstream that stops reading stops the body iterator too: the gateway holds only
    what the kernel's socket buffers and the transport's high-water mark allow."""
    server, url, go, received = await stalling_upstream()
    bound = kernel_send_buffer_max() + 4 * 1024 * 1024
    body = Body(total=4 * bound)
    pool = Pool(url, limit=1, connect_timeout=2)
    request = asyncio.ensure_future(pool.request("POST", "/", [], body, length=body.total))
    last = -1
    for _ in range(100):                             # until the iterator stops being read
        await asyncio.sleep(0.05)
        if body.produced == last:
            break
        last = body.produced
    assert received[0] == 0 and 0 < body.produced <= bound, (body.produced, bound)
    assert not request.done()
    go.set()
    resp = await asyncio.wait_for(request, 20)
    assert resp.status == 200 and int(await resp.read_all()) == body.total
    assert received[0] == body.total == body.produced
    pool.close()
    server.close()


async def test_cancelled_streamed_request_drops_the_connection():
    server, url, go, received = await stalling_upstream()
    pool = Pool(url, limit=1, connect_timeout=2)
    body = Body(total=1 << 30)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await pool.request("POST", "/", [], body, length=body.total)
    assert not pool.open and body.produced < body.total
    go.set()
    pool.close()
    server.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_upstream_rejecting_early_stops_the_upload(chunked):
    """413 before reading the body: the response is returned, sending stops, and the
    connection (whose request was cut short) is closed, not reused."""
    closed = asyncio.Event()

    async def respond(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"POST /upload "):
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\n\r\ntoo large")
            await writer.drain()
            try:                      # read nothing; wait for the gateway to close
                while await reader.read(1 << 20):
                    pass
            except ConnectionError:
                pass
            closed.set()
        else:
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()
    server, url = await raw_server(respond)
    pool = Pool(url, limit=1, connect_timeout=2)
    body = Body(total=1 << 30)
    resp = await asyncio.wait_for(
        pool.request("POST", "/upload", [], body, length=None if chunked else body.total), 10)
    assert resp.status == 413 and await resp.read_all() == b"too large"
    await asyncio.wait_for(closed.wait(), 5)
    assert body.produced < body.total and not pool.open
    resp = await pool.request("POST", "/small", [], b"{}")      # the pool is fine
    assert resp.status == 200 and await resp.read_all() == b"ok"
    pool.close()
    server.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_iterator_failing_closes_the_connection(chunked):
    runner, url, failures = await hashing_upstream()
    pool = Pool(url, limit=1, connect_timeout=2)
    resp = await pool.request("POST", "/sha", [], b"warm")          # an idle connection too
    await resp.read_all()
    body = Body(total=4 << 20, fail_after=1 << 20)
    with pytest.raises(ConnectionResetError, match="mid-upload"):
        await pool.request("POST", "/sha", [], body, length=None if chunked else body.total)
    assert not pool.open
    for _ in range(100):
        if failures:
            break
        await asyncio.sleep(0.02)
    assert failures, "the upstream should see the upload cut off"
    resp = await pool.request("POST", "/sha", [], b"abc")           # the pool stays usable
    assert json.loads(await resp.read_all())["sha"] == hashlib.sha256(b"abc").hexdigest()
    pool.close()
    await runner.cleanup()


async def test_streamed_request_when_every_slot_holds_an_idle_connection():
    """A streamed body never takes an idle connection; at the limit it retires one."""
    runner, url, _ = await hashing_upstream()
    pool = Pool(url, limit=1, connect_timeout=2)
    await (await pool.request("POST", "/sha", [], b"x")).read_all()
    assert len(pool.idle) == 1
    resp = await asyncio.wait_for(pool.request("POST", "/sha", [], Body(b"y" * 10), length=10),
                                  5)
    assert json.loads(await resp.read_all())["n"] == 10
    assert pool.connections_opened == 2 and len(pool.open) == 1
    pool.close()
    await runner.cleanup()


@pytest.mark.parametrize("streamed", [False, True], ids=["bytes", "streamed"])
async def test_interim_100_continue_is_skipped(streamed):
    async def respond(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.write(b"HTTP/1.1 201 Created\r\nX-Got: %d\r\nContent-Length: 2\r\n\r\nok"
                     % len(body))
        await writer.drain()
        writer.close()
    server, url = await raw_server(respond)
    pool = Pool(url, limit=1, connect_timeout=2)
    data = b"z" * 100_000
    resp = await pool.request("POST", "/", [("Expect", "100-continue")],
                              Body(data) if streamed else data, length=len(data))
    assert resp.status == 201 and resp.header(b"x-got") == b"100000"
    assert await resp.read_all() == b"ok"
    pool.close()
    server.close()
