"""prefix_route `index: kv_events` against the real bundled engine: two engines (a tiny random
Llama from tests/helpers.py, 16-token blocks, a small KV cache), each publishing its KV
events with `--kv-events-config` on ports of its own, behind a real gateway whose tokenizer is
the engines' own. Tenants are sent to the engines directly, never through the gateway, so only
the events can tell the gateway where their prefixes are."""
from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest
from multidict import CIMultiDict

from prefixgate.common.block_hash import block_hash_chain, salted_root
from prefixgate.common.schema import check
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.prefix_route.sessions import SPEC as SESSION_SPEC
from prefixgate.plugins.prefix_route.sessions import Sessions
from tests.helpers import KVEventsEngine, Serving
from tests.plugins.helpers import follow_up, tenant

BLOCK = 16
SESSION_DEFAULTS = check({}, SESSION_SPEC, "session")
KV_BLOCKS = 40           # an engine holds about four tenants' prompts
ROUTE = {"policy": "cache_aware", "index": "kv_events", "block_tokens": BLOCK,
         "kv_events_probe_s": 0.2, "kv_events_timeout_s": 0.5}


def Engine(model_dir, port: int = 0, pub: int = 0, replay: int = 0) -> KVEventsEngine:
    return KVEventsEngine(model_dir, BLOCK, KV_BLOCKS, port, pub, replay)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def chain(model_dir):
    """A chat's block keys as the gateway computes them (the engines' template and tokenizer)."""
    tok = Tokenizer.from_dir(model_dir)
    return lambda messages: block_hash_chain(tok.encode(tok.apply_chat_template(messages)), BLOCK)


@pytest.fixture
def engines(model_dir):
    started = [Engine(model_dir).__enter__() for _ in range(2)]
    yield started
    for e in started:
        e.__exit__(None, None, None)


def gateway_config(engines, model_dir) -> dict:
    return {"upstreams": [{"name": f"e{i}", "url": e.url, "kv_events": e.kv_events}
                          for i, e in enumerate(engines)],
            "model": {"tokenizer": str(model_dir)},
            "health": {"interval_s": 0.1, "eject_s": 0.2, "healthy_threshold": 1},
            "plugins": [{"prerender": {"block_tokens": BLOCK}}, {"prefix_route": ROUTE}]}


