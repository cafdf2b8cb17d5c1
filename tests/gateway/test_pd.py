"""Prefill/decode pairs through the gateway, against stand-ins of vLLM's and SGLang's P/D
instances (proxy/testing/pd_standin.py): what each leg carries, what the client gets, and
what happens when a leg fails."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.pd import REMOTE_DECODE
from prefixgate.proxy.testing.pd_standin import (
    Bootstrap,
    KVStore,
    SglangDecode,
    SglangPrefill,
    VllmDecode,
    VllmPrefill,
)
from prefixgate.proxy.testing.standin import Behaviour
from tests.helpers import CHAT, CONF, event_json, read_events

MODEL = "standin-model"
DEAD_URL = "http://127.0.0.1:9"            # discard port: nothing listens, connect refused


@pytest.fixture
async def start():
    """`await start(VllmPrefill(...))` → the stand-in, running until the test ends."""
    started = []

    async def factory(standin):
        started.append(await standin.start())
        return standin
    yield factory
    for s in started:
        await s.stop()


async def vllm_fleet(start, make_gateway, prefills=1, decodes=1, extra=None,
                     protocol="vllm", **gw_cfg):
    """Prefill stand-ins p0.., decode stand-ins d0.. sharing one KVStore, and a gateway."""
    kv = KVStore()
    ps = [await start(VllmPrefill(Behaviour(tokens=1), kv=kv)) for _ in range(prefills)]
    ds = [await start(VllmDecode(Behaviour(tokens=4), kv=kv)) for _ in range(decodes)]
    ups = ([{"name": f"p{i}", "url": p.url, "role": "prefill"} for i, p in enumerate(ps)]
           + [{"name": f"d{i}", "url": d.url, "role": "decode"} for i, d in enumerate(ds)]
           + (extra or []))
    gw = await make_gateway({"upstreams": ups, "pd": {"protocol": protocol},
                             "plugins": [{"metrics": {}}], **gw_cfg})
    return gw, ps, ds


async def sglang_fleet(start, make_gateway, prefill_ports=(None,), decodes=1, **gw_cfg):
    rooms = Bootstrap()
    ps = [await start(SglangPrefill(Behaviour(tokens=1), bootstrap=rooms, bootstrap_port=port))
          for port in prefill_ports]
    ds = [await start(SglangDecode(Behaviour(tokens=4), bootstrap=rooms))
          for _ in range(decodes)]
    ups = ([{"name": f"p{i}", "url": p.url, "role": "prefill", "bootstrap_port": p.bootstrap_port}
            for i, p in enumerate(ps)]
           + [{"name": f"d{i}", "url": d.url, "role": "decode"} for i, d in enumerate(ds)])
    gw = await make_gateway({"upstreams": ups, "pd": {"protocol": "sglang"},
                             "plugins": [{"metrics": {}}], **gw_cfg})
    return gw, ps, ds, rooms


async def post(client, url, body, path="/v1/chat/completions", **kw):
    async with client.post(url + path, json=body, **kw) as r:
        raw = await r.read()
        return r.status, r.headers, raw


async def metrics(client, url) -> str:
    async with client.get(url + "/metrics") as r:
        return await r.text()


async def post_trying_first(gw, first: str, body) -> tuple:
    """POST a chat while every other decode-capable upstream looks busier than `first`, so
    that the decode load scorer picks `first` (ties are broken at random)."""
    others = [u for u in gw.gateway.upstreams if u.role != "prefill" and u.name != first]
    for u in others:
        u.inflight += 1
    try:
        async with aiohttp.ClientSession() as client:
            return await post(client, gw.url, body)
    finally:
        for u in others:
            u.inflight -= 1


def completions(standin) -> list[dict]:
    return [r for r in standin.requests if r["path"].endswith("completions")]


# --- vLLM -------------------------------------------------------------------------------------

async def test_vllm_legs_carry_what_vllm_needs_and_the_stream_is_relayed(start, make_gateway):
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50, "min_tokens": 3, "temperature": 0.2}
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=body,
                               headers={"X-Request-Id": "req-pd-1"}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["x-prefixgate-pd"] == "vllm"
            assert r.headers["x-prefixgate-upstream"] == "d0"
            assert r.headers["x-prefixgate-prefill-upstream"] == "p0"
            events = [event_json(e) for _, e in await read_events(r)]
    # the decode's own stream, event for event: the role, four tokens, the usage chunk, [DONE]
    assert [e["choices"][0]["delta"].get("content") for e in events[:5]] == [
        "", "tok0 ", "tok1 ", "tok2 ", "tok3 "]
    assert events[5]["usage"]["completion_tokens"] == 4 and events[-1] == "[DONE]"

    (first,), (second,) = completions(p), completions(d)
    sent = first["json"]
    assert sent["kv_transfer_params"] == REMOTE_DECODE
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert "stream_options" not in sent and "min_tokens" not in sent
    assert sent["messages"] == CHAT["messages"] and sent["temperature"] == 0.2
    # the decode leg: the client's body as it was, plus what the prefill answered
    returned = d.pulled[0]
    assert second["json"] == {**body, "kv_transfer_params": returned}
    assert returned["do_remote_prefill"] is True and returned["do_remote_decode"] is False
    assert returned["remote_engine_id"] == p.engine_id and returned["remote_block_ids"]
    assert returned["remote_request_id"] == "req-pd-1"
    assert first["headers"]["X-Request-Id"] == second["headers"]["X-Request-Id"] == "req-pd-1"
    assert p.kv.held == {}                 # the decode pulled (and so freed) the blocks


@pytest.mark.parametrize("protocol", ["vllm", "prefixgate"])     # the bundled engine's: vLLM's
async def test_vllm_whole_answers_through_the_openai_sdk(start, make_gateway, protocol):
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway, protocol=protocol)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-none", max_retries=0)
    chat = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                max_tokens=20)
    assert chat.choices[0].message.content == "tok0 tok1 tok2 tok3 "
    assert chat.usage.completion_tokens == 4
    text = await client.completions.create(model=MODEL, prompt="Once upon a time",
                                           max_tokens=20)
    assert text.choices[0].text == "tok0 tok1 tok2 tok3 "
    stream = await client.chat.completions.create(model=MODEL, messages=CHAT["messages"],
                                                  stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream
                    if c.choices]) == "tok0 tok1 tok2 tok3 "
    await client.close()
    assert [r["path"] for r in completions(p)] == [
        "/v1/chat/completions", "/v1/completions", "/v1/chat/completions"]
    assert len(d.pulled) == 3 and completions(p)[1]["json"]["prompt"] == "Once upon a time"


async def test_vllm_prefill_failure_is_retried_on_the_other_prefill(start, make_gateway):
    """Round robin picks the prefill: the first request tries p0 (failing) first, then p1."""
    gw, (p0, p1), (d,) = await vllm_fleet(start, make_gateway, prefills=2,
                                          plugins=["round_robin", {"metrics": {}}])
    p0.behaviour.fail = "status"
    async with aiohttp.ClientSession() as client:
        for _ in range(2):
            status, headers, raw = await post(client, gw.url, CHAT)
            assert status == 200, raw
            assert headers["x-prefixgate-pd"] == "vllm"
            assert headers["x-prefixgate-prefill-upstream"] == "p1"
    assert len(completions(p0)) >= 1 and len(completions(p1)) == 2
    assert len(d.pulled) == 2


@pytest.mark.parametrize("failure", ["status", "no_params", "refused", "hang"])
async def test_vllm_every_prefill_failing_falls_back_to_a_plain_decode(start, make_gateway,
                                                                       failure):
    gw, ps, (d,) = await vllm_fleet(start, make_gateway, prefills=2,
                                    timeouts={"first_byte": 0.5})
    for p in ps:
        if failure == "no_params":
            p.give_params = False           # a vLLM without --kv-transfer-config
        elif failure == "refused":
            p.behaviour.fail, p.behaviour.status = "status", 400
        else:
            p.behaviour.fail = failure
    async with aiohttp.ClientSession() as client:
        status, headers, raw = await post(client, gw.url, CHAT)
        text = await metrics(client, gw.url)
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
    assert headers["x-prefixgate-pd"] == "fallback"
    assert headers["x-prefixgate-upstream"] == "d0"
    assert "x-prefixgate-prefill-upstream" not in headers
    # both prefill upstreams tried (retries: 1), but a refusal (4xx) is not tried twice
    tried = sum(len(completions(p)) for p in ps)
    assert tried == (1 if failure == "refused" else 2)
    (plain,) = completions(d)
    assert plain["json"] == CHAT and d.pulled == []        # computed there, no P/D fields
    assert 'prefixgate_pd_requests_total{outcome="fallback",protocol="vllm"} 1.0' in text


async def test_vllm_connect_refused_prefill_is_retried(start, make_gateway):
    kv = KVStore()
    p = await start(VllmPrefill(Behaviour(tokens=1), kv=kv))
    d = await start(VllmDecode(Behaviour(tokens=4), kv=kv))
    gw = await make_gateway({"upstreams": [
        {"name": "dead", "url": DEAD_URL, "role": "prefill"},
        {"name": "p", "url": p.url, "role": "prefill"},
        {"name": "d", "url": d.url, "role": "decode"}],
        "pd": {"protocol": "vllm"}, "health": {"interval_s": 0},
        "plugins": ["round_robin"]})
    async with aiohttp.ClientSession() as client:
        status, headers, _ = await post(client, gw.url, CHAT)
    assert status == 200 and headers["x-prefixgate-prefill-upstream"] == "p"
    assert not gw.gateway.upstreams[0].healthy          # refused: ejected, as any upstream


async def test_vllm_decode_failure_retries_another_decode_with_a_fresh_prefill(
        start, make_gateway):
    gw, (p,), (d0, d1) = await vllm_fleet(start, make_gateway, decodes=2)
    d0.behaviour.fail, d0.behaviour.status = "status", 503
    status, headers, raw = await post_trying_first(gw, "d0", {**CHAT, "stream": True})
    assert status == 200, raw
    assert headers["x-prefixgate-upstream"] == "d1" and headers["x-prefixgate-pd"] == "vllm"
    assert b"tok3" in raw
    legs = completions(p)
    assert len(legs) == 2                     # a fresh prefill for the second decode
    assert d0.pulled[0]["remote_block_ids"] != d1.pulled[0]["remote_block_ids"]
    assert len(completions(d0)) == 1 and len(completions(d1)) == 1


async def test_vllm_decode_failure_after_the_first_byte_ends_the_stream_with_an_error(
        start, make_gateway):
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway)
    d.behaviour.fail, d.behaviour.fail_after = "reset_after", 2
    async with aiohttp.ClientSession() as client:
        status, _, raw = await post(client, gw.url, {**CHAT, "stream": True})
    assert status == 200
    assert b"tok1" in raw and b'"error"' in raw and b"failed mid-stream" in raw
    assert len(completions(p)) == 1                # no second try once bytes went out


# --- SGLang -----------------------------------------------------------------------------------

async def test_sglang_pair_is_sent_at_once_with_one_room(start, make_gateway):
    gw, ps, (d,), rooms = await sglang_fleet(start, make_gateway, prefill_ports=(9123,))
    (p,) = ps
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions",
                               json={**CHAT, "stream": True},
                               headers={"X-Request-Id": "sg-1"}) as r:
            assert r.status == 200
            assert r.headers["x-prefixgate-pd"] == "sglang"
            assert r.headers["x-prefixgate-upstream"] == "d0"
            assert r.headers["x-prefixgate-prefill-upstream"] == "p0"
            events = [event_json(e) for _, e in await read_events(r)]
    assert len([e for e in events if e != "[DONE]"]) == 5          # the decode's 4 tokens
    (to_p,), (to_d,) = completions(p), completions(d)
    assert to_p["json"] == to_d["json"]                # the same body to both legs
    sent = to_d["json"]
    assert {k: sent[k] for k in CHAT} == CHAT and sent["stream"] is True
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == 9123
    room = sent["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2 ** 63 and list(rooms.rooms) == [room]
    assert to_p["headers"]["X-Request-Id"] == to_d["headers"]["X-Request-Id"] == "sg-1"
    # concurrent: the prefill waits for the decode to join its room before it answers
    assert d.received == 1 and set(rooms.rooms[room].arrived) == {"prefill", "decode"}


async def test_sglang_whole_answer_and_a_null_bootstrap_port(start, make_gateway):
    gw, (p,), (d,), rooms = await sglang_fleet(start, make_gateway)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-none", max_retries=0)
    answer = await client.completions.create(model=MODEL, prompt="hi", max_tokens=8)
    await client.close()
    assert answer.choices[0].text == "tok0 tok1 tok2 tok3 "
    assert completions(d)[0]["json"]["bootstrap_port"] is None     # SGLang's default port
    assert len(rooms.rooms) == 1 and d.received == 1


async def test_sglang_prefill_failure_cancels_the_decode_then_falls_back(start, make_gateway):
    gw, (p,), (d,), rooms = await sglang_fleet(start, make_gateway, retries=0)
    p.behaviour.fail = "status"
    async with aiohttp.ClientSession() as client:
        status, headers, raw = await post(client, gw.url, CHAT)
        async with asyncio.timeout(3):
            while d.cancelled < 1:           # the decode server sees its request go away
                await asyncio.sleep(0.01)
    assert status == 200, raw
    assert headers["x-prefixgate-pd"] == "fallback"
    cancelled, plain = completions(d)
    assert cancelled["cancelled"] and "bootstrap_room" in cancelled["json"]
    assert plain["json"] == CHAT                      # recomputed there, without a room
    assert d.received == 0


async def test_sglang_prefill_failure_retries_a_new_pair(start, make_gateway):
    gw, (p0, p1), (d,), rooms = await sglang_fleet(start, make_gateway, prefill_ports=(1, 2),
                                                   plugins=["round_robin"])
    p0.behaviour.fail = "status"
    async with aiohttp.ClientSession() as client:
        status, headers, raw = await post(client, gw.url, CHAT)
    assert status == 200, raw
    assert headers["x-prefixgate-pd"] == "sglang"
    assert headers["x-prefixgate-prefill-upstream"] == "p1"
    first, second = completions(d)
    assert first["json"]["bootstrap_port"] == 1 and second["json"]["bootstrap_port"] == 2
    assert first["json"]["bootstrap_room"] != second["json"]["bootstrap_room"]
    assert d.received == 1


async def test_sglang_decode_failure_retries_a_fresh_pair_on_another_decode(
        start, make_gateway):
    gw, (p,), (d0, d1), rooms = await sglang_fleet(start, make_gateway, decodes=2)
    d0.behaviour.fail, d0.behaviour.status = "status", 503     # after its KV arrived
    status, headers, raw = await post_trying_first(gw, "d0", {**CHAT, "stream": True})
    assert status == 200, raw
    assert headers["x-prefixgate-upstream"] == "d1" and headers["x-prefixgate-pd"] == "sglang"
    first, second = completions(p)            # a fresh pair: the prefill again, a new room
    assert first["json"]["bootstrap_room"] != second["json"]["bootstrap_room"]
    assert completions(d0)[0]["json"]["bootstrap_room"] == first["json"]["bootstrap_room"]
    assert completions(d1)[0]["json"]["bootstrap_room"] == second["json"]["bootstrap_room"]
    assert d1.received == 1 and b"tok3" in raw


# --- routing, config, observability -----------------------------------------------------------

async def test_plain_requests_never_reach_a_prefill_upstream(start, make_gateway):
    both = await start(VllmDecode(Behaviour(tokens=2)))
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway, extra=[
        {"name": "both", "url": both.url, "role": "both"}])
    async with aiohttp.ClientSession() as client:
        for _ in range(6):
            status, headers, _ = await post(client, gw.url, {"model": MODEL, "input": "x"},
                                            path="/v1/embeddings")
            assert status == 200 and headers["x-prefixgate-upstream"] in ("d0", "both")
            assert "x-prefixgate-pd" not in headers
        gw.gateway.upstreams[0].healthy = False        # no healthy prefill: chats go plain
        status, headers, _ = await post(client, gw.url, CHAT)
        assert status == 200 and "x-prefixgate-pd" not in headers
        assert headers["x-prefixgate-upstream"] in ("d0", "both")
    assert p.requests == []
    assert len(d.requests) + len(both.requests) == 7


async def test_prefill_upstream_is_chosen_by_the_prefix_scorers(start, make_gateway):
    """cache_aware learns where a prompt was prefilled: the same prompt goes there again."""
    gw, ps, ds = await vllm_fleet(start, make_gateway, prefills=3, decodes=2, plugins=[
        {"prefix_route": {"policy": "cache_aware"}}, {"metrics": {}}])
    prompt = {"model": MODEL, "prompt": "You are a careful assistant. " * 40}
    async with aiohttp.ClientSession() as client:
        seen = []
        for _ in range(3):
            status, headers, _ = await post(client, gw.url, prompt, path="/v1/completions")
            assert status == 200 and headers["x-prefixgate-pd"] == "vllm"
            seen.append((headers["x-prefixgate-prefill-upstream"], headers["x-prefixgate-route"]))
    assert len({name for name, _ in seen}) == 1
    assert "outcome=cache" in seen[2][1]


async def test_decode_upstream_by_the_backends_polled_load_and_kv_usage(start, make_gateway):
    """With prefix_route polling the backends' /metrics, the decode upstream is the one the
    backends themselves report least loaded — what other gateway replicas sent counts too —
    and, at equal load, the one with the emptier KV cache."""
    kv = KVStore()
    p = await start(VllmPrefill(Behaviour(tokens=1), kv=kv))
    full = await start(VllmDecode(Behaviour(tokens=4, kv_usage=0.9), kv=kv))
    empty = await start(VllmDecode(Behaviour(tokens=4, kv_usage=0.1), kv=kv))
    ups = [{"name": "p", "url": p.url, "role": "prefill"},
           {"name": "full", "url": full.url, "role": "decode"},
           {"name": "empty", "url": empty.url, "role": "decode"}]
    gw = await make_gateway({"upstreams": ups, "pd": {"protocol": "vllm"}, "plugins": [
        {"prefix_route": {"policy": "cache_aware", "poll_metrics_s": 0.05}}, {"metrics": {}}]})
    async with aiohttp.ClientSession() as client:
        async with asyncio.timeout(5):
            while not all(u.polled for u in gw.gateway.upstreams):
                await asyncio.sleep(0.02)
        chosen = [(await post(client, gw.url, {**CHAT, "model": MODEL}))[1]["x-prefixgate-upstream"]
                  for _ in range(4)]
        assert chosen == ["empty"] * 4
        empty.running = 3           # another replica's requests, seen only by polling
        await asyncio.sleep(0.2)
        status, headers, _ = await post(client, gw.url, {**CHAT, "model": MODEL})
    empty.running = 0
    assert status == 200 and headers["x-prefixgate-upstream"] == "full"


async def test_no_decode_capable_upstream_at_request_time_is_a_clear_503(start, make_gateway):
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway)
    prefill_only = [u.cfg for u in gw.gateway.upstreams if u.role == "prefill"]
    await gw.gateway.set_upstreams(prefill_only)      # as discovery might leave it
    async with aiohttp.ClientSession() as client:
        status, _, raw = await post(client, gw.url, CHAT)
    assert status == 503
    assert "no upstream with role both or decode" in json.loads(raw)["error"]["message"]
    assert p.requests == []


@pytest.mark.parametrize("raw, key", [
    ({"upstreams": [{"url": "http://a:1", "role": "prefill"}]}, "upstreams[0].role"),
    ({"upstreams": [{"url": "http://a:1"}, {"url": "http://b:1", "role": "decode"}]},
     "upstreams[1].role"),
    ({"upstreams": [{"url": "http://a:1", "role": "decode"}], "pd": {"protocol": "vllm"}},
     "pd"),
    ({"upstreams": [{"url": "http://a:1", "role": "prefill"}], "pd": {"protocol": "sglang"}},
     "pd"),
    ({"upstreams": [{"url": "http://a:1"}], "pd": {"protocol": "nixl"}}, "pd.protocol"),
    ({"upstreams": [{"url": "http://a:1"}], "pd": {}}, "pd.protocol"),
    ({"upstreams": [{"url": "http://a:1", "role": "primary"}]}, "upstreams[0].role"),
    ({"upstreams": [{"url": "http://a:1", "bootstrap_port": 70000}]},
     "upstreams[0].bootstrap_port"),
    ({"discovery": {"dns": "pods.local", "role": "decode"}}, "discovery.role"),
])
def test_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as e:
        config_mod.validate(raw)
    assert e.value.path == key, str(e.value)


def test_config_accepts_the_p_d_shapes():
    cfg = config_mod.validate({"upstreams": [
        {"url": "http://p:1", "role": "prefill", "bootstrap_port": 8998},
        {"url": "http://d:1", "role": "decode"}, {"url": "http://b:1"}],
        "pd": {"protocol": "prefixgate"}})
    assert cfg["pd"] == {"protocol": "prefixgate"}
    assert [(u["role"], u["bootstrap_port"]) for u in cfg["upstreams"]] == [
        ("prefill", 8998), ("decode", None), ("both", None)]
    # discovered upstreams may bring the roles: checked per request instead
    cfg = config_mod.validate({"discovery": {"dns": "pods.local", "role": "prefill"},
                               "pd": {"protocol": "vllm"}})
    assert cfg["discovery"]["role"] == "prefill"
    assert config_mod.validate({"upstreams": [{"url": "http://a:1"}]})["pd"] is None


@pytest.mark.parametrize("name", ["pd-vllm.yaml", "pd-sglang.yaml"])
def test_shipped_p_d_examples_validate_and_build(name):
    cfg = config_mod.load(CONF / name)
    assert cfg["pd"]["protocol"] == name[3:-5]
    roles = [u["role"] for u in Gateway(cfg).config["upstreams"]]
    assert "prefill" in roles and "decode" in roles


async def test_metrics_and_access_log_fields(start, make_gateway, tmp_path):
    path = tmp_path / "access.log"
    gw, (p,), (d,) = await vllm_fleet(start, make_gateway, access_log={"path": str(path)})
    async with aiohttp.ClientSession() as client:
        assert (await post(client, gw.url, {**CHAT, "stream": True}))[0] == 200
        p.give_params = False
        assert (await post(client, gw.url, CHAT))[0] == 200                    # fallback
        assert (await post(client, gw.url, {"model": MODEL, "input": "x"},
                           path="/v1/embeddings"))[0] == 200                    # plain
        text = await metrics(client, gw.url)
    assert 'prefixgate_pd_requests_total{outcome="pd",protocol="vllm"} 1.0' in text
    assert 'prefixgate_pd_requests_total{outcome="fallback",protocol="vllm"} 1.0' in text
    assert 'prefixgate_pd_prefill_seconds_count{upstream="p0"} 1.0' in text
    assert 'prefixgate_pd_decode_ttft_seconds_count{upstream="d0"} 1.0' in text
    for _ in range(250):
        if path.exists() and path.read_text().count("\n") >= 3:
            break
        await asyncio.sleep(0.02)
    pd_line, fallback, plain = [json.loads(line) for line in path.read_text().splitlines()[:3]]
    assert pd_line["pd"] == "vllm" and pd_line["prefill_upstream"] == "p0"
    assert pd_line["upstream"] == "d0" and pd_line["prefill_leg_ms"] > 0
    # vLLM's legs run one after the other: the prefill leg is part of the upstream's time
    assert (pd_line["connect_ms"] + pd_line["upstream_ttft_ms"]
            >= pd_line["prefill_leg_ms"] * 0.99)
    assert fallback["pd"] == "fallback" and fallback["prefill_upstream"] is None
    assert fallback["prefill_leg_ms"] > 0 and fallback["attempts"] == 1
    assert plain["pd"] is None and plain["prefill_upstream"] is None
    assert plain["prefill_leg_ms"] is None
