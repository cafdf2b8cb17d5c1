"""One attempt to one upstream (proxy/exchange.py): the one retry rule, and a health outcome
classified once per attempt."""
from __future__ import annotations

from types import SimpleNamespace

import aiohttp
import pytest

from prefixgate.proxy import route
from prefixgate.proxy.exchange import may_retry
from tests.helpers import CHAT


def upstream(name, role="both", healthy=True, models=None):
    return SimpleNamespace(name=name, role=role, healthy=healthy,
                           serves=lambda model: models is None or model in models)


def request(**fields):
    return SimpleNamespace(**{"endpoint": SimpleNamespace(replayable=True),
                              "client_has_bytes": False, "model": "m", **fields})


A, B = upstream("a"), upstream("b")
P0, P1 = upstream("p0", role="prefill"), upstream("p1", role="prefill")


@pytest.mark.parametrize("upstreams, tried, ctx, roles, allowed", [
    ([A, B, P0], [A], request(), route.SERVING, True),
    ([A, B, P0], [A, B], request(), route.SERVING, False),          # both tried, retries: 1
    ([A, upstream("b", healthy=False)], [A], request(), route.SERVING, False),
    ([A, upstream("b", models={"other"})], [A], request(), route.SERVING, False),
    ([A, B], [A], request(client_has_bytes=True), route.SERVING, False),
    ([A, B], [A], request(endpoint=SimpleNamespace(replayable=False)), route.SERVING, False),
    ([A, B], [A], request(model=None), route.SERVING, True),
    ([A, P0], [A], request(), route.SERVING, False),                # a prefill takes no plain
    ([A, P0, P1], [P0], request(), route.PREFILL, True),
    ([A, P0], [P0], request(), route.PREFILL, False),
])
def test_one_rule_decides_whether_another_upstream_may_be_tried(upstreams, tried, ctx, roles,
                                                                allowed):
    gw = SimpleNamespace(retries=1, upstreams=upstreams)
    assert may_retry(gw, ctx, tried, roles) is allowed


async def test_streams_broken_in_a_row_eject_their_upstream(make_standin, make_gateway):
    """A stream cut off after its head is one bad answer, not a good one and then a bad one:
    `max_5xx` of them in a row take the upstream out."""
    sick = await make_standin(tokens=8, fail="reset_after", fail_after=2)
    good = await make_standin(tokens=8)
    gw = await make_gateway({"upstreams": [{"name": "sick", "url": sick.url},
                                           {"name": "good", "url": good.url}],
                             "plugins": ["round_robin"],
                             "health": {"interval_s": 0, "max_5xx": 2, "eject_s": 60}})
    async with aiohttp.ClientSession() as client:
        for _ in range(6):
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": True}) as r:
                assert r.status == 200
                await r.read()
    assert len(sick.requests) == 2 and len(good.requests) == 4
    assert not gw.gateway.upstreams[0].healthy
