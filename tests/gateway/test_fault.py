"""Fault injection: every way an upstream can fail gives the client the right status or an SSE
error event, never a duplicated token; the gateway stays healthy and the next requests are
served by a healthy upstream."""
from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest

from prefixgate.common.runtime import free_port, wait_ready
from tests.helpers import CHAT, assert_openai_error, event_json, read_events


class BadServer:
    """A TCP server that misbehaves below HTTP: stays silent, answers garbage, or hangs up."""

    def __init__(self, mode: str):
        self.mode = mode
        self.accepted = 0
        self._writers = []

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _serve(self, reader, writer):
        self.accepted += 1
        self._writers.append(writer)
        if self.mode == "silent":           # accepts, never reads nor answers
            return
        await reader.read(1024)
        if self.mode == "garbage":
            writer.write(b"\x00\xffSSH-2.0-not-http\r\n\r\n")
        writer.close()

    async def stop(self):
        for w in self._writers:
            w.close()
        self.server.close()


@pytest.fixture
async def bad_server():
    servers = []

    async def factory(mode):
        s = await BadServer(mode).start()
        servers.append(s)
        return s
    yield factory
    for s in servers:
        await s.stop()


async def post(client, url, **body):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **body}) as r:
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, [event_json(e) for _, e in await read_events(r)], r.headers
        return r.status, await r.json(content_type=None), r.headers


async def assert_gateway_fine(client, gw, healthy_name, n=4):
    async with client.get(gw.url + "/health") as r:
        assert r.status == 200
    for _ in range(n):
        status, events, headers = await post(client, gw.url, stream=True)
        assert status == 200 and events[-1] == "[DONE]"
        assert headers["x-prefixgate-upstream"] == healthy_name


async def two_upstreams(make_gateway, bad_url, good, **extra):
    return await make_gateway({"upstreams": [{"name": "bad", "url": bad_url, **extra},
                                             {"name": "good", "url": good.url}],
                               "plugins": ["round_robin", "metrics"],
                               "health": {"interval_s": 0, "max_5xx": 1, "eject_s": 60}})


async def test_killed_mid_stream_ends_with_an_sse_error_and_is_not_retried(make_standin,
                                                                         make_gateway):
    a, b = await make_standin(tokens=8), await make_standin(tokens=8)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["round_robin"], "health": {"interval_s": 0}})
    async with aiohttp.ClientSession() as client:
        # the first request goes to a (round robin), which dies after 3 events
        status, events, headers = await post(
            client, gw.url, stream=True, x_standin={"fail": "reset_after", "fail_after": 3})
        assert status == 200 and headers["x-prefixgate-upstream"] == "a"
        assert [e["choices"][0]["delta"]["content"] for e in events[1:4]] == [   # after the role
            "tok0 ", "tok1 ", "tok2 "]
        assert len(events) == 5 and events[4]["error"]["code"] == "upstream_error"
        assert "[DONE]" not in events
        assert len(b.requests) == 0               # bytes were sent: never retried elsewhere
        for _ in range(4):
            status, events, _ = await post(client, gw.url, stream=True)
            assert status == 200 and events[-1] == "[DONE]"


async def test_upstream_process_killed_mid_stream(make_standin, make_gateway):
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.proxy.testing.standin", "--port", str(port),
        "--tokens", "40", "--gap", "0.05",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as client:
            await wait_ready(url, "/health", 5, proc)      # its own listener, no other's
            good = await make_standin()
            gw = await two_upstreams(make_gateway, url, good)
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": True}) as r:
                assert r.status == 200 and r.headers["x-prefixgate-upstream"] == "bad"
                events = []
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events.append(event_json(line.rstrip()))
                        if len(events) == 3:
                            proc.kill()               # SIGKILL, mid-stream
            assert 3 <= len(events) < 40 and "[DONE]" not in events
            assert events[-1]["error"]["code"] == "upstream_error"
            assert good.requests == []                # not retried once bytes were sent
            await assert_gateway_fine(client, gw, "good")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_refused_connections_fail_over(make_standin, make_gateway):
    good = await make_standin()
    gw = await two_upstreams(make_gateway, f"http://127.0.0.1:{free_port()}", good)
    async with aiohttp.ClientSession() as client:
        await assert_gateway_fine(client, gw, "good")
    assert len(good.requests) == 4


@pytest.mark.parametrize("mode", ["silent", "hang"])
async def test_accepting_but_never_answering_is_504(make_standin, make_gateway, bad_server,
                                                    mode):
    good = await make_standin()
    bad_url = (await bad_server("silent")).url if mode == "silent" else (
        await make_standin(fail="hang")).url
    gw = await two_upstreams(make_gateway, bad_url, good, timeouts={"first_byte": 0.3})
    async with aiohttp.ClientSession() as client:
        status, body, headers = await post(client, gw.url, stream=True)
        assert_openai_error(body, 504, status)
        assert headers["x-prefixgate-upstream"] == "bad"
        await assert_gateway_fine(client, gw, "good")       # ejected after the timeout


async def test_garbage_instead_of_http_fails_over(make_standin, make_gateway, bad_server):
    good = await make_standin()
    bad = await bad_server("garbage")
    gw = await two_upstreams(make_gateway, bad.url, good)
    async with aiohttp.ClientSession() as client:
        status, events, headers = await post(client, gw.url, stream=True)
        assert status == 200 and headers["x-prefixgate-upstream"] == "good"
        await assert_gateway_fine(client, gw, "good")
    assert bad.accepted >= 1


@pytest.mark.parametrize("stream", [True, False])
async def test_non_json_answer_is_502(make_standin, make_gateway, stream):
    good = await make_standin()
    bad = await make_standin(fail="garbage")             # 200, text/plain, bytes
    gw = await two_upstreams(make_gateway, bad.url, good)
    async with aiohttp.ClientSession() as client:
        status, body, _ = await post(client, gw.url, stream=stream)
        assert_openai_error(body, 502, status)
        assert "non-JSON" in body["error"]["message"]
        await assert_gateway_fine(client, gw, "good")


async def test_slow_first_byte(make_standin, make_gateway):
    slow = await make_standin(first_delay=0.6)
    gw = await make_gateway({"upstreams": [{"url": slow.url, "timeouts": {"first_byte": 0.3}}],
                             "health": {"interval_s": 0, "max_5xx": 100}})
    async with aiohttp.ClientSession() as client:
        for stream in (True, False):
            status, body, _ = await post(client, gw.url, stream=stream)
            assert_openai_error(body, 504, status)
        # a first byte inside the limit is fine
        status, events, _ = await post(client, gw.url, stream=True, x_standin={"first_delay": 0.1})
        assert status == 200 and events[-1] == "[DONE]"


async def test_stall_mid_stream_ends_with_an_sse_error(make_standin, make_gateway):
    up = await make_standin(tokens=4, gap=0.6)
    gw = await make_gateway({"upstreams": [{"url": up.url, "timeouts": {"idle": 0.3}}]})
    async with aiohttp.ClientSession() as client:
        status, events, _ = await post(client, gw.url, stream=True)
        assert status == 200 and len(events) == 3                # the role, tok0, the error
        assert events[1]["choices"][0]["delta"]["content"] == "tok0 "
        assert "idle timeout" in events[2]["error"]["message"]
        status, events, _ = await post(client, gw.url, stream=True, x_standin={"gap": 0})
        assert status == 200 and events[-1] == "[DONE]"
