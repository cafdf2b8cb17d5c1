"""prefix_route `policy: predicted_ttft` through the real gateway, against stand-ins that
prefill one request at a time at a set speed per prompt token (`serial_prefill`): a slower
backend gets less of the uncached work, a saturated cache home spills, an idle one keeps its
tenants, and the learned speeds show in /metrics and the route header."""
from __future__ import annotations

import asyncio
import itertools
import random
import re

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.testing.pd_standin import KVStore, VllmDecode, VllmPrefill
from prefixgate.proxy.testing.standin import Behaviour
from tests.plugins.helpers import metrics, sample

MODEL = "standin-model"
FAST_S = 0.0004                 # a stand-in's seconds per uncached prompt token (2,500/s)
_unique = itertools.count()


def prompt(chars: int) -> str:
    """Text no other prompt starts like (so nothing of it is cached anywhere)."""
    n = next(_unique)
    words = f"request {n} " + " ".join(f"w{n}x{i}" for i in range(chars // 6))
    return words[:chars]


def chat(system: str, user: str) -> dict:
    return {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}


async def send(client, gw, body) -> tuple[str, str]:
    """(upstream, route header) of one streamed chat through the gateway."""
    async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
        await r.read()
        assert r.status == 200
        return r.headers["x-prefixgate-upstream"], r.headers["x-prefixgate-route"]


async def burst(client, gw, bodies) -> list[tuple[str, str]]:
    return await asyncio.gather(*(send(client, gw, b) for b in bodies))


def outcome(route: str) -> str:
    return re.search(r"outcome=(\w+)", route).group(1)


def work(standin) -> int:
    """Prompt tokens it computed (its prefix cache's misses)."""
    return standin.cache.queries - standin.cache.hits


async def serial_standins(make_standin, per_token=(FAST_S, FAST_S)) -> list:
    """Stand-ins a, b that prefill one request at a time, at `per_token` seconds a token."""
    return [await make_standin(tokens=2, prefix_cache=True, serial_prefill=True,
                               prefill_per_token=s) for s in per_token]


async def fleet(make_standin, make_gateway, per_token=(FAST_S, FAST_S), **route):
    standins = await serial_standins(make_standin, per_token)
    return standins, await make_gateway(routed(standins, **route))


def routed(standins, **route) -> dict:
    """A gateway's config: `standins` as upstreams a, b, routed by predicted_ttft."""
    return {"upstreams": [{"name": n, "url": s.url} for n, s in zip("ab", standins)],
            "plugins": [{"prefix_route": {"policy": "predicted_ttft", **route}}]}


async def two_replicas(make_standin, make_gateway, **route):
    """Two gateway replicas sharing nothing, in front of the same two stand-ins, both with
    the stand-ins' speed as their prior."""
    cfg = routed(await serial_standins(make_standin), prior_tokens_per_second=2500, **route)
    return await make_gateway(cfg), await make_gateway(cfg)


async def test_a_backend_half_as_fast_gets_about_half_the_uncached_work(
        make_standin, make_gateway):
    random.seed(4)
    (fast, slow), gw = await fleet(make_standin, make_gateway, (FAST_S, 2 * FAST_S))
    async with aiohttp.ClientSession() as client:
        for _ in range(3):              # warm-up: both answer, both speeds are learned
            await burst(client, gw, [chat(prompt(600), "hi") for _ in range(10)])
        before = work(fast), work(slow)
        for _ in range(4):
            await burst(client, gw, [chat(prompt(600), "hi") for _ in range(10)])
        m = await metrics(client, gw)
    fast_work, slow_work = work(fast) - before[0], work(slow) - before[1]
    assert 0.3 <= slow_work / fast_work <= 0.8, (fast_work, slow_work)
    rate = {n: sample(m, "prefixgate_route_prefill_tokens_per_second", upstream=n, model=MODEL)
            for n in "ab"}
    assert 1.4 <= rate["a"] / rate["b"] <= 2.8, rate


async def test_a_saturated_home_spills_and_an_idle_one_keeps_its_tenants(
        make_standin, make_gateway):
    random.seed(5)
    _, gw = await fleet(make_standin, make_gateway, prior_tokens_per_second=2500)
    tenants = [prompt(2400) for _ in range(3)]
    homes: dict[int, set] = {}
    async with aiohttp.ClientSession() as client:
        for turn in range(3):           # one request at a time: every home is idle
            for i, system in enumerate(tenants):
                up, route = await send(client, gw, chat(system, f"turn {turn}: " + prompt(200)))
                homes.setdefault(i, set()).add(up)
                assert outcome(route) == ("new" if turn == 0 else "home"), route
                assert re.search(r"predicted_ttft_ms=[ab]:[\d.]+,[ab]:[\d.]+", route), route
        assert all(len(ups) == 1 for ups in homes.values()), homes
        # a burst of one tenant with long questions: the home takes it until its queue makes
        # the other upstream, computing the whole prompt, faster beyond the tie; then each
        # spill raises the other's prediction, and the home keeps the next ones. 24 spill
        # more than once at the default tie (1.0: about 11 kept of the first 12)
        home = next(iter(homes[0]))
        routes = await burst(client, gw, [chat(tenants[0], prompt(1200)) for _ in range(24)])
        m = await metrics(client, gw)
    at_home = [up for up, _ in routes if up == home]
    assert 3 <= len(at_home) <= len(routes) - 2, routes
    assert {outcome(r) for up, r in routes if up != home} == {"spill"}, routes
    assert sample(m, "prefixgate_route_decisions_total", policy="predicted_ttft",
                  outcome="spill") == len(routes) - len(at_home)
    assert sample(m, "prefixgate_route_ttft_prediction_error_count", upstream=home) > 0
    for name in "ab":
        assert sample(m, "prefixgate_route_prefill_tokens_per_second", upstream=name,
                      model=MODEL) > 0


async def test_replicas_that_see_different_loads_place_new_prompts_alike_within_the_tie(
        make_standin, make_gateway):
    """Two replicas sharing nothing, one of them with a long prompt in flight to one upstream:
    each new prompt goes to the same upstream from either (the load decides which upstreams
    are in the tie, not the order within it: the tie here takes both)."""
    random.seed(8)
    busy, quiet = await two_replicas(make_standin, make_gateway, tie_ms=60_000)
    async with aiohttp.ClientSession() as client:
        long = asyncio.ensure_future(send(client, busy, chat(prompt(24_000), "long")))
        await asyncio.sleep(0.05)           # on its lane: ~6,000 tokens, 2.4 s of work ahead
        placed = []
        for _ in range(16):
            body = chat(prompt(600), "hi")
            placed.append(((await send(client, busy, body))[0],
                           (await send(client, quiet, body))[0]))
        await long
    assert all(a == b for a, b in placed), placed
    assert {a for a, _ in placed} == {"a", "b"}, placed      # the keys spread over both


def text(tag: str, chars: int) -> str:
    """Fixed text (the same in every run, so are its hashes) that only `tag` starts with."""
    return " ".join(f"{tag}{i}" for i in range(chars // (len(tag) + 3)))[:chars]


async def test_documents_under_a_shared_head_go_where_their_own_part_hashes_from_any_replica(
        make_standin, make_gateway):
    """Two replicas sharing nothing, each knowing a RAG prompt (the shared head) on another
    upstream: a document new to both, asked through either, lands on the upstream its own
    first block hashes to (the head is less than half of the prompt), not on each replica's
    own holder of the head. Before, each sent every document to the head's holder it knew."""
    random.seed(10)
    first, second = await two_replicas(make_standin, make_gateway)
    head = text("rag", 600)                   # ~150 tokens, 6+ text blocks

    def ask(doc: str) -> dict:
        return chat(head, doc + " question: what does it say?")

    async with aiohttp.ClientSession() as client:
        home = (await send(client, first, ask(text("opening", 3000))))[0]  # the head's hash
        # the second replica meets the head while it has a long prompt in flight to that
        # upstream (~0.8 s ahead: beyond the tie), so it puts the head on the other one
        long = asyncio.ensure_future(send(client, second, ask(text("long", 8000))))
        await asyncio.sleep(0.05)
        other = (await send(client, second, ask(text("preamble", 3000))))[0]
        long.cancel()                         # never answered: the replica records nothing
        await asyncio.gather(long, return_exceptions=True)
        assert other != home
        placed = [((await send(client, first, ask(doc)))[0],
                   (await send(client, second, ask(doc)))[0])
                  for doc in (text(f"doc{i}x", 3000) for i in range(8))]
    assert all(a == b for a, b in placed), placed
    assert {a for a, _ in placed} == {"a", "b"}, placed      # the documents spread over both


async def test_prompts_that_never_come_again_go_to_the_fastest_not_to_the_hash(
        make_standin, make_gateway):
    """Where no prompt is seen twice (vLLM's `random` dataset) placing alike buys nothing:
    the tie shrinks with the share of prompts held somewhere, and each burst of unique
    prompts alternates between two equal upstreams as their queues grow, instead of
    following the prompts' hashes within the tie (which let one take 14 of 24)."""
    random.seed(9)
    _, gw = await fleet(make_standin, make_gateway, prior_tokens_per_second=2500)
    async with aiohttp.ClientSession() as client:
        for _ in range(8):              # the share of prompts held falls to ~0, and both
            await burst(client, gw, [chat(prompt(1200), "hi") for _ in range(4)])  # answer
        splits = []             # (a prompt's ~120 ms prefill: every burst is routed before
        for _ in range(4):      # the first answer comes)
            ups = [up for up, _ in await burst(client, gw,
                                               [chat(prompt(1200), "hi") for _ in range(24)])]
            splits.append(ups.count("a"))
    assert sum(abs(a - 12) for a in splits) <= 2, splits


async def test_the_prefill_upstream_of_a_pd_pair_is_the_one_predicted_first(make_gateway):
    random.seed(6)
    kv = KVStore()
    prefills = [await VllmPrefill(Behaviour(tokens=1, prefix_cache=True, serial_prefill=True,
                                            prefill_per_token=s), kv=kv).start()
                for s in (FAST_S, 2 * FAST_S)]
    decode = await VllmDecode(Behaviour(tokens=2), kv=kv).start()
    try:
        gw = await make_gateway({
            "upstreams": [{"name": "p0", "url": prefills[0].url, "role": "prefill"},
                          {"name": "p1", "url": prefills[1].url, "role": "prefill"},
                          {"name": "d0", "url": decode.url, "role": "decode"}],
            "pd": {"protocol": "vllm"},
            "plugins": [{"prefix_route": {"policy": "predicted_ttft"}}]})
        async with aiohttp.ClientSession() as client:
            for _ in range(3):
                await burst(client, gw, [chat(prompt(600), "hi") for _ in range(10)])
            before = [work(p) for p in prefills]
            for _ in range(3):
                await burst(client, gw, [chat(prompt(600), "hi") for _ in range(10)])
    finally:
        for s in (*prefills, decode):
            await s.stop()
    fast_work, slow_work = (work(p) - b for p, b in zip(prefills, before))
    assert 0.3 <= slow_work / fast_work <= 0.8, (fast_work, slow_work)


@pytest.mark.parametrize("route, error", [
    ({"policy": "predicted"}, "plugins[0].prefix_route.policy: must be one of chwbl, "
                              "cache_aware, predicted_ttft"),
    ({"tie_fraction": -0.1}, "plugins[0].prefix_route.tie_fraction: must be >= 0"),
    ({"tie_ms": "10"}, "plugins[0].prefix_route.tie_ms: must be"),
    ({"prior_tokens_per_second": 0}, "plugins[0].prefix_route.prior_tokens_per_second: "
                                     "must be > 0"),
    ({"prior_overhead_ms": -1}, "plugins[0].prefix_route.prior_overhead_ms: must be >= 0"),
    ({"fit_half_life_s": 0}, "plugins[0].prefix_route.fit_half_life_s: must be > 0"),
])
def test_bad_settings_fail_at_start_naming_the_key(route, error):
    with pytest.raises(ConfigError) as e:
        Gateway(validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                          "plugins": [{"prefix_route": {"policy": "predicted_ttft", **route}}]}))
    assert str(e.value).startswith(error), str(e.value)
