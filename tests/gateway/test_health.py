"""Upstream health: active probes eject and restore, passive ejection, 5xx failover."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from prefixgate.common.runtime import free_port
from tests.helpers import CHAT

FAST = {"interval_s": 0.1, "timeout_s": 0.5, "unhealthy_threshold": 2, "healthy_threshold": 2,
        "eject_s": 0}


async def chat(client, url, **extra):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **extra}) as r:
        await r.read()
        return r.status, r.headers.get("x-prefixgate-upstream")


async def health(client, url) -> dict:
    async with client.get(url + "/health") as r:
        return await r.json()


async def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_probes_eject_a_dead_upstream_and_restore_it(make_standin, make_gateway):
    a = await make_standin()
    port = free_port()
    b = await make_standin()
    await b.stop()
    b = await (type(b)(b.behaviour)).start(port=port)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["round_robin", "metrics"], "health": FAST})
    async with aiohttp.ClientSession() as client:
        assert (await health(client, gw.url))["upstreams"]["b"]["healthy"] is True
        await b.stop()                                       # b dies
        assert await wait_for(lambda: _healthy_is(client, gw.url, "b", False))
        report = (await health(client, gw.url))["upstreams"]["b"]
        assert "failed probes" in report["reason"] and report["ejections"] == 1
        picks = [await chat(client, gw.url) for _ in range(6)]
        assert picks == [(200, "a")] * 6                     # no request tried the dead one
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
        assert 'prefixgate_upstream_healthy{upstream="b"} 0.0' in text
        assert 'prefixgate_upstream_ejections_total{upstream="b"} 1.0' in text

        b2 = await (type(b)(b.behaviour)).start(port=port)  # b comes back on its address
        try:
            assert await wait_for(lambda: _healthy_is(client, gw.url, "b", True))
            picks = {(await chat(client, gw.url))[1] for _ in range(6)}
            assert picks == {"a", "b"}
            assert len(b2.requests) == 3
        finally:
            await b2.stop()


async def _healthy_is(client, url, name, value) -> bool:
    return (await health(client, url))["upstreams"][name]["healthy"] is value


async def test_connect_error_ejects_at_once_and_eject_s_brings_it_back(make_standin, make_gateway):
    live = await make_standin()
    dead = f"http://127.0.0.1:{free_port()}"
    gw = await make_gateway({"upstreams": [{"name": "dead", "url": dead},
                                           {"name": "live", "url": live.url}],
                             "plugins": ["round_robin"],
                             "health": {"interval_s": 0, "eject_s": 0.6}})
    async with aiohttp.ClientSession() as client:
        results = [await chat(client, gw.url) for _ in range(6)]
        assert results == [(200, "live")] * 6               # failed over, then never tried
        dead_up = next(u for u in gw.gateway.upstreams if u.name == "dead")
        assert dead_up.healthy is False
        assert "cannot connect" in (await health(client, gw.url))["upstreams"]["dead"]["reason"]
        # without probes the ejection ends after eject_s: one request tests the upstream again
        assert await wait_for(lambda: _healthy_is(client, gw.url, "dead", True), timeout=3)


async def test_a_burst_of_5xx_ejects_the_upstream(make_standin, make_gateway):
    sick = await make_standin(fail="status", status=500)
    good = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "sick", "url": sick.url},
                                           {"name": "good", "url": good.url}],
                             "plugins": ["round_robin"],
                             "health": {"interval_s": 0, "max_5xx": 3, "eject_s": 60}})
    async with aiohttp.ClientSession() as client:
        results = [await chat(client, gw.url) for _ in range(12)]
    # 500 is not retried (the backend may have done work); it passes through until ejection
    assert results.count((500, "sick")) == 3
    assert results[-4:] == [(200, "good")] * 4
    assert len(sick.requests) == 3


async def test_503_before_the_first_byte_is_retried_elsewhere(make_standin, make_gateway):
    busy = await make_standin(fail="status", status=503)
    good = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "busy", "url": busy.url},
                                           {"name": "good", "url": good.url}],
                             "plugins": ["round_robin"], "health": {"interval_s": 0}})
    async with aiohttp.ClientSession() as client:
        results = [await chat(client, gw.url, stream=True) for _ in range(4)]
    assert results == [(200, "good")] * 4
    assert len(busy.requests) >= 1 and len(good.requests) == 4


async def test_503_from_the_only_upstream_passes_through(make_standin, make_gateway):
    busy = await make_standin(fail="status", status=503)
    gw = await make_gateway({"upstreams": [{"name": "busy", "url": busy.url}],
                             "health": {"interval_s": 0}})
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["message"] == "stand-in failure"
    assert len(busy.requests) == 1


async def test_probes_use_their_own_pool_so_a_busy_upstream_stays_healthy(make_standin,
                                                                           make_gateway):
    up = await make_standin(first_delay=1.0)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url, "max_connections": 2}],
                             "health": FAST})
    async with aiohttp.ClientSession() as client:
        busy = [asyncio.create_task(chat(client, gw.url)) for _ in range(4)]   # pool saturated
        await asyncio.sleep(0.7)
        assert (await health(client, gw.url))["upstreams"]["a"]["healthy"] is True
        assert [s for s, _ in await asyncio.gather(*busy)] == [200] * 4


async def test_probe_status_below_500_is_up_and_5xx_is_down(make_gateway):
    from aiohttp import web

    from prefixgate.common.runtime import start_app
    state = {"status": 404}                     # e.g. a hosted API without /health

    async def probe(request):
        return web.Response(status=state["status"])
    app = web.Application()
    app.router.add_get("/health", probe)
    runner, url = await start_app(app)
    try:
        gw = await make_gateway({"upstreams": [{"name": "a", "url": url}], "health": FAST})
        async with aiohttp.ClientSession() as client:
            await asyncio.sleep(0.5)
            report = (await health(client, gw.url))["upstreams"]["a"]
            assert report["healthy"] is True and report["last_probe"] == "HTTP 404"
            state["status"] = 503                # e.g. llama.cpp while loading a model
            assert await wait_for(lambda: _healthy_is(client, gw.url, "a", False))
            async with client.get(gw.url + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "unavailable"
            state["status"] = 200
            assert await wait_for(lambda: _healthy_is(client, gw.url, "a", True))
    finally:
        await runner.cleanup()
