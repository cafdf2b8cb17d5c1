"""One routing decision per attempt: counted once, made even for a single upstream, not
repeated while the request waits for a slot."""
from __future__ import annotations

import asyncio

import aiohttp

from tests.helpers import CHAT


async def post_chat(client, url, **extra):
    async with client.post(url + "/v1/chat/completions", json={**CHAT, **extra}) as r:
        await r.read()
        return r.status, r.headers


async def route_decisions(client, url) -> float:
    async with client.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prefixgate_route_decisions_total{"))


async def test_single_upstream_still_gets_a_decision_and_header(make_standin, make_gateway):
    up = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"prefix_route": {"policy": "cache_aware"}}]})
    async with aiohttp.ClientSession() as client:
        status, headers = await post_chat(client, gw.url)
        assert status == 200
        assert headers["x-prefixgate-upstream"] == "a"
        assert headers["x-prefixgate-route"].startswith("cache_aware; outcome=")
        assert await route_decisions(client, gw.url) == 1


async def test_queued_requests_are_routed_once(make_standin, make_gateway):
    """Requests waiting in admission for ~1 s (five 0.2 s ticks) count one decision each."""
    up = await make_standin(first_delay=0.5)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"prefix_route": {"policy": "chwbl"}},
                                         {"admission": {"max_inflight": 1}}]})
    async with aiohttp.ClientSession() as client:
        results = await asyncio.gather(*(post_chat(client, gw.url, i=i) for i in range(3)))
        assert [s for s, _ in results] == [200] * 3
        assert await route_decisions(client, gw.url) == 3


async def test_round_robin_turns_once_per_request_under_a_queue(make_standin, make_gateway):
    """With every upstream full, queued requests still alternate: the counter advances
    once per request, not on every admission tick."""
    a, b = await make_standin(first_delay=0.45), await make_standin(first_delay=0.45)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": ["round_robin", {"admission": {"per_upstream": 1}}]})
    async with aiohttp.ClientSession() as client:
        results = []
        for i in range(6):           # staggered, so the order of decisions is the order sent
            results.append(asyncio.ensure_future(post_chat(client, gw.url, i=i)))
            await asyncio.sleep(0.03)
        done = await asyncio.gather(*results)
    assert [s for s, _ in done] == [200] * 6
    names = [h["x-prefixgate-upstream"] for _, h in done]
    assert names.count("a") == 3 and names.count("b") == 3
    assert all(names[i] != names[i + 1] for i in range(5)), names


async def test_waiter_keeps_its_upstream_while_another_frees_up(make_standin, make_gateway):
    """A queued request waits for the upstream it was routed to (its cache is there) instead
    of being re-scored onto whichever upstream frees a slot first."""
    a, b = await make_standin(), await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": a.url},
                                           {"name": "b", "url": b.url}],
                             "plugins": [{"prefix_route": {"policy": "chwbl",
                                                           "load_factor": 100}},
                                         {"admission": {"per_upstream": 1}}]})
    body = {"messages": [{"role": "system", "content": "s" * 400},
                         {"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as client:
        _, headers = await post_chat(client, gw.url, **body)
        home = headers["x-prefixgate-upstream"]
        (a if home == "a" else b).behaviour.first_delay = 0.6     # home: busy for long
        (b if home == "a" else a).behaviour.first_delay = 0.1     # the other frees first
        first = asyncio.ensure_future(post_chat(client, gw.url, **body))     # home
        await asyncio.sleep(0.02)
        spill = asyncio.ensure_future(post_chat(client, gw.url, **body))     # home full: other
        await asyncio.sleep(0.02)
        waiter = await post_chat(client, gw.url, **body)     # both full: routed home, waits
        got = [h["x-prefixgate-upstream"] for _, h in (await first, await spill, waiter)]
    assert got[0] == home and got[1] != home
    assert got[2] == home, "the waiter was moved off its home when the other upstream freed"
