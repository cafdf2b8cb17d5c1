"""The data-path HTTP/1.1 pool against real loopback servers, well- and ill-behaved."""
from __future__ import annotations

import asyncio

import pytest

from prefixgate.proxy.h1pool import Pool, UpstreamError

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
    for i in range(10):
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
