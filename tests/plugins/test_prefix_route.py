"""prefix_route through the real gateway and stand-in upstreams on loopback."""
from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections import Counter, defaultdict

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.plugins.prefix_route.plugin import PrefixRoute
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from tests.helpers import FAMILIES, assert_openai_error, body, post


async def fleet(make_standin, make_gateway, n, plugin, names=None, **behaviour):
    standins = [await make_standin(**behaviour) for _ in range(n)]
    names = names or [chr(ord("a") + i) for i in range(n)]
    gw = await make_gateway({"upstreams": [{"name": nm, "url": s.url}
                                           for nm, s in zip(names, standins)],
                             "plugins": [plugin]})
    return standins, gw


def route_key(route: str) -> str:
    """The prefix key a route header names."""
    return re.search(r"key=([0-9a-f]+)", route).group(1)


@pytest.mark.parametrize("policy", ["chwbl", "cache_aware"])
async def test_each_prefix_family_sticks_to_one_upstream(make_standin, make_gateway, policy):
    random.seed(1)
    _, gw = await fleet(make_standin, make_gateway, 4, {"prefix_route": {"policy": policy}})
    seen = defaultdict(set)
    async with aiohttp.ClientSession() as client:
        for turn in range(4):
            for f, system in enumerate(FAMILIES):
                status, up, route = await post(client, gw.url, body(system, f"question {turn}"))
                assert status == 200 and route.startswith(policy)
                seen[f].add(up)
    assert all(len(ups) == 1 for ups in seen.values()), seen
    assert len({next(iter(u)) for u in seen.values()}) >= 2      # families are spread


async def test_round_robin_scatters_the_same_families(make_standin, make_gateway):
    _, gw = await fleet(make_standin, make_gateway, 4, "round_robin")
    seen = defaultdict(set)
    async with aiohttp.ClientSession() as client:
        for turn in range(4):
            for f, system in enumerate(FAMILIES[:3]):   # 3 families, 4 upstreams
                seen[f].add((await post(client, gw.url, body(system, f"q{turn}")))[1])
    assert all(len(ups) == 4 for ups in seen.values())


async def test_cache_aware_follows_a_growing_conversation(make_standin, make_gateway):
    random.seed(2)
    _, gw = await fleet(make_standin, make_gateway, 4, {"prefix_route": {"policy": "cache_aware"}})
    async with aiohttp.ClientSession() as client:
        for s in range(6):
            msgs = [{"role": "system", "content": "Shared preamble. " * 4}]
            ups = []
            for turn in range(4):
                msgs.append({"role": "user", "content": f"session {s} turn {turn}: " + "x" * 200})
                _, up, route = await post(client, gw.url,
                                          {"model": "standin-model", "messages": msgs})
                ups.append(up)
                msgs.append({"role": "assistant", "content": "reply " * 30})
                if turn:
                    matched = int(re.search(r"matched=(\d+)", route).group(1))
                    assert matched > 0 and "outcome=cache" in route
            assert len(set(ups)) == 1, ups


@pytest.mark.parametrize("policy", ["chwbl", "cache_aware"])
async def test_a_hot_prefix_is_spread_within_the_load_bound(make_standin, make_gateway, policy):
    n, burst = 4, 40
    _, gw = await fleet(make_standin, make_gateway, n, {"prefix_route": {"policy": policy}},
                        first_delay=0.6)
    async with aiohttp.ClientSession() as client:
        results = await asyncio.gather(*(post(client, gw.url, body(FAMILIES[0], f"q{i}"))
                                         for i in range(burst)))
    counts = Counter(up for _, up, _ in results)
    assert all(status == 200 for status, _, _ in results)
    # all 40 are in flight together, so the per-upstream count is the peak load
    if policy == "chwbl":
        assert max(counts.values()) <= math.ceil(1.25 * burst / n), counts
    else:   # never more than balance_abs_threshold (4) above the lightest
        assert max(counts.values()) - min(counts.get(u, 0) for u in "abcd") <= 4 + 1, counts
    assert len(counts) >= 3, counts
    # without a bound, affinity alone would have sent all 40 to one upstream
    home = counts.most_common(1)[0][0]
    assert counts[home] < burst