async def direct(client, engine, messages) -> None:
    """A chat sent to one engine, past the gateway."""
    async with client.post(engine.url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 1, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def route(client, gw, messages) -> tuple[str, str]:
    async with client.post(gw.url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 1, "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        outcome = re.search(r"outcome=(\w+)", r.headers["x-prefixgate-route"]).group(1)
        return r.headers["x-prefixgate-upstream"], outcome


def feeds_of(gw):
    return next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").feeds


async def until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached"
        await asyncio.sleep(0.02)


def leading_common(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def holds(gw, name, keys) -> int:
    """Leading blocks of `keys` the gateway's exact index says `name` holds."""
    return feeds_of(gw).index.match(keys).get(name, 0)


async def live_gateway(make_gateway, engines, model_dir):
    """A gateway in front of `engines` with `index: kv_events`, once both feeds are live."""
    gw = await make_gateway(gateway_config(engines, model_dir))
    await until(lambda: feeds_of(gw).live == {"e0", "e1"}, what="both feeds live")
    return gw, feeds_of(gw)


async def test_routing_by_the_engines_own_events(engines, model_dir, make_gateway, chain):
    e0, e1 = engines
    A, B = chain(tenant("A")), chain(tenant("B"))
    gw, feeds = await live_gateway(make_gateway, engines, model_dir)
    async with aiohttp.ClientSession() as client:
        await direct(client, e0, tenant("A"))
        await direct(client, e1, tenant("B"))
        await until(lambda: holds(gw, "e0", A) == len(A) and holds(gw, "e1", B) == len(B),
                    what="the engines' events applied")
        # a replica started after the traffic learns the same from the replay
        late, _ = await live_gateway(make_gateway, engines, model_dir)
        for g in (gw, late):
            assert await route(client, g, follow_up(tenant("A"))) == ("e0", "cache")
            assert await route(client, g, follow_up(tenant("B"))) == ("e1", "cache")

        # e0's small cache evicts A as other tenants come (sent to e0 directly); they share
        # A's first block (the template and "You are the assistant of tenant ")
        shared = leading_common(A, chain(tenant("filler")))
        for i in range(8):
            if holds(gw, "e0", A) <= shared:
                break
            await direct(client, e0, tenant(f"filler {i}"))
        await until(lambda: holds(gw, "e0", A) <= shared, what="A evicted from e0")
        assert (await route(client, gw, tenant("A")))[1] == "new"     # no longer preferred
    assert feeds.feeds["e0"].resyncs["restart"] == feeds.feeds["e0"].resyncs["gap"] == 0


async def test_a_tenants_salted_blocks_route_that_tenant_and_no_other(engines, model_dir,
                                                                       make_gateway, chain):
    """`isolation: per_key`: tenant `a`'s prompt, sent to e0 under a's salt (past the gateway),
    is published as salted blocks; the gateway keys them under a's salted chain, so a's
    follow-up goes to e0 from cache and b's identical one finds nothing there."""
    keys = {"a": "sk-tenant-a-000001", "b": "sk-tenant-b-000002"}
    gw = await make_gateway({**gateway_config(engines, model_dir),
                             "auth": {"api_keys": list(keys.values())}})
    await until(lambda: feeds_of(gw).live == {"e0", "e1"}, what="both feeds live")
    isolation = gw.gateway.isolation
    salt = {t: isolation.salt_of(gw.gateway.auth.identify(CIMultiDict({"x-api-key": k})))
            for t, k in keys.items()}
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(tok.apply_chat_template(tenant("X")))
    salted = block_hash_chain(ids, BLOCK, parent=salted_root(salt["a"]))
    async with aiohttp.ClientSession() as client:
        async with client.post(engines[0].url + "/v1/chat/completions", json={
                "messages": tenant("X"), "max_tokens": 1, "temperature": 0,
                "cache_salt": salt["a"]}) as r:
            assert r.status == 200, await r.text()
        await until(lambda: holds(gw, "e0", salted) == len(salted), what="a's salted blocks")
        assert holds(gw, "e0", chain(tenant("X"))) == 0        # not under the unsalted chain
        routed = {}
        for t, k in keys.items():
            async with client.post(gw.url + "/v1/chat/completions", headers={"x-api-key": k},
                                   json={"messages": follow_up(tenant("X")), "max_tokens": 1,
                                         "temperature": 0}) as r:
                assert r.status == 200, await r.text()
                routed[t] = (r.headers["x-prefixgate-upstream"],
                             re.search(r"outcome=(\w+)", r.headers["x-prefixgate-route"])[1])
    assert routed["a"] == ("e0", "cache")
    assert routed["b"][1] != "cache"


async def predicted_gateways(make_gateway, engines, model_dir, count: int = 2) -> list:
    """`count` gateways with predicted_ttft over the engines' events, soft sessions (the
    defaults), both feeds live on each."""
    cfg = gateway_config(engines, model_dir)
    cfg["plugins"][1] = {"prefix_route": {**ROUTE, "policy": "predicted_ttft"}}
    gws = [await make_gateway(cfg) for _ in range(count)]
    await until(lambda: all(feeds_of(gw).live == {"e0", "e1"} for gw in gws),
                what="both feeds live")
    return gws


async def as_session(client, gw, key: str, messages) -> tuple[str, str]:
    """(upstream, session outcome) of a chat of session `key` through `gw`."""
    async with client.post(gw.url + "/v1/chat/completions", headers={"x-session-id": key},
                           json={"messages": messages, "max_tokens": 1,
                                 "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return (r.headers["x-prefixgate-upstream"],
                re.search(r"session=(\w+)", r.headers["x-prefixgate-route"]).group(1))


def hashed_to(key: str, names=("e0", "e1")) -> str:
    """The upstream a key's rendezvous hash prefers (sessions.py), among `names`."""
    class Named:
        def __init__(self, name):
            self.name = name
    return Sessions(SESSION_DEFAULTS).upstream(key.encode(), [Named(n) for n in names]).name


async def test_a_session_lives_where_the_engines_say_its_history_is(engines, model_dir,
                                                                    make_gateway, chain):
    """predicted_ttft over KV events, soft sessions: a session whose history an engine holds
    (and the other does not) stays there on every replica, even where its key's hash points
    at the other engine; a new session is placed by that hash among the engines predicted
    within the tie (idle twins here: both), alike on every replica."""
    gws = await predicted_gateways(make_gateway, engines, model_dir)
    key = next(k for k in (f"agent-{i}" for i in range(64)) if hashed_to(k) == "e1")
    async with aiohttp.ClientSession() as client:
        await direct(client, engines[0], tenant("H"))        # its first turn, past the gateway
        history = chain(tenant("H"))
        await until(lambda: all(holds(gw, "e0", history) == len(history) for gw in gws),
                    what="H's blocks")
        for gw in gws:
            assert await as_session(client, gw, key, follow_up(tenant("H"))) == ("e0", "kept")
        placed = {}
        for i in range(6):                  # new sessions: nothing of theirs is held anywhere
            new = f"new-session-{i}"
            placed[new] = [await as_session(client, gw, new, tenant(f"new {i} via {n}"))
                           for n, gw in enumerate(gws)]
    assert all(p == [(hashed_to(k), "placed")] * 2 for k, p in placed.items()), placed
    assert {p[0][0] for p in placed.values()} == {"e0", "e1"}, placed


async def test_an_engine_restart_is_a_new_cache(engines, model_dir, make_gateway, chain):
    e0, e1 = engines
    B, C = chain(tenant("B")), chain(tenant("C"))
    gw, feeds = await live_gateway(make_gateway, engines, model_dir)
    async with aiohttp.ClientSession() as client:
        for t in ("filler", "B"):                      # a few batches, within e1's cache
            await direct(client, e1, tenant(t))
        await until(lambda: holds(gw, "e1", B) == len(B), what="B on e1")
        engines[1] = e1 = e1.restarted()                 # sequence numbers start again at 0
        await until(lambda: feeds.feeds["e1"].resyncs["restart"] == 1 and "e1" in feeds.live,
                    what="e1's feed resynced")
        assert holds(gw, "e1", B) == 0                   # the new engine's cache is empty
        by_name = {u.name: u for u in gw.gateway.upstreams}
        await until(lambda: by_name["e1"].healthy, what="e1 healthy again")
        await direct(client, e1, tenant("C"))
        await until(lambda: holds(gw, "e1", C) == len(C), what="C on the new e1")
        assert await route(client, gw, follow_up(tenant("C"))) == ("e1", "cache")
        assert (await route(client, gw, follow_up(tenant("B"))))[1] == "new"


async def test_serve_subscribes_to_its_bundled_engines_events(model_dir, tmp_path):
    """`prefixgate serve` with `bundled.kv_events_config`: each engine publishes on ports of its
    own, the gateway's upstreams carry them, and both feeds come up (exact routing in standalone
    mode needs no endpoint written by hand)."""
    import yaml

    cfg = {"listen": {"host": "127.0.0.1", "port": 0},
           "bundled": {"model": str(model_dir), "instances": 2,
                       "args": ["--dtype", "float32", "--block-size", str(BLOCK),
                                "--num-kv-blocks", str(KV_BLOCKS)],
                       "kv_events_config": {"enable_kv_cache_events": True, "topic": "kv-events",
                                            "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}},
           "model": {"tokenizer": str(model_dir)},
           "plugins": [{"prerender": {"block_tokens": BLOCK}}, {"prefix_route": ROUTE},
                       {"metrics": {}}]}
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(cfg))
    async with Serving("--config", str(path), timeout=60) as gw, aiohttp.ClientSession() as client:
        deadline = time.monotonic() + 20
        while True:
            async with client.get(gw.url + "/metrics") as r:
                up = re.findall(r'prefixgate_route_kv_events_up\{upstream="(engine\d)"\} 1\.0',
                                await r.text())
            if sorted(up) == ["engine0", "engine1"]:
                break
            assert time.monotonic() < deadline, "the bundled engines' feeds did not come up"
            await asyncio.sleep(0.1)
        async with client.post(gw.url + "/v1/chat/completions", json={
                "messages": tenant("A"), "max_tokens": 1, "temperature": 0}) as r:
            assert r.status == 200, await r.text()
            first = r.headers["x-prefixgate-upstream"]
        while True:                 # the engine's events reach the gateway's exact index
            async with client.get(gw.url + "/metrics") as r:
                held = re.search(
                    rf'prefixgate_route_kv_index_blocks\{{upstream="{first}"\}} (\S+)',
                    await r.text())
            if held and float(held.group(1)) > 0:
                break
            assert time.monotonic() < deadline, "no events from the engine that served A"
            await asyncio.sleep(0.05)
        async with client.post(gw.url + "/v1/chat/completions", json={
                "messages": follow_up(tenant("A")), "max_tokens": 1, "temperature": 0}) as r:
            assert r.status == 200
            assert (r.headers["x-prefixgate-upstream"],
                    "outcome=cache" in r.headers["x-prefixgate-route"]) == (first, True)
