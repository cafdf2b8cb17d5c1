"""Admission: caps, priority queue, long-prompt lane, timeouts, release on disconnect, re-pick."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from tests.helpers import CHAT, assert_openai_error


def admission(gw):
    return next(p for p in gw.gateway.chain.plugins if p.name == "admission")


async def chat(client, url, headers=None, **extra):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **extra},
                           headers=headers or {}) as r:
        return r.status, await r.json(content_type=None), r.headers


def arrivals(standin, tag):
    """When each tagged request reached the upstream, by tag value."""
    return {r["json"][tag]: r["t"] for r in standin.requests if tag in r["json"]}


async def test_global_cap_queues_the_rest(make_standin, make_gateway):
    up = await make_standin(first_delay=0.4)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 2}}, "metrics"]})
    async with aiohttp.ClientSession() as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(chat(client, gw.url, i=i) for i in range(4)))
    assert [s for s, _, _ in results] == [200] * 4
    times = sorted(t - t0 for t in arrivals(up, "i").values())
    assert times[1] < 0.3 and times[2] > 0.35          # two waves of two
    async with aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert "prefixgate_queue_seconds_count 4.0" in text
    queued = float(text.split("prefixgate_queue_seconds_sum ")[1].split()[0])
    assert queued > 0.6                                 # two requests waited ~0.4 s each
    assert admission(gw).total == 0


async def test_per_upstream_cap(make_standin, make_gateway):
    a, b = await make_standin(first_delay=0.3), await make_standin(first_delay=0.3)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["least_inflight", {"admission": {"per_upstream": 1}}]})
    async with aiohttp.ClientSession() as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(chat(client, gw.url, i=i) for i in range(4)))
    assert [s for s, _, _ in results] == [200] * 4
    for s in (a, b):
        times = sorted(t - t0 for t in arrivals(s, "i").values())
        assert len(times) == 2 and times[1] - times[0] > 0.25   # one at a time per upstream


async def test_priority_order(make_standin, make_gateway):
    up = await make_standin(first_delay=0.15)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 1}}]})
    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(chat(client, gw.url, tag="first"))
        await asyncio.sleep(0.05)
        tasks = []
        for tag, prio in (("low", "-5"), ("mid", "0"), ("high", "10")):
            tasks.append(asyncio.create_task(chat(client, gw.url, tag=tag,
                                                  headers={"x-prefixgate-priority": prio})))
            await asyncio.sleep(0.02)
        await asyncio.gather(first, *tasks)
    order = sorted(arrivals(up, "tag").items(), key=lambda kv: kv[1])
    assert [tag for tag, _ in order] == ["first", "high", "mid", "low"]


async def test_bad_priority_header_is_400(make_standin, make_gateway):
    up = await make_standin()
    gw = await make_gateway({"upstreams": [{"url": up.url}], "plugins": ["admission"]})
    async with aiohttp.ClientSession() as client:
        for bad in ("high", "99999", "1.5"):
            status, body, _ = await chat(client, gw.url, headers={"x-prefixgate-priority": bad})
            assert_openai_error(body, 400, status)
    assert up.requests == []


async def test_short_requests_never_wait_behind_long_ones(make_standin, make_gateway):
    up = await make_standin(first_delay=0.4)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 2, "long_max_inflight": 2,
                                                        "long_prompt_chars": 2000}}]})
    long_msg = [{"role": "user", "content": "x" * 5000}]
    async with aiohttp.ClientSession() as client:
        held = [asyncio.create_task(chat(client, gw.url, tag=f"s{i}")) for i in range(2)]
        await asyncio.sleep(0.1)                     # both slots busy with short requests
        long_task = asyncio.create_task(chat(client, gw.url, tag="long", messages=long_msg))
        await asyncio.sleep(0.05)                    # the long one queued first ...
        short_task = asyncio.create_task(chat(client, gw.url, tag="short"))
        await asyncio.gather(*held, long_task, short_task)
    t = arrivals(up, "tag")
    assert t["short"] <= t["long"]                   # ... yet the short one went first


async def test_long_lane_cap_leaves_room_for_short(make_standin, make_gateway):
    up = await make_standin(first_delay=0.4)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 3, "long_max_inflight": 1,
                                                        "long_prompt_chars": 2000}}]})
    long_msg = [{"role": "user", "content": "x" * 5000}]
    async with aiohttp.ClientSession() as client:
        t0 = time.monotonic()
        longs = [asyncio.create_task(chat(client, gw.url, tag=f"l{i}", messages=long_msg))
                 for i in range(3)]
        await asyncio.sleep(0.05)
        status, _, _ = await chat(client, gw.url, tag="short")
        short_done = time.monotonic() - t0
        await asyncio.gather(*longs)
    assert status == 200 and short_done < 0.7        # one long running, two waiting: no wait
    t = sorted(v - t0 for k, v in arrivals(up, "tag").items() if k.startswith("l"))
    assert t[1] > 0.35 and t[2] > 0.75               # longs one at a time


async def test_queue_timeout_is_429_with_retry_after(make_standin, make_gateway):
    up = await make_standin(first_delay=1.0)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 1,
                                                        "queue_timeout_s": 0.2}}]})
    async with aiohttp.ClientSession() as client:
        held = asyncio.create_task(chat(client, gw.url))
        await asyncio.sleep(0.05)
        status, body, headers = await chat(client, gw.url)
        assert_openai_error(body, 429, status)
        assert body["error"]["code"] == "queue_timeout" and int(headers["Retry-After"]) >= 1
        assert (await held)[0] == 200
    assert admission(gw).waiting == 0 and admission(gw).total == 0


async def test_queue_timeout_with_all_upstreams_down_is_503(make_standin, make_gateway):
    up = await make_standin(first_delay=0.5)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 1,
                                                        "queue_timeout_s": 0.2}}]})
    async with aiohttp.ClientSession() as client:
        held = asyncio.create_task(chat(client, gw.url))
        await asyncio.sleep(0.05)
        gw.gateway.upstreams[0].healthy = False      # as health checking would
        status, body, headers = await chat(client, gw.url)
        assert_openai_error(body, 503, status)
        assert "Retry-After" in headers
        await held


async def test_full_queue_is_429_at_once(make_standin, make_gateway):
    up = await make_standin(first_delay=0.5)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 1, "max_queue": 1}}]})
    async with aiohttp.ClientSession() as client:
        held = [asyncio.create_task(chat(client, gw.url)) for _ in range(2)]   # 1 runs, 1 waits
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        status, body, _ = await chat(client, gw.url)
        assert_openai_error(body, 429, status)
        assert body["error"]["code"] == "queue_full" and time.monotonic() - t0 < 0.3
        assert [s for s, _, _ in await asyncio.gather(*held)] == [200, 200]


async def test_client_disconnect_releases_slot_and_queue_place(make_standin, make_gateway):
    up = await make_standin(first_delay=30)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "plugins": [{"admission": {"max_inflight": 1}}]})
    plugin = admission(gw)
    async with aiohttp.ClientSession() as client:
        tasks = [asyncio.create_task(chat(client, gw.url)) for _ in range(3)]
        await asyncio.sleep(0.3)
        assert plugin.total == 1 and plugin.waiting == 2
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for _ in range(50):
        if plugin.total == 0 and plugin.waiting == 0:
            break
        await asyncio.sleep(0.05)
    assert plugin.total == 0 and plugin.waiting == 0


async def test_waiter_is_re_picked_when_its_upstream_leaves(make_standin, make_gateway):
    a, b = await make_standin(first_delay=0.5), await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url}],
                             "plugins": [{"admission": {"per_upstream": 1}}]})
    async with aiohttp.ClientSession() as client:
        held = asyncio.create_task(chat(client, gw.url))
        await asyncio.sleep(0.1)
        waiting = asyncio.create_task(chat(client, gw.url, tag="moved"))   # queued for a
        await asyncio.sleep(0.1)
        await gw.gateway.set_upstreams([{**gw.gateway.upstreams[0].cfg},
                                        {**gw.gateway.upstreams[0].cfg, "name": "b",
                                         "url": b.url}])
        gw.gateway.upstreams[0].healthy = False      # a is going away
        status, _, headers = await waiting
        assert status == 200 and headers["x-prefixgate-upstream"] == "b"
        await held
    assert arrivals(b, "tag") and not arrivals(a, "tag")


async def test_api_key_priority_overrides_the_header(make_standin, make_gateway):
    up = await make_standin(first_delay=0.15)
    gw = await make_gateway({"upstreams": [{"url": up.url}],
                             "auth": {"api_keys": [{"key": "sk-vip-key-123", "priority": 50},
                                                   {"key": "sk-std-key-123"}]},
                             "plugins": [{"admission": {"max_inflight": 1}}]})
    std = {"Authorization": "Bearer sk-std-key-123"}
    vip = {"Authorization": "Bearer sk-vip-key-123", "x-prefixgate-priority": "-100"}
    async with aiohttp.ClientSession() as client:
        first = asyncio.create_task(chat(client, gw.url, headers=std, tag="first"))
        await asyncio.sleep(0.05)
        tasks = []
        for tag, headers in (("std1", {**std, "x-prefixgate-priority": "10"}), ("vip", vip)):
            tasks.append(asyncio.create_task(chat(client, gw.url, headers=headers, tag=tag)))
            await asyncio.sleep(0.02)
        await asyncio.gather(first, *tasks)
    order = sorted(arrivals(up, "tag").items(), key=lambda kv: kv[1])
    assert [tag for tag, _ in order] == ["first", "vip", "std1"]