async def test_failover_moves_keys_to_the_next_choice_and_back(make_standin, make_gateway):
    _, gw = await fleet(make_standin, make_gateway, 4, {"prefix_route": {"policy": "chwbl"}})
    by_name = {u.name: u for u in gw.gateway.upstreams}
    async with aiohttp.ClientSession() as client:
        homes = {f: (await post(client, gw.url, body(s, "q")))[1] for f, s in enumerate(FAMILIES)}
        down = homes[0]
        by_name[down].healthy = False          # what the health checker does on failed polls
        during = {f: (await post(client, gw.url, body(s, "q")))[1] for f, s in enumerate(FAMILIES)}
        again = {f: (await post(client, gw.url, body(s, "q")))[1] for f, s in enumerate(FAMILIES)}
        by_name[down].healthy = True
        after = {f: (await post(client, gw.url, body(s, "q")))[1] for f, s in enumerate(FAMILIES)}
    assert down not in during.values()
    assert during == again                              # the detour is itself consistent
    assert all(during[f] == homes[f] for f in homes if homes[f] != down)   # others stay put
    assert after == homes                               # recovered: keys come back


async def test_connection_failure_retries_on_the_next_ring_choice(make_standin, make_gateway):
    standins = [await make_standin() for _ in range(3)]
    names = dict(zip("abc", standins))
    gw = await make_gateway({"upstreams": [{"name": n, "url": s.url} for n, s in names.items()],
                             "plugins": [{"prefix_route": {"policy": "chwbl"}}],
                             "health": {"interval_s": 0.05, "eject_s": 0.1, "timeout_s": 0.5,
                                        "healthy_threshold": 1}})
    by_name = {u.name: u for u in gw.gateway.upstreams}
    async with aiohttp.ClientSession() as client:
        _, home, _ = await post(client, gw.url, body(FAMILIES[3], "q"))
        port = int(names[home].url.rsplit(":", 1)[1])
        await names[home].stop()                       # connections to it are now refused
        status, up, _ = await post(client, gw.url, body(FAMILIES[3], "q"))
        assert status == 200 and up != home
        assert not by_name[home].healthy               # ejected by the health checker
        await names[home].start(port=port)             # back on the same address
        for _ in range(100):                           # active probes bring it back
            if by_name[home].healthy:
                break
            await asyncio.sleep(0.05)
        status, up, _ = await post(client, gw.url, body(FAMILIES[3], "q"))
    assert (status, up) == (200, home)


async def test_two_replicas_make_the_same_chwbl_choices(make_standin, make_gateway):
    standins = [await make_standin() for _ in range(5)]
    ups = [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)]
    plugin = {"prefix_route": {"policy": "chwbl"}}
    one = await make_gateway({"upstreams": ups, "plugins": [plugin]})
    two = await make_gateway({"upstreams": list(reversed(ups)), "plugins": [plugin]})
    rng = random.Random(7)
    stream = [body(f"Tenant {rng.randrange(40)}. " + rng.choice(FAMILIES), f"q{i}")
              for i in range(150)]
    async with aiohttp.ClientSession() as client:
        a = [(await post(client, one.url, b))[1] for b in stream]
        b = [(await post(client, two.url, b))[1] for b in stream]
    agree = sum(x == y for x, y in zip(a, b)) / len(stream)
    assert agree >= 0.99, agree
    assert len(set(a)) == 5                            # and the stream used every upstream


async def test_a_timestamp_does_not_change_the_key_without_normalize(make_standin, make_gateway):
    standins = [await make_standin() for _ in range(2)]
    ups = [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)]
    cut = await make_gateway({"upstreams": ups, "plugins": ["prefix_route"]})
    raw = await make_gateway({"upstreams": ups,
                              "plugins": [{"prefix_route": {"dynamic_cut": "never"}}]})
    async with aiohttp.ClientSession() as client:
        keys_cut, keys_raw = set(), set()
        for second in range(10, 16):
            system = (f"Current time: 2026-03-15 14:22:{second}. You are a support bot for ACME "
                      "with a long preamble. " * 5)
            keys_cut.add(route_key((await post(client, cut.url, body(system, "hi")))[2]))
            keys_raw.add(route_key((await post(client, raw.url, body(system, "hi")))[2]))
    assert len(keys_cut) == 1
    assert len(keys_raw) == 6


async def test_token_ids_key_like_the_engine(make_standin, make_gateway):
    from prefixgate.common.block_hash import block_hash_chain, hash_block
    tokens = list(range(1000, 1000 + 70))
    chain, parent = [], 0
    for i in range(4):
        parent = hash_block(parent, tokens[i * 16:(i + 1) * 16])
        chain.append(parent)
    assert block_hash_chain(tokens, 16) == chain
    standins = [await make_standin() for _ in range(3)]
    gw = await make_gateway({"upstreams": [{"name": f"u{i}", "url": s.url}
                                           for i, s in enumerate(standins)],
                             "plugins": [{"prefix_route": {"prefix_blocks": 4}}]})
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/completions",
                               json={"model": "standin-model", "prompt": tokens}) as r:
            await r.read()
            route = r.headers["x-prefixgate-route"]
    assert f"key={chain[3]:016x}" in route and "blocks=4" in route


