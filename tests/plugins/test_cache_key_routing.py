"""A request's own affinity key routes it, with no configuration: OpenAI's `prompt_cache_key`
(chat, completions, Responses), Claude Code's `metadata.user_id` session on `/v1/messages` and
its `x-claude-code-session-id` header, Codex's `session-id` header. Three gateway replicas
behind a round-robin balancer, sharing nothing, send one key's requests to one upstream and
spread different keys; a saturated home lets its keys go and takes them back; the route header
(and the access log's `route`) names the key's source and a short hash, never the key;
`session: {mode: off}` and `prompt_cache_key: false` turn it off."""
from __future__ import annotations

import asyncio
import json
import re
import uuid

import aiohttp

from prefixgate.proxy.testing.balancer import TCPBalancer
from tests.plugins.helpers import metrics, sample

MODEL = "standin-model"
SYSTEM = "You are a coding agent working in a large repository. " * 8


def config(standins, **prefix_route) -> dict:
    return {"upstreams": [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)],
            "plugins": [{"prefix_route": prefix_route}]}


def chat(question: str, **fields) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, **fields, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


def messages(question: str, **fields) -> tuple[str, dict]:
    return "/v1/messages", {"model": MODEL, "max_tokens": 1, "system": SYSTEM, **fields,
                            "messages": [{"role": "user", "content": question}]}


def claude_code_user_id(session: str) -> str:
    return f"user_{'ab' * 32}_account_{uuid.UUID(int=7)}_session_{session}"


async def send(client, url: str, request: tuple[str, dict], headers=None) -> tuple[str, str]:
    """(upstream, route header) of one request."""
    path, body = request
    async with client.post(url + path, json=body, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-prefixgate-upstream"], r.headers["x-prefixgate-route"]


def session_of(route: str) -> str | None:
    m = re.search(r"session=(\w+); session_key=([\w.:-]+)", route)
    return m and m.group(1)


async def test_one_key_one_upstream_across_three_replicas(make_standin, make_gateway,
                                                         tmp_path):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    logs = [tmp_path / f"access{i}.log" for i in range(3)]
    replicas = [await make_gateway({**config(standins, policy=policy),
                                    "access_log": {"path": str(log)}})
                for policy, log in zip(("chwbl", "cache_aware", "predicted_ttft"), logs)]
    balancer = await TCPBalancer([int(gw.url.rsplit(":", 1)[1]) for gw in replicas]).start()
    keys = [str(uuid.UUID(int=i)) for i in range(12)]
    homes: dict[str, set] = {}
    routes = []
    try:
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as client:
            for turn in range(3):       # every request reaches the next replica
                for key in keys:        # the same system prompt: only the key tells them apart
                    for request, headers in (
                            (chat(f"{key} turn {turn}", prompt_cache_key=key), None),
                            (("/v1/completions", {"model": MODEL, "max_tokens": 1,
                                                  "prompt": f"{SYSTEM} {turn}",
                                                  "prompt_cache_key": key}), None),
                            (chat(f"{key} turn {turn}"), {"session-id": key}),      # Codex
                            (messages(f"{key} turn {turn}"),
                             {"x-claude-code-session-id": key}),                   # Claude Code
                            (messages(f"{key} turn {turn}",
                                      metadata={"user_id": claude_code_user_id(key)}), None)):
                        up, route = await send(client, balancer.url, request, headers)
                        homes.setdefault(key, set()).add(up)
                        routes.append(route)
            per_replica = [await metrics(client, gw) for gw in replicas]
    finally:
        await balancer.stop()
    assert all(len(ups) == 1 for ups in homes.values()), homes
    assert {up for ups in homes.values() for up in ups} == {"u0", "u1", "u2"}, homes
    assert all(session_of(r) == "kept" for r in routes), routes
    sources = {re.search(r"session_key=([\w.-]+):", r).group(1) for r in routes}
    assert sources == {"prompt_cache_key", "session-id", "x-claude-code-session-id",
                       "metadata.user_id"}
    assert not any(key in r for r in routes for key in keys)        # a hash, not the key
    for m in per_replica:       # every replica decided some of them, and held them all
        assert sample(m, "prefixgate_route_sessions_total", outcome="kept") >= 10
        assert sample(m, "prefixgate_route_sessions_total", outcome="moved") == 0
    for _ in range(200):        # the access log is written by a thread of its own
        logged = [r for log in logs if log.exists() for line in log.read_text().splitlines()
                  if (r := json.loads(line)["route"]) is not None]    # (not /metrics)
        if len(logged) >= len(routes):
            break
        await asyncio.sleep(0.02)
    assert sorted(logged) == sorted(routes)


async def test_a_saturated_home_lets_its_key_go_and_takes_it_back(make_standin, make_gateway):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    gw = await make_gateway(config(standins, poll_metrics_s=0.05))
    poller = next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").poller
    request = messages("continue", metadata={"user_id": json.dumps(   # Claude Code's newer form
        {"device_id": "d" * 64, "account_uuid": "", "session_id": "s-1"})})

    async def polled(name: str, usage: float):
        for _ in range(200):
            sample_ = poller.samples.get(name)
            if sample_ is not None and sample_.kv_usage == usage:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{name} never polled at {usage}")

    async with aiohttp.ClientSession() as client:
        home, route = await send(client, gw.url, request)
        assert session_of(route) == "kept" and "session_key=metadata.user_id:" in route
        standin = standins[int(home[1:])]
        standin.behaviour.kv_usage = 0.99
        await polled(home, 0.99)
        moved = {await send(client, gw.url, request) for _ in range(4)}
        assert all(up != home and session_of(r) == "moved" for up, r in moved), moved
        standin.behaviour.kv_usage = 0.1
        await polled(home, 0.1)
        assert await send(client, gw.url, request) == (home, route)
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_route_sessions_total", outcome="moved") == 4


async def test_keys_can_be_turned_off(make_standin, make_gateway):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    off = await make_gateway(config(standins, session={"mode": "off"}))
    no_cache_key = await make_gateway(config(standins, session={"prompt_cache_key": False}))
    async with aiohttp.ClientSession() as client:
        for gw in (off, no_cache_key):
            _, route = await send(client, gw.url, chat("q", prompt_cache_key="k"))
            assert "session=" not in route, route
        # headers still name sessions unless the mode is off
        _, route = await send(client, no_cache_key.url, chat("q"), {"session-id": "k"})
        assert session_of(route) == "kept"
        _, route = await send(client, off.url, chat("q"), {"session-id": "k"})
        assert "session=" not in route
