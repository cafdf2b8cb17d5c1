"""prefix_route `index: kv_events`: the gateway subscribes to each upstream's KV event publisher
(vLLM's ZMQ wire format, proxy/testing/kv_events_standin.py) over real loopback sockets, with
stand-in HTTP upstreams behind a real gateway and real clients."""
from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.testing.kv_events_standin import EngineCache, KVEventsStandIn
from prefixgate.proxy.testing.standin import Behaviour, StandIn
from tests.helpers import Answers
from tests.plugins.helpers import blocks, follow_up, metrics, route, sample, tenant, until, up

ROUTE = {"policy": "cache_aware", "index": "kv_events", "kv_events_probe_s": 0.2,
         "kv_events_timeout_s": 0.3}


@pytest.fixture(scope="module")
def tokens(chatml_dir):
    """The prompt's token ids as an engine makes them (chat template, then encode)."""
    tok = Tokenizer.from_dir(chatml_dir)
    return lambda messages: tok.encode(tok.apply_chat_template(messages))


@pytest.fixture
async def publishers():
    started = []

    async def factory(**kw) -> KVEventsStandIn:
        p = await KVEventsStandIn(**kw).start()
        started.append(p)
        return p
    yield factory
    for p in started:
        await p.stop()


@pytest.fixture
async def fleet(make_standin, make_gateway, publishers, chatml_dir):
    """`await fleet(a=publisher, b=publisher, ...)`: stand-in upstreams named by the keywords,
    each with that publisher as its `kv_events`, behind a gateway with `index: kv_events`."""
    async def factory(route=None, **pubs):
        ups = [{"name": name, "url": (await make_standin()).url, "kv_events": p.kv_events}
               for name, p in pubs.items()]
        raw = {"upstreams": ups, "model": {"tokenizer": str(chatml_dir)},
               "plugins": [{"prerender": {}}, {"prefix_route": {**ROUTE, **(route or {})}}]}
        gw = await make_gateway(raw)
        gw.raw = raw
        return gw
    return factory


def n_blocks(ids) -> int:
    return len(ids) // 16


# --- tests ------------------------------------------------------------------------------------

async def test_a_follow_up_goes_where_the_events_say_its_prefix_is(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    A, B = tokens(tenant("A")), tokens(tenant("B"))
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pb.publish(*EngineCache().store(A))       # the gateway never sent A (or B) anywhere
        await pa.publish(*EngineCache().store(B))
        await until(client, gw, lambda m: blocks(m, "b") == n_blocks(A) and
                    blocks(m, "a") == n_blocks(B))
        assert await route(client, gw, follow_up(tenant("A"))) == ("b", "cache")
        assert await route(client, gw, follow_up(tenant("B"))) == ("a", "cache")
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_route_kv_events_received_total", upstream="b",
                  kind="events") == 1
    assert sample(m, "prefixgate_route_kv_events_replays_total", upstream="b", reason="start") == 1


