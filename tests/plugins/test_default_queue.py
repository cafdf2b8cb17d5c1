"""Bursts wait, they are not refused: without an `admission:` entry the chain still queues
(one FIFO lane, bounded at 4x the fleet's slots) when every upstream is at max_inflight."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers import CHAT, assert_openai_error


async def stream_chat(client, url, i):
    async with client.post(url + "/v1/chat/completions",
                           json={**CHAT, "stream": True, "i": i}) as r:
        body = await r.read()
        return r.status, body


async def test_1000_concurrent_streams_on_defaults(make_standin, make_gateway):
    up = await make_standin(tokens=4, gap=0.001, record=False)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})   # all defaults
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=120)) as client:
        results = await asyncio.gather(*(stream_chat(client, gw.url, i) for i in range(1000)))
    assert [s for s, _ in results] == [200] * 1000
    assert all(body.rstrip().endswith(b"data: [DONE]") for _, body in results)
    assert up.completed == 1000


async def test_full_default_queue_is_429_with_retry_after(make_standin, make_gateway):
    """max_inflight 1 → 4 may wait; the 6th of six concurrent requests is refused at once."""
    up = await make_standin(first_delay=0.5)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url, "max_inflight": 1}]})
    async with aiohttp.ClientSession() as client:
        async def one(i):
            async with client.post(gw.url + "/v1/chat/completions", json={**CHAT, "i": i}) as r:
                return r.status, await r.json(content_type=None), r.headers
        results = await asyncio.gather(*(one(i) for i in range(6)))
    statuses = sorted(s for s, _, _ in results)
    assert statuses == [200] * 5 + [429], statuses
    status, payload, headers = next(r for r in results if r[0] == 429)
    assert_openai_error(payload, 429, status)
    assert payload["error"]["code"] == "queue_full" and headers["Retry-After"] == "1"


async def test_default_queue_is_first_come_first_served(make_standin, make_gateway):
    up = await make_standin(first_delay=0.1)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url, "max_inflight": 1}]})
    async with aiohttp.ClientSession() as client:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.ensure_future(client.post(
                gw.url + "/v1/chat/completions", json={**CHAT, "i": i},
                headers={"x-prefixgate-priority": str(i)})))   # ignored by the default lane
            await asyncio.sleep(0.02)
        for resp in await asyncio.gather(*tasks):
            assert resp.status == 200
            resp.release()
    order = [r["json"]["i"] for r in sorted(up.requests, key=lambda r: r["t"])]
    assert order == [0, 1, 2, 3]
