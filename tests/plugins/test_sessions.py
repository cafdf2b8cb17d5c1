"""prefix_route `session:` through real gateways in front of stand-ins: a session's requests
stay on one upstream, two gateway replicas with nothing shared agree on it, an upstream that
leaves moves only its own sessions (which come back with it), and an overloaded upstream
keeps its sessions in `hard` mode and lets them go in `soft` mode."""
from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from tests.plugins.helpers import metrics, sample

MODEL = "standin-model"


async def fleet(make_standin, n: int = 3, **behaviour) -> list:
    return [await make_standin(tokens=1, **behaviour) for _ in range(n)]


def config(standins, policy: str = "cache_aware", **session) -> dict:
    return {"upstreams": [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)],
            "plugins": [{"prefix_route": {"policy": policy, "session": session,
                                          "balance_abs_threshold": 1}}]}


async def send(client, gw, question: str, headers=None, **fields) -> tuple[str, str]:
    """(upstream, route header) of one chat."""
    async with client.post(gw.url + "/v1/chat/completions", headers=headers or {}, json={
            "model": MODEL, "messages": [{"role": "user", "content": question}],
            **fields}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-prefixgate-upstream"], r.headers["x-prefixgate-route"]


def outcome(route: str) -> str:
    return re.search(r"outcome=(\w+)", route).group(1)


def session_of(route: str) -> str | None:
    m = re.search(r"session=(\w+)", route)
    return m and m.group(1)


async def homes(client, gw, sessions, header="x-session-id") -> dict[str, str]:
    """{session: upstream} over one request per session, each a different question."""
    out = {}
    for s in sessions:
        up, route = await send(client, gw, f"question {len(out)} of {s}", {header: s})
        assert outcome(route) == "session" and session_of(route) == "kept", route
        out[s] = up
    return out


@pytest.mark.parametrize("policy", ["chwbl", "cache_aware", "predicted_ttft"])
async def test_a_session_stays_on_one_upstream_and_replicas_agree(make_standin, make_gateway,
                                                                  policy):
    standins = await fleet(make_standin)
    one = await make_gateway(config(standins, policy))
    two = await make_gateway(config(standins, policy))
    sessions = [f"agent-{i}" for i in range(24)]
    async with aiohttp.ClientSession() as client:
        first = await homes(client, one, sessions)
        assert await homes(client, one, sessions) == first       # every turn, same upstream
        assert await homes(client, two, sessions) == first       # ... on any replica
        m = await metrics(client, one)
    assert len(set(first.values())) == 3, first                  # sessions spread over all
    assert sample(m, "prefixgate_route_sessions_total", outcome="kept") == 48
    assert sample(m, "prefixgate_route_decisions_total", policy=policy,
                  outcome="session") == 48


async def test_every_way_of_naming_a_session(make_standin, make_gateway):
    standins = await fleet(make_standin)
    gw = await make_gateway(config(standins, user_field=True, metadata_key="session_id"))
    async with aiohttp.ClientSession() as client:
        by_header = await homes(client, gw, [f"s{i}" for i in range(12)])
        for header in ("X-Dynamo-Session-ID", "x-litellm-session-id"):
            assert await homes(client, gw, list(by_header), header) == by_header
        for s, up in by_header.items():
            assert (await send(client, gw, "q", user=s))[0] == up
            assert (await send(client, gw, "q", metadata={"session_id": s}))[0] == up
        # no session named: the policy routes it, and the header says nothing of sessions
        up, route = await send(client, gw, "a question of no session")
        assert outcome(route) in ("new", "nokey", "cache") and session_of(route) is None
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_route_sessions_total", outcome="kept") == 12 * 5


async def test_an_upstream_that_leaves_moves_only_its_sessions(make_standin, make_gateway):
    standins = await fleet(make_standin, 4)
    gw = await make_gateway(config(standins, mode="hard"))
    sessions = [f"user-{i}" for i in range(40)]
    async with aiohttp.ClientSession() as client:
        before = await homes(client, gw, sessions)
        gone = "u1"
        await gw.gateway.set_upstreams([u.cfg for u in gw.gateway.upstreams if u.name != gone])
        during = await homes(client, gw, sessions)
        await gw.gateway.set_upstreams(validate(config(standins))["upstreams"])
        after = await homes(client, gw, sessions)
    moved = {s for s in sessions if during[s] != before[s]}
    assert moved == {s for s in sessions if before[s] == gone} and moved, (before, during)
    assert after == before


@pytest.mark.parametrize("mode", ["soft", "hard"])
async def test_an_overloaded_upstream_keeps_its_sessions_only_in_hard_mode(
        make_standin, make_gateway, mode):
    standins = await fleet(make_standin, 2, first_delay=0.3)
    gw = await make_gateway(config(standins, mode=mode))
    async with aiohttp.ClientSession() as client:
        routes = await asyncio.gather(*(send(client, gw, f"turn {i}", {"x-session-id": "busy"})
                                        for i in range(8)))
        m = await metrics(client, gw)
    kept = sum(1 for _, r in routes if session_of(r) == "kept")
    if mode == "hard":
        assert kept == 8 and len({up for up, _ in routes}) == 1, routes
    else:       # over the lightest by more than one request: the policy takes the rest
        assert 2 <= kept <= 6 and len({up for up, _ in routes}) == 2, routes
        assert sample(m, "prefixgate_route_sessions_total", outcome="moved") == 8 - kept


@pytest.mark.parametrize("session, error", [
    ({"mode": "sticky"}, "plugins[0].prefix_route.session.mode: must be one of soft, hard"),
    ({"headers": []}, "plugins[0].prefix_route.session.headers: must be a list of header"),
    ({"headers": "x-session-id"}, "plugins[0].prefix_route.session.headers: must be a list"),
    ({"ttl": 5}, "plugins[0].prefix_route.session.ttl: unknown key"),
])
def test_bad_session_settings_fail_at_start_naming_the_key(session, error):
    with pytest.raises(ConfigError) as e:
        Gateway(validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                          "plugins": [{"prefix_route": {"session": session}}]}))
    assert str(e.value).startswith(error), str(e.value)