async def test_block_removed_stops_the_preference(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    A = tokens(tenant("A"))
    cache_a, cache_b = EngineCache(), EngineCache()
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pb.publish(*cache_b.store(A))
        await until(client, gw, lambda m: blocks(m, "b") == n_blocks(A))
        assert await route(client, gw, tenant("A")) == ("b", "cache")
        await pb.publish(*cache_b.evict(A))              # b's cache dropped A
        await until(client, gw, lambda m: blocks(m, "b") == 0)
        # the gateway sent A to b a moment ago, but b's own events are the truth
        assert (await route(client, gw, tenant("A")))[1] == "new"
        await pa.publish(*cache_a.store(A))
        await until(client, gw, lambda m: blocks(m, "a") == n_blocks(A))
        assert await route(client, gw, follow_up(tenant("A"))) == ("a", "cache")


# vLLM 0.32's events (maps) and replay framing (topic first), and those of the vLLM before it
ERAS = {"vllm-0.32": ("map", True), "before-0.32": ("array", False)}


@pytest.mark.parametrize("era", ERAS)
async def test_a_gateway_started_after_the_traffic_catches_up_by_replay(fleet, publishers,
                                                                        tokens, era):
    layout, replay_topic = ERAS[era]
    pa = await publishers(replay_topic=replay_topic)
    pb = await publishers(replay_topic=replay_topic)
    A, B, C = (tokens(tenant(t)) for t in "ABC")
    cache_a = EngineCache(layout=layout)
    await pb.publish(*EngineCache(layout=layout).store(A))
    await pa.publish(*cache_a.store(B))
    for i in range(30):                                  # a long history to replay, slowly,
        await pa.publish(*cache_a.store(tokens(tenant(f"filler {i}"))))
    pa.replay_gap_s = 0.01                               # so live batches arrive during it
    gw = await fleet(a=pa, b=pb)
    async with aiohttp.ClientSession() as client:
        deadline = time.monotonic() + 5
        while not pa.replays:                            # the replay has started ...
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)
        await pa.publish(*cache_a.store(C))              # ... and C comes live meanwhile
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        for t, where in (("A", "b"), ("B", "a"), ("C", "a")):
            assert await route(client, gw, follow_up(tenant(t))) == (where, "cache"), t
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_route_kv_events_received_total", upstream="a",
                  kind="batches") == 32                  # each once: C live or replayed, not both
    assert sample(m, "prefixgate_route_kv_events_resyncs_total", upstream="a",
                  reason="restart") == 0


