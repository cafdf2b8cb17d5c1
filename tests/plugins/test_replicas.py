"""Three gateway replicas behind a round-robin TCP balancer (tests/helpers.py), sharing nothing
but their config, in front of two bundled engines that publish their KV events over ZMQ, and
two stand-ins for the Responses API (which the bundled engine does not serve), and a vLLM
prefill/decode pair (stand-ins of vLLM's NixlConnector instances). Every request opens a
connection of its own, so consecutive requests reach different replicas; whichever one a
request reaches, exact routing agrees (each replica builds the same index from the engines'
events), a session stays on one engine, a response is followed to its upstream, and a P/D
request's two legs pair up; and three replicas keep one key's requests per minute in one Redis."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from prefixgate.proxy.testing.balancer import TCPBalancer
from prefixgate.proxy.testing.pd_standin import KVStore, VllmDecode, VllmPrefill
from prefixgate.proxy.testing.standin import Behaviour
from tests.helpers import KVEventsEngine, whole_minute_ahead
from tests.plugins.helpers import follow_up, metrics, sample, tenant

BLOCK, KV_BLOCKS = 16, 64
SECRET = "the fleet's response id secret"
PD_MODEL = "pd-model"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    started = [KVEventsEngine(tiny_llama_dir, BLOCK, KV_BLOCKS).__enter__() for _ in range(2)]
    yield started
    for e in started:
        e.__exit__(None, None, None)


@pytest.fixture
async def pd_pair():
    """A vLLM prefill and decode stand-in sharing one KV store: (prefill, decode, store)."""
    kv = KVStore()
    prefill = await VllmPrefill(Behaviour(tokens=1, models=[PD_MODEL]), kv=kv).start()
    decode = await VllmDecode(Behaviour(tokens=4, models=[PD_MODEL]), kv=kv).start()
    yield prefill, decode, kv
    for s in (prefill, decode):
        await s.stop()


def config(engines, standins, pd_pair, model_dir, engine_model: str) -> dict:
    prefill, decode, _ = pd_pair
    return {
        "upstreams": [*({"name": f"e{i}", "url": e.url, "kv_events": e.kv_events}
                        for i, e in enumerate(engines)),
                      *({"name": f"s{i}", "url": s.url} for i, s in enumerate(standins)),
                      {"name": "p0", "url": prefill.url, "role": "prefill"},
                      {"name": "d0", "url": decode.url, "role": "decode"}],
        "pd": {"protocol": "vllm"},
        "models": {engine_model: {"tokenizer": str(model_dir)}},
        "health": {"interval_s": 0.1, "eject_s": 0.2, "healthy_threshold": 1},
        "responses": {"id_secret": SECRET},
        "plugins": [{"prerender": {"block_tokens": BLOCK}},
                    {"prefix_route": {"policy": "cache_aware", "index": "kv_events",
                                      "block_tokens": BLOCK, "kv_events_probe_s": 0.2,
                                      "kv_events_timeout_s": 0.5, "session": {}}}]}


async def until(cond, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached"
        await asyncio.sleep(0.02)


def feeds_of(gw):
    return next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").feeds


async def post(client, url, path, body, headers=None) -> tuple[dict, dict]:
    async with client.post(url + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        return await r.json(), r.headers


async def test_three_replicas_agree_whichever_one_a_request_reaches(
        engines, tiny_llama_dir, make_standin, make_gateway, pd_pair):
    standins = [await make_standin(models=["m"]) for _ in range(2)]
    async with aiohttp.ClientSession() as plain:
        async with plain.get(engines[0].url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        # two tenants cached by the engines directly, past every gateway
        for engine, name in zip(engines, "AB"):
            await post(plain, engine.url, "/v1/chat/completions",
                       {"model": model, "messages": tenant(name), "max_tokens": 1})
    replicas = [await make_gateway(config(engines, standins, pd_pair, tiny_llama_dir, model))
                for _ in range(3)]
    for gw in replicas:
        await until(lambda gw=gw: feeds_of(gw).live == {"e0", "e1"}, what="feeds live")
    balancer = await TCPBalancer([int(gw.url.rsplit(":", 1)[1]) for gw in replicas]).start()
    url = balancer.url
    one_connection_each = aiohttp.TCPConnector(force_close=True)
    try:
        async with aiohttp.ClientSession(connector=one_connection_each) as client:
            for _ in range(3):          # exact routing: each tenant to the engine holding it
                for engine, name in (("e0", "A"), ("e1", "B")):
                    _, h = await post(client, url, "/v1/chat/completions", {
                        "model": model, "messages": follow_up(tenant(name)), "max_tokens": 1})
                    assert h["x-prefixgate-upstream"] == engine
                    assert "outcome=cache" in h["x-prefixgate-route"], h["x-prefixgate-route"]
            homes: dict[str, set] = {}
            for turn in range(3):       # sessions: one engine each, on every replica
                for s in range(8):
                    _, h = await post(client, url, "/v1/chat/completions", {
                        "model": model, "max_tokens": 1,
                        "messages": [{"role": "user", "content": f"session {s} turn {turn}"}]},
                        {"x-session-id": f"agent-{s}"})
                    homes.setdefault(f"agent-{s}", set()).add(h["x-prefixgate-upstream"])
            answer, h = await post(client, url, "/v1/responses", {"model": "m", "input": "hi"})
            owner, last = h["x-prefixgate-upstream"], answer["id"]
            for turn in range(4):       # Responses follow-ups land where the response lives
                answer, h = await post(client, url, "/v1/responses", {
                    "model": "m", "input": f"turn {turn}", "previous_response_id": last})
                assert h["x-prefixgate-upstream"] == owner
                assert answer["previous_response_id"] == last
                last = answer["id"]
            async with client.get(url + f"/v1/responses/{last}") as r:
                assert r.status == 200 and r.headers["x-prefixgate-upstream"] == owner
                assert (await r.json())["id"] == last
            for turn in range(6):       # P/D: the prefill leg's KV reaches the decode leg
                answer, h = await post(client, url, "/v1/chat/completions", {
                    "model": PD_MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": f"pd {turn}"}]})
                assert (h["x-prefixgate-pd"], h["x-prefixgate-prefill-upstream"],
                        h["x-prefixgate-upstream"]) == ("vllm", "p0", "d0")
                assert answer["usage"]["completion_tokens"] == 4
            per_replica = [await metrics(client, gw) for gw in replicas]
    finally:
        await balancer.stop()
    assert all(len(ups) == 1 for ups in homes.values()), homes
    assert {up for ups in homes.values() for up in ups} == {"e0", "e1"}, homes
    # every replica took a share of the requests, and each decided alike
    for m in per_replica:
        assert sample(m, "prefixgate_route_decisions_total", policy="cache_aware",
                      outcome="cache") >= 1
        assert sample(m, "prefixgate_route_sessions_total", outcome="kept") >= 4
    held = json.dumps([s.responses and sorted(s.responses) for s in standins])
    assert last.split("_", 2)[2] in held
    _, decode, kv = pd_pair
    assert len(decode.pulled) == 6 and kv.held == {}    # every transfer made, none left over


async def test_three_replicas_behind_the_balancer_share_one_budget_in_redis(
        make_standin, make_gateway, redis_server):
    standin = await make_standin(tokens=1)
    key = "sk-agent-fleet-0123456789"
    cfg = {"upstreams": [{"name": "a", "url": standin.url}],
           "auth": {"api_keys": [{"key": key, "name": "fleet",
                                  "rate_limit": {"requests_per_minute": 6}}]},
           "rate_limits": {"store": redis_server.url, "store_timeout_ms": 2000}}
    replicas = [await make_gateway(cfg) for _ in range(3)]
    balancer = await TCPBalancer([int(gw.url.rsplit(":", 1)[1]) for gw in replicas]).start()
    whole_minute_ahead()
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as client:
            answers = []
            for _ in range(7):          # each through the next replica
                async with client.post(balancer.url + "/v1/chat/completions", headers={
                        "Authorization": f"Bearer {key}"}, json={
                        "model": "standin-model", "max_tokens": 1,
                        "messages": [{"role": "user", "content": "hi"}]}) as r:
                    answers.append((r.status, r.headers, await r.json()))
    finally:
        await balancer.stop()
    assert [s for s, _, _ in answers] == [200] * 6 + [429]
    assert [h["x-ratelimit-remaining-requests"] for _, h, _ in answers] == \
        ["5", "4", "3", "2", "1", "0", "0"]
    assert answers[-1][2]["error"]["code"] == "rate_limit_exceeded"
