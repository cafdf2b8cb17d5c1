"""DNS discovery: upstreams join and leave as a hostname's records change (real loopback
servers on 127.0.0.2-4, one shared port, like pods behind a headless Service)."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.testing.standin import Behaviour, StandIn
from tests.helpers import FAMILIES, Answers, body, post


@pytest.fixture
async def pods():
    """Stand-ins on 127.0.0.2, .3, .4, all on the same port."""
    first = await StandIn(Behaviour()).start("127.0.0.2", 0)
    port = int(first.url.rsplit(":", 1)[1])
    started = {"127.0.0.2": first}
    try:
        for ip in ("127.0.0.3", "127.0.0.4"):
            started[ip] = await StandIn(Behaviour()).start(ip, port)
        yield port, started
    finally:
        for s in started.values():
            await s.stop()


async def until(cond, timeout=3.0):
    for _ in range(int(timeout / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def discovered(make_gateway, port, plugins, answers):
    gw = await make_gateway({"discovery": {"dns": "vllm.fleet.invalid", "port": port,
                                           "interval_s": 0.05},
                             "plugins": plugins})
    gw.gateway.discovery.resolver = answers
    return gw


def names(gw):
    return sorted(u.name for u in gw.gateway.upstreams)


async def test_upstreams_follow_the_records(make_gateway, pods):
    port, s = pods
    answers = Answers()
    gw = await discovered(make_gateway, port, ["round_robin"], answers)
    assert names(gw) == []                      # the real lookup of *.invalid failed
    answers.now = ["127.0.0.2", "127.0.0.3"]
    await until(lambda: names(gw) == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"])
    async with aiohttp.ClientSession() as client:
        for _ in range(4):
            assert (await post(client, gw.url, body("s", "q")))[0] == 200
        assert len(s["127.0.0.2"].requests) == len(s["127.0.0.3"].requests) == 2
        answers.now = ["127.0.0.3", "127.0.0.4"]            # .2 leaves, .4 joins
        await until(lambda: names(gw) == [f"127.0.0.3:{port}", f"127.0.0.4:{port}"])
        for _ in range(4):
            assert (await post(client, gw.url, body("s", "q")))[0] == 200
    assert len(s["127.0.0.2"].requests) == 2
    assert (len(s["127.0.0.3"].requests), len(s["127.0.0.4"].requests)) == (4, 2)


async def test_a_failed_or_empty_lookup_keeps_the_last_set(make_gateway, pods):
    port, s = pods
    answers = Answers()
    gw = await discovered(make_gateway, port, ["round_robin"], answers)
    answers.now = ["127.0.0.4"]
    await until(lambda: names(gw) == [f"127.0.0.4:{port}"])
    for failure in (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), []):
        answers.now = failure
        await until(lambda calls=answers.calls: answers.calls >= calls + 3)
        assert names(gw) == [f"127.0.0.4:{port}"]
    async with aiohttp.ClientSession() as client:
        assert (await post(client, gw.url, body("s", "q")))[:2] == (200, f"127.0.0.4:{port}")


async def test_a_joining_upstream_takes_keys_only_for_itself(make_gateway, pods):
    port, s = pods
    answers = Answers()
    gw = await discovered(make_gateway, port, [{"prefix_route": {"policy": "chwbl"}}], answers)
    prompts = [f"Tenant {t}. " + FAMILIES[t % 8] for t in range(30)]
    answers.now = ["127.0.0.2", "127.0.0.3"]
    await until(lambda: len(names(gw)) == 2)
    async with aiohttp.ClientSession() as client:
        before = [(await post(client, gw.url, body(p, "q")))[1] for p in prompts]
        answers.now = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        await until(lambda: len(names(gw)) == 3)
        after = [(await post(client, gw.url, body(p, "q")))[1] for p in prompts]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert moved and all(a == f"127.0.0.4:{port}" for _, a in moved)   # only to the newcomer
    assert len(moved) < len(prompts) * 0.6


async def test_localhost_resolves_for_real(make_gateway, make_standin):
    up = await make_standin()
    port = int(up.url.rsplit(":", 1)[1])
    gw = await make_gateway({"discovery": {"dns": "localhost", "port": port, "family": "ipv4"}})
    assert names(gw) == [f"127.0.0.1:{port}"]
    async with aiohttp.ClientSession() as client:
        assert (await post(client, gw.url, body("s", "q")))[:2] == (200, f"127.0.0.1:{port}")


def test_discovery_config_is_validated():
    cfg = validate({"discovery": {"dns": "svc", "max_inflight": 7, "timeouts": {"idle": 3}}})
    d = cfg["discovery"]
    assert (d["port"], d["scheme"], d["interval_s"], d["max_inflight"]) == (8000, "http", 5.0, 7)
    assert d["timeouts"]["idle"] == 3 and d["timeouts"]["connect"] == 5.0
    for bad, where in (({"dns": "svc", "port": 0}, "discovery.port"),
                       ({"dns": "svc", "family": "ipx"}, "discovery.family"),
                       ({"port": 80}, "discovery.dns"),
                       ({"dns": "svc", "url": "http://x"}, "discovery.url")):
        with pytest.raises(ConfigError) as e:
            validate({"discovery": bad})
        assert e.value.path == where
    with pytest.raises(ConfigError) as e:
        validate({})
    assert e.value.path == "upstreams"