async def test_a_gap_in_sequence_numbers_is_filled_by_a_replay(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    A, D = tokens(tenant("A")), tokens(tenant("D"))
    cache_b = EngineCache()
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pb.publish(*cache_b.store(A), live=False)   # the gateway misses this one
        await pb.publish(*cache_b.store(D))
        m = await until(client, gw, lambda m: blocks(m, "b") == len(cache_b.held))
        assert await route(client, gw, follow_up(tenant("A"))) == ("b", "cache")
    assert sample(m, "prefixgate_route_kv_events_gaps_total", upstream="b") == 1
    assert sample(m, "prefixgate_route_kv_events_replays_total", upstream="b", reason="gap") == 1
    assert sample(m, "prefixgate_route_kv_events_resyncs_total", upstream="b", reason="gap") == 0


async def test_a_gap_the_replay_cannot_fill_clears_and_rebuilds(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers(buffer_steps=4)
    gw = await fleet(a=pa, b=pb)
    A, B = tokens(tenant("A")), tokens(tenant("B"))
    cache_b = EngineCache()
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pb.publish(*cache_b.store(A))
        await until(client, gw, lambda m: blocks(m, "b") == n_blocks(A))
        # b evicts A, and more batches than its buffer holds go by unseen
        await pb.publish(*cache_b.evict(A), live=False)
        for _ in range(4):
            await pb.publish(live=False)
        await pb.publish(*cache_b.store(B))
        await until(client, gw, lambda m: sample(
            m, "prefixgate_route_kv_events_resyncs_total", upstream="b", reason="gap") == 1
            and up(m, "b") and blocks(m, "b") == n_blocks(B))
        assert await route(client, gw, follow_up(tenant("B"))) == ("b", "cache")
        assert (await route(client, gw, follow_up(tenant("A"))))[1] == "new"   # A was cleared


async def test_a_publisher_restart_clears_its_blocks(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    B = tokens(tenant("B"))
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        cache_b = EngineCache()
        for t in ("A", "filler 1", "filler 2"):
            await pb.publish(*cache_b.store(tokens(tenant(t))))
        await until(client, gw, lambda m: sample(
            m, "prefixgate_route_kv_events_received_total", upstream="b", kind="batches") == 3)
        assert await route(client, gw, tenant("A")) == ("b", "cache")
        await pb.restart()                               # a new engine: empty cache, seq 0
        await pb.publish(*EngineCache().store(B))
        await until(client, gw, lambda m: sample(
            m, "prefixgate_route_kv_events_resyncs_total", upstream="b", reason="restart") == 1
            and up(m, "b") and blocks(m, "b") == n_blocks(B))
        assert await route(client, gw, follow_up(tenant("B"))) == ("b", "cache")
        assert (await route(client, gw, follow_up(tenant("A"))))[1] == "new"


async def test_a_dead_publisher_falls_back_to_the_approximate_index(fleet, publishers, tokens):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    A, B, E = (tokens(tenant(t)) for t in "ABE")
    cache_a = EngineCache()
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pa.publish(*cache_a.store(B), *cache_a.store(E))
        await pb.publish(*EngineCache().store(A))
        await until(client, gw, lambda m: blocks(m, "a") == len(cache_a.held)
                    and blocks(m, "b") == n_blocks(A))
        assert await route(client, gw, tenant("B")) == ("a", "cache")   # the gateway saw that
        await pa.stop()
        await until(client, gw, lambda m: not up(m, "a") and up(m, "b"))
        assert await route(client, gw, follow_up(tenant("B"))) == ("a", "cache")  # approximate
        # only a's events knew E
        assert (await route(client, gw, follow_up(tenant("E"))))[1] == "new"
        assert await route(client, gw, follow_up(tenant("A"))) == ("b", "cache")  # b: still exact


async def test_a_silent_publisher_is_probed_down_and_back(fleet, publishers):
    pa, pb = await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        pa.answer_replays = False                        # connected, but hung
        await until(client, gw, lambda m: not up(m, "a") and up(m, "b"))
        pa.answer_replays = True
        m = await until(client, gw, lambda m: up(m, "a"))
    assert sample(m, "prefixgate_route_kv_events_replays_total", upstream="b", reason="probe") >= 1
    assert sample(m, "prefixgate_route_kv_events_resyncs_total", upstream="a",
                  reason="restart") == 0


async def test_a_reload_follows_moved_and_removed_publishers(fleet, publishers, tokens):
    pa, pb, moved = await publishers(), await publishers(), await publishers()
    gw = await fleet(a=pa, b=pb)
    A, B = tokens(tenant("A")), tokens(tenant("B"))
    async with aiohttp.ClientSession() as client:
        await until(client, gw, lambda m: up(m, "a") and up(m, "b"))
        await pa.publish(*EngineCache().store(A))
        await until(client, gw, lambda m: blocks(m, "a") == n_blocks(A))
        a = {**gw.raw["upstreams"][0], "kv_events": moved.kv_events}    # b leaves
        await gw.gateway.reload(validate({**gw.raw, "upstreams": [a]}))
        await until(client, gw, lambda m: up(m, "a") and blocks(m, "a") == 0 and
                    ("prefixgate_route_kv_events_up", (("upstream", "b"),)) not in m)
        await moved.publish(*EngineCache().store(B))
        await until(client, gw, lambda m: blocks(m, "a") == n_blocks(B))
        assert await route(client, gw, follow_up(tenant("B"))) == ("a", "cache")
    feeds = next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").feeds
    assert set(feeds.feeds) == {"a"} and set(feeds.index.engines) == {"a"}


async def test_discovered_upstreams_subscribe_at_their_own_address(make_gateway, chatml_dir,
                                                                   tokens):
    first = await StandIn(Behaviour()).start("127.0.0.2", 0)
    port = int(first.url.rsplit(":", 1)[1])
    second = await StandIn(Behaviour()).start("127.0.0.3", port)
    p2 = await KVEventsStandIn(host="127.0.0.2").start()
    p3 = await KVEventsStandIn(host="127.0.0.3").start(p2.port, p2.replay_port)
    try:
        answers = Answers()
        gw = await make_gateway({
            "discovery": {"dns": "vllm.fleet.invalid", "port": port, "interval_s": 0.05,
                          "kv_events": {"endpoint": f"tcp://*:{p2.port}",
                                        "replay_endpoint": f"tcp://*:{p2.replay_port}",
                                        "topic": "kv-events"}},
            "model": {"tokenizer": str(chatml_dir)},
            "plugins": [{"prerender": {}}, {"prefix_route": ROUTE}]})
        gw.gateway.discovery.resolver = answers
        answers.now = ["127.0.0.2", "127.0.0.3"]
        n2, n3 = f"127.0.0.2:{port}", f"127.0.0.3:{port}"
        A = tokens(tenant("A"))
        async with aiohttp.ClientSession() as client:
            await until(client, gw, lambda m: up(m, n2) and up(m, n3))
            await p3.publish(*EngineCache().store(A))
            await until(client, gw, lambda m: blocks(m, n3) == n_blocks(A) and blocks(m, n2) == 0)
            assert await route(client, gw, follow_up(tenant("A"))) == (n3, "cache")
            answers.now = ["127.0.0.2"]                  # .3 leaves: its feed and blocks go
            await until(client, gw, lambda m: ("prefixgate_route_kv_events_up",
                                               (("upstream", n3),)) not in m)
        feeds = next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").feeds
        assert set(feeds.feeds) == {n2} and n3 not in feeds.index.engines
    finally:
        for s in (first, second, p2, p3):
            await s.stop()


# --- config ------------------------------------------------------------------------------------

def _config(chatml_dir, route=None, plugins=None, **upstream):
    up = {"name": "a", "url": "http://127.0.0.1:9", **upstream}
    return {"upstreams": [{"name": "z", "url": "http://127.0.0.1:8"}, up],
            "model": {"tokenizer": str(chatml_dir)},
            "plugins": plugins or [{"prerender": {}}, {"prefix_route": {**ROUTE, **(route or {})}}]}


KV = {"endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://10.0.0.1:5558"}


@pytest.mark.parametrize("kv_events, error", [
    ({**KV, "endpoint": "10.0.0.1:5557"},
     "upstreams[1].kv_events.endpoint: must be tcp://host:port (got '10.0.0.1:5557')"),
    ({**KV, "replay_endpoint": "tcp://*:5558"},
     "upstreams[1].kv_events.replay_endpoint: must be tcp://host:port: the engine's address"),
    ({"endpoint": KV["endpoint"]}, "upstreams[1].kv_events.replay_endpoint: required"),
    ({**KV, "hwm": 5}, "upstreams[1].kv_events.hwm: unknown key"),
    ("tcp://10.0.0.1:5557", "upstreams[1].kv_events: must be a mapping"),
])
def test_upstream_kv_events_errors_name_the_key(chatml_dir, kv_events, error):
    with pytest.raises(ConfigError) as e:
        validate(_config(chatml_dir, kv_events=kv_events))
    assert str(e.value).startswith(error), str(e.value)


@pytest.mark.parametrize("route, plugins, error", [
    ({"policy": "chwbl"}, None,
     "plugins[1].prefix_route.index: kv_events needs policy: cache_aware"),
    (None, [{"prefix_route": ROUTE}],
     "plugins[0].prefix_route.index: kv_events needs token-id keys: add the `prerender` plugin"),
    ({"index": "exact"}, None, "plugins[1].prefix_route.index: must be one of approximate, "
                               "kv_events"),
])
def test_index_kv_events_needs_cache_aware_and_token_keys(chatml_dir, route, plugins, error):
    with pytest.raises(ConfigError) as e:
        Gateway(validate(_config(chatml_dir, route, plugins, kv_events=KV)))
    assert str(e.value).startswith(error), str(e.value)


def test_discovery_kv_events_is_a_template_of_ports():
    from prefixgate.proxy.upstream.discovery import Discovery
    cfg = validate({"discovery": {"dns": "engines", "port": 8000, "kv_events": {
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}}})
    d = Discovery(cfg["discovery"], None)
    assert d.upstream_config("10.1.2.3")["kv_events"] == {
        "endpoint": "tcp://10.1.2.3:5557", "replay_endpoint": "tcp://10.1.2.3:5558", "topic": ""}
    assert d.upstream_config("fd00::7")["kv_events"]["endpoint"] == "tcp://[fd00::7]:5557"
    with pytest.raises(ConfigError) as e:
        validate({"discovery": {"dns": "engines", "kv_events": {
            "endpoint": "tcp://10.0.0.1:5557", "replay_endpoint": "tcp://*:5558"}}})
    assert str(e.value).startswith("discovery.kv_events.endpoint: must be tcp://*:port")
