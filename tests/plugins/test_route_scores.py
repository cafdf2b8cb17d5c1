"""Every prefix_route policy scores every candidate (DESIGN.md §2), so that a `weight:` mixes it
with a load scorer: the policy's choice gets the top score (alone in the chain, the gateway
picks what the policy chose), the others rank below it by the policy's measure; a kept
session adds its bonus. Through real gateways in front of stand-ins: a load scorer of equal
weight leaves the policy's choice alone, one weighted to say so moves the request off a busy
home."""
from __future__ import annotations

import asyncio
import json
import random
import re

import aiohttp
import pytest

from prefixgate.plugins.balance import LeastInflight
from prefixgate.plugins.prefix_route.plugin import SPEC, PrefixRoute
from prefixgate.plugins.prefix_route.predicted_ttft import STATE_KEY as PREDICTED
from prefixgate.plugins.prefix_route.scorer import BELOW_TOP, SESSION_BONUS
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.context import RequestContext
from tests.helpers import FAMILIES, body, post

POLICIES = ["chwbl", "cache_aware", "predicted_ttft"]


def gateway(plugins: list, n: int = 6) -> Gateway:
    return Gateway(validate({"upstreams": [{"name": f"u{i}", "url": f"http://127.0.0.1:{9 + i}",
                                            "max_inflight": 64} for i in range(n)],
                             "plugins": plugins}))


def prefix_route(gw: Gateway) -> PrefixRoute:
    return next(p for p in gw.chain.plugins if isinstance(p, PrefixRoute))


def request(system: str, user: str = "a question", headers=None) -> RequestContext:
    payload = body(system, user)
    return RequestContext(request_id="", path="/v1/chat/completions", body=payload,
                          headers=headers or {}, raw_body=json.dumps(payload).encode(),
                          model=payload["model"])


def top(scores: dict):
    """The one candidate with the best score (asserting it is alone there)."""
    best = max(scores.values())
    [up] = [u for u, s in scores.items() if s == best]
    return up


# --- scores for every candidate ---------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("system", [FAMILIES[0], ""], ids=["long", "short"])
def test_every_policy_scores_every_candidate_and_its_choice_on_top(policy, system):
    gw = gateway([{"prefix_route": {"policy": policy}}])
    plugin = prefix_route(gw)
    ups = gw.upstreams
    for u, load in zip(ups, [3, 0, 5, 1, 4, 2]):
        u.inflight = load
    plugin.record(request(FAMILIES[0], "before"), ups[3])   # a cache home (cache_aware, ...)
    ctx = request(system)
    random.seed(7)             # predicted_ttft: one of equal predictions at random
    scores = plugin.score(ctx, ups)
    assert set(scores) == set(ups), scores
    assert all(isinstance(s, float) for s in scores.values())
    chosen = top(scores)
    assert all(s < scores[chosen] for u, s in scores.items() if u is not chosen)
    assert ctx.response_headers["x-prefixgate-route"].startswith(policy)
    # alone in the chain, the gateway picks the policy's choice
    again = request(system)
    if policy == "predicted_ttft":      # its queue remembers the first: a fresh gateway
        gw = gateway([{"prefix_route": {"policy": policy}}])
        for u, load in zip(gw.upstreams, [3, 0, 5, 1, 4, 2]):
            u.inflight = load
        prefix_route(gw).record(request(FAMILIES[0], "before"), gw.upstreams[3])
    random.seed(7)
    assert gw.decide(again).name == chosen.name