async def test_load_polled_from_backend_metrics_moves_a_key(make_standin, make_gateway):
    standins, gw = await fleet(make_standin, make_gateway, 3,
                               {"prefix_route": {"policy": "chwbl", "poll_metrics_s": 0.05}})
    names = dict(zip("abc", standins))
    async with aiohttp.ClientSession() as client:
        _, home, _ = await post(client, gw.url, body(FAMILIES[5], "q"))
        # another gateway replica (here: direct requests) fills the home with slow requests
        slow = body("other", "x", x_standin={"first_delay": 1.5})
        busy = [asyncio.create_task(client.post(names[home].url + "/v1/chat/completions",
                                                json=slow))
                for _ in range(6)]
        await asyncio.sleep(0.4)
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
        load = float(re.search(rf'prefixgate_route_upstream_load{{upstream="{home}"}} (\S+)',
                               text).group(1))
        _, moved, _ = await post(client, gw.url, body(FAMILIES[5], "q"))
        for t in busy:
            (await t).release()
    assert load == 6
    assert moved != home


async def test_a_backend_too_busy_to_answer_its_metrics_in_time_keeps_its_load(
        make_standin, make_gateway):
    """Another replica's requests keep `a` busy, and `a`'s /metrics starts answering later than
    the poll waits (a starved API process). Its last sample stays in use past stale_after_s,
    so `a` keeps its load and this replica's requests go to `b` (before: once the sample was
    stale, `a` counted only this replica's requests, none, and got the next one)."""
    standins = [await make_standin() for _ in "ab"]
    gw = await make_gateway({"upstreams": [{"name": n, "url": s.url}
                                           for n, s in zip("ab", standins)],
                             "plugins": [{"prefix_route": {"poll_metrics_s": 0.05,
                                                           "weight": 0.001}},
                                         {"least_inflight": {}}]})      # the load decides
    poller = next(p for _, p in gw.gateway.plugin_keys if isinstance(p, PrefixRoute)).poller
    a, b = gw.gateway.upstreams
    async with aiohttp.ClientSession() as client:
        slow = body("other", "x", x_standin={"first_delay": 30})
        busy = [asyncio.create_task(client.post(standins[0].url + "/v1/chat/completions",
                                                json=slow)) for _ in range(3)]
        async with asyncio.timeout(10):     # a's three requests seen in a sample
            while (s := poller.samples.get("a")) is None or s.running != 3:
                await asyncio.sleep(0.02)
        standins[0].behaviour.metrics_delay = 30
        await asyncio.sleep(poller.stale_after_s + 0.5)      # past stale, polls timing out
        last = poller.samples["a"]
        assert time.monotonic() - last.t > poller.stale_after_s and last.running == 3
        assert a.load == 3 and b.load == 0
        chosen = [(await post(client, gw.url, body(f"tenant{i}", "q")))[1] for i in range(3)]
        for t in busy:
            t.cancel()
    assert chosen == ["b", "b", "b"], chosen


async def test_route_metrics_are_exported(make_standin, make_gateway):
    _, gw = await fleet(make_standin, make_gateway, 2, {"prefix_route": {"policy": "cache_aware"}})
    async with aiohttp.ClientSession() as client:
        for i in range(3):
            await post(client, gw.url, body(FAMILIES[1], f"q{i}"))
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()

    def value(name):
        return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))

    assert value('prefixgate_route_decisions_total{outcome="new",policy="cache_aware"}') == 1
    assert value('prefixgate_route_decisions_total{outcome="cache",policy="cache_aware"}') == 2
    assert value('prefixgate_route_prefix_blocks_total{kind="matched"}') > 0
    assert sum(float(v) for v in re.findall(r"^prefixgate_route_index_blocks\{.*\} (\S+)$",
                                            text, re.M)) > 0


@pytest.mark.parametrize("cfg, where", [
    ({"policy": "ring"}, "plugins[0].prefix_route.policy"),
    ({"load_factor": 1.0}, "plugins[0].prefix_route.load_factor"),
    ({"block_tokens": 0}, "plugins[0].prefix_route.block_tokens"),
    ({"cache_threshold": 2}, "plugins[0].prefix_route.cache_threshold"),
    ({"bogus": 1}, "plugins[0].prefix_route.bogus"),
])
def test_bad_settings_name_their_key(cfg, where):
    with pytest.raises(ConfigError) as e:
        Gateway(validate({"upstreams": [{"url": "http://127.0.0.1:9"}],
                          "plugins": [{"prefix_route": cfg}]}))
    assert e.value.path == where


async def test_no_healthy_upstream_is_an_openai_error(make_standin, make_gateway):
    _, gw = await fleet(make_standin, make_gateway, 2, "prefix_route")
    for u in gw.gateway.upstreams:
        u.healthy = False
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=body("s", "q")) as r:
            assert_openai_error(await r.json(), 503, r.status)