def test_chwbl_scores_the_ring_order_with_the_home_over_its_bound_last():
    gw = gateway([{"prefix_route": {"policy": "chwbl"}}])
    plugin, ups = prefix_route(gw), gw.upstreams
    ctx = request(FAMILIES[1])
    scores = plugin.score(ctx, ups)
    assert sorted(scores.values(), reverse=True) == [1 / r for r in range(1, 7)]
    home = top(scores)
    assert ctx.route_info["home"] == home.name and ctx.route_info["outcome"] == "home"
    runner_up = max((u for u in ups if u is not home), key=scores.get)
    home.inflight = 10          # over 1.25 x (10 + 1) / 6 = 2.3: the key spills to the next
    ctx = request(FAMILIES[1])
    spilled = plugin.score(ctx, ups)
    assert top(spilled) is runner_up and ctx.route_info["outcome"] == "spill"
    assert spilled[home] == min(spilled.values()) == 1 / 6
    # the others keep their order on the ring
    rest = [u for u in sorted(ups, key=scores.get, reverse=True) if u is not home]
    assert sorted(rest, key=spilled.get, reverse=True) == rest


def test_cache_aware_scores_the_match_and_the_lighter_of_equal_matches_wins():
    gw = gateway([{"prefix_route": {"policy": "cache_aware"}}])
    plugin, ups = prefix_route(gw), gw.upstreams
    ups[1].inflight, ups[4].inflight = 2, 1
    for u in (ups[1], ups[4]):
        plugin.record(request(FAMILIES[2], "before"), u)
    ctx = request(FAMILIES[2])
    scores = plugin.score(ctx, ups)
    n, matched = ctx.route_info["blocks"], ctx.route_info["best_match"]
    assert top(scores) is ups[4] and ctx.route_info["outcome"] == "cache"
    assert scores[ups[4]] == pytest.approx(matched / n) and scores[ups[1]] < scores[ups[4]]
    assert all(abs(scores[u]) < 1e-6 for u in ups if u not in (ups[1], ups[4]))


def test_predicted_ttft_scores_the_ratio_of_predictions_with_the_tie_on_the_home():
    gw = gateway([{"prefix_route": {"policy": "predicted_ttft"}}], n=3)
    plugin, ups = prefix_route(gw), gw.upstreams
    plugin.record(request(FAMILIES[3], "before"), ups[2])
    ctx = request(FAMILIES[3])
    scores = plugin.score(ctx, ups)
    assert top(scores) is ups[2] and scores[ups[2]] == 1.0
    assert ctx.route_info["outcome"] == "home"
    times = dict(re.findall(r"(u\d):([\d.]+)", ctx.route_info["predicted_ttft_ms"]))
    home_t, other_t = float(times["u2"]), float(next(t for n, t in times.items() if n != "u2"))
    # the defaults' tie: tie_ms, or tie_fraction x the best (the home's)
    tie = max(SPEC["tie_ms"].default, SPEC["tie_fraction"].default * home_t)
    expected = home_t * home_t / (home_t + tie) / other_t
    assert scores[ups[0]] == scores[ups[1]] == pytest.approx(expected, rel=0.02)
    assert 0 < expected < BELOW_TOP


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_a_kept_session_adds_its_bonus_to_the_policys_scores(policy, mode):
    gw = gateway([{"prefix_route": {"policy": policy, "session": {"mode": mode}}}])
    plugin, ups = prefix_route(gw), gw.upstreams
    plugin.record(request(FAMILIES[4], "before"), ups[0])
    ctx = request(FAMILIES[4], headers={"x-session-id": "agent-7"})
    scores = plugin.score(ctx, ups)
    assert set(scores) == set(ups)
    assert ctx.route_info["outcome"] == "session" and ctx.route_info["session"] == "kept"
    home = top(scores)
    assert SESSION_BONUS <= scores[home] <= SESSION_BONUS + 1
    assert all(0 <= s <= 1 for u, s in scores.items() if u is not home)
    if policy == "chwbl":       # stateless: the others score what they score without it
        plain = plugin.score(request(FAMILIES[4]), ups)
        assert {u: s for u, s in scores.items() if u is not home} == {
            u: s for u, s in plain.items() if u is not home}
        assert scores[home] == plain[home] + SESSION_BONUS


def test_predicted_ttft_moves_a_request_to_the_lane_of_the_upstream_it_went_to():
    gw = gateway([{"prefix_route": {"policy": "predicted_ttft"}},
                  {"least_inflight": {"weight": 100}}], n=2)
    plugin, ups = prefix_route(gw), gw.upstreams
    plugin.record(request(FAMILIES[5], "before"), ups[0])
    ups[0].inflight = 30                       # the cache home is busy (in this gateway's view)
    ctx = request(FAMILIES[5])
    ctx.upstream = gw.decide(ctx)
    assert ctx.upstream is ups[1] and ctx.route_info["outcome"] == "home"   # policy: the home
    queue, routed = plugin.predicted.queue, ctx.state[PREDICTED]
    assert routed.name == "u0" and list(queue.lane("u0").pending) == [routed.key]   # as chosen
    assert not queue.lane("u1").pending
    gw.decide(request(FAMILIES[6]))            # the next decision settles it
    assert routed.name == "u1" and routed.key in queue.lane("u1").pending
    assert routed.moved          # predicted for u1 there, it teaches nothing (not its choice)
    assert routed.key not in queue.lane("u0").pending


# --- mixed with a load scorer, through the gateway ----------------------------------------------

async def busy_home(make_standin, make_gateway, plugins: list, system: str, headers=None):
    """Two stand-ins, one request of `system` held in flight at its home: (home, the upstream
    of the next request of `system`, its route header)."""
    standins = [await make_standin(tokens=1, first_delay=0.5) for _ in range(2)]
    gw = await make_gateway({"upstreams": [{"name": n, "url": s.url, "max_inflight": 4}
                                           for n, s in zip("ab", standins)],
                             "plugins": plugins})
    by_name = {u.name: u for u in gw.gateway.upstreams}
    async with aiohttp.ClientSession() as client:
        status, home, _ = await post(client, gw.url, body(system, "the first turn"), headers)
        assert status == 200
        held = asyncio.create_task(post(client, gw.url, body(system, "held"), headers))
        for _ in range(200):
            if by_name[home].inflight:
                break
            await asyncio.sleep(0.005)
        assert by_name[home].inflight == 1, "the held request did not go home"
        status, up, route = await post(client, gw.url, body(system, "the next turn"), headers)
        assert status == 200 and (await held)[1] == home
    return home, up, route


HOME_OUTCOME = {"chwbl": "home", "cache_aware": "cache", "predicted_ttft": "home"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("weight", [None, 1.0, 8.0])
async def test_a_weighted_load_scorer_moves_a_request_off_a_busy_home(make_standin, make_gateway,
                                                                      policy, weight):
    plugins = [{"prefix_route": {"policy": policy}}]
    if weight is not None:
        plugins.append({"least_inflight": {"weight": weight}})
    home, up, route = await busy_home(make_standin, make_gateway, plugins, FAMILIES[7])
    # the policy itself would keep it home (its one in flight there is no reason to move)
    assert re.search(r"outcome=(\w+)", route).group(1) == HOME_OUTCOME[policy], route
    if weight == 8.0:       # 8 x 1/4 of max_inflight outweighs the policy's whole range
        assert up != home, route
    else:                   # alone, or beside a load scorer of equal weight: as the policy
        assert up == home, route


@pytest.mark.parametrize("weight, moved", [(1.0, False), (20.0, True)])
async def test_a_session_outweighs_a_load_scorer_of_equal_weight(make_standin, make_gateway,
                                                                 weight, moved):
    plugins = [{"prefix_route": {"policy": "chwbl", "session": {"mode": "hard"}}},
               {"least_inflight": {"weight": weight}}]
    home, up, route = await busy_home(make_standin, make_gateway, plugins, FAMILIES[6],
                                      {"x-session-id": "agent-1"})
    assert "outcome=session" in route and "session=kept" in route, route
    assert (up != home) is moved, (home, up, route)


def test_least_inflight_is_the_load_scorer_these_tests_mix():
    gw = gateway(["least_inflight"], n=2)
    gw.upstreams[0].inflight = 16
    scores = next(p for p in gw.chain.plugins if isinstance(p, LeastInflight)).score(
        None, gw.upstreams)
    assert scores == {gw.upstreams[0]: 0.75, gw.upstreams[1]: 1.0}