async def test_llamacpp_slot_affinity(make_standin, make_gateway):
    up = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "llama", "url": up.url}],
                             "plugins": [{"prefix_route": {"llamacpp_slots": 4}}]})
    async with aiohttp.ClientSession() as client:
        for turn in range(3):
            for system in FAMILIES:
                assert (await post(client, gw.url, body(system, f"q{turn}")))[0] == 200
        await post(client, gw.url, body(FAMILIES[0], "q", id_slot=3))   # the client's choice wins
    sent = [r["json"] for r in up.requests]
    slots = defaultdict(set)
    for b in sent[:-1]:
        assert b["cache_prompt"] is True and 0 <= b["id_slot"] < 4
        slots[b["messages"][0]["content"]].add(b["id_slot"])
    assert all(len(s) == 1 for s in slots.values())          # a family keeps its slot
    assert len({next(iter(s)) for s in slots.values()}) > 1  # families use several slots
    assert sent[-1]["id_slot"] == 3 and "cache_prompt" not in sent[-1]


@pytest.mark.parametrize("head_blocks, capacity", [(8, 40), (600, 1500)])
def test_index_matches_a_naive_model_and_stays_prefix_closed(head_blocks, capacity):
    """Short chains, and long ones (the match bisects: it relies on each upstream's blocks
    staying prefix-closed through inserts, evictions and an upstream leaving)."""
    from prefixgate.plugins.prefix_route.prefix_index import PrefixIndex
    rng = random.Random(11)
    index, naive = PrefixIndex(capacity), {}           # naive: name -> its blocks, LRU order
    heads = [[rng.getrandbits(63) for _ in range(head_blocks)] for _ in range(5)]
    for step in range(600):
        name = f"u{rng.randrange(4)}"
        chain = rng.choice(heads)[:rng.randrange(1, head_blocks + 1)] + [
            rng.getrandbits(63) for _ in range(rng.randrange(4))]
        probe = rng.choice(heads)[:rng.randrange(1, head_blocks + 1)]
        want = {}
        for n, blocks in naive.items():
            held = set(blocks)
            k = 0
            while k < len(probe) and probe[k] in held:
                k += 1
            if k:
                want[n] = k
        assert index.match(probe) == want, step
        if step == 300:                                # an upstream leaves
            index.remove("u1")
            naive.pop("u1", None)
            continue
        lru = naive.setdefault(name, {})
        for h in reversed(chain):
            lru.pop(h, None)
            lru[h] = None
        for h in list(lru)[:max(0, len(lru) - capacity)]:
            del lru[h]
        index.insert(name, chain)
    assert all(index.size(n) <= capacity for n in naive)


async def test_with_normalize_first_the_key_is_not_cut(make_standin, make_gateway):
    standins = [await make_standin() for _ in range(2)]
    gw = await make_gateway({"upstreams": [{"name": f"u{i}", "url": s.url}
                                           for i, s in enumerate(standins)],
                             "plugins": ["normalize", "prefix_route"]})
    async with aiohttp.ClientSession() as client:
        keys = set()
        for second in range(10, 14):
            system = (f"Current time: 2026-03-15 14:22:{second}. You are a support bot for ACME "
                      "with a long preamble. " * 5)
            _, _, route = await post(client, gw.url, body(system, "hi"))
            keys.add(route_key(route))
            assert "blocks=0" not in route          # the moved value does not cut the chain
    assert len(keys) == 1


@pytest.mark.parametrize("policy", ["chwbl", "cache_aware"])
async def test_odd_bodies_route_without_errors(make_standin, make_gateway, policy):
    _, gw = await fleet(make_standin, make_gateway, 3, {"prefix_route": {"policy": policy}})
    odd = [
        {"model": "standin-model", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x" * 300},
            {"type": "image_url", "image_url": {"url": "http://img/1.png"}}]}]},
        {"model": "standin-model", "messages": [{"role": "assistant", "content": None,
                                     "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f",
                                                                  "arguments": "{}"}}]},
                                    {"role": "user", "content": "hi"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"model": "standin-model", "messages": [{"role": "user", "content": "short"}]},
        {"model": "standin-model", "prompt": [[5] * 40, [6] * 40]},
        {"model": "standin-model", "prompt": ["p" * 300, "q"]},
        {"model": "standin-model", "prompt": ""},
    ]
    async with aiohttp.ClientSession() as client:
        for payload in odd:
            path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
            async with client.post(gw.url + path, json=payload) as r:
                await r.read()
                assert r.status == 200, (payload, r.status)
                assert r.headers["x-prefixgate-route"].startswith(policy)
