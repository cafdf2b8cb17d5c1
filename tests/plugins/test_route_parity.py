"""Router↔engine parity (plugins/prefix_route/parity.py, proxy/doctor/route_parity.py) against real
bundled engines on loopback (a tiny random Llama, 16-token blocks, reporting cached tokens as
vLLM does, publishing their KV events): one engine, `b`, serves the model with another chat
template (a default system preamble, as Llama 3.1's and Qwen's templates add), the others
with the gateway's own. Sessions (`x-session-id`) pin each conversation to one engine.

The planted mismatch shows in `prefixgate_route_cache_prediction_error` within 20 requests and
`prefixgate doctor` (the real command, against the live gateway) names `b` and not `a`; a
fleet that agrees gives a gap of at most a block."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from prefixgate.backend.demo import CHATML_TEMPLATE, write_tokenizer_files
from prefixgate.proxy.doctor import route_parity as doctor_parity
from tests.helpers import KVEventsEngine, tiny_tokenizer
from tests.tools.helpers import doctor

BLOCK = 16
MODEL = "tiny"
TARGET = 20                # the target: the mismatch shows within this many requests
PREAMBLE = ("<|im_start|>system\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul "
            "2024\nYou are a helpful assistant. Answer in full sentences, cite your sources and "
            "keep a friendly tone.<|im_end|>\n")
PREAMBLE_TEMPLATE = "{{- " + json.dumps(PREAMBLE) + " }}" + CHATML_TEMPLATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def preamble_dir(tmp_path_factory):
    """The engines' tokenizer with another chat template: a preamble before every prompt."""
    d = tmp_path_factory.mktemp("preamble")
    write_tokenizer_files(d, tiny_tokenizer(), chat_template=PREAMBLE_TEMPLATE)
    return d


def engine(model_dir, tokenizer_dir=None) -> KVEventsEngine:
    e = KVEventsEngine(model_dir, BLOCK, 2048)        # room for every prompt: no eviction
    e.argv += ["--served-model-name", MODEL]
    if tokenizer_dir is not None:
        e.argv += ["--tokenizer", str(tokenizer_dir)]
    return e.__enter__()


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, preamble_dir):
    """a and c: the gateway's template; b: the preamble template."""
    started = {"a": engine(tiny_llama_dir), "b": engine(tiny_llama_dir, preamble_dir),
               "c": engine(tiny_llama_dir)}
    yield started
    for e in started.values():
        e.__exit__(None, None, None)


def config(engines: dict, model_dir, index: str) -> dict:
    return {"upstreams": [{"name": n, "url": e.url, "kv_events": e.kv_events}
                          for n, e in engines.items()],
            "model": {"tokenizer": str(model_dir)},
            "plugins": [{"prerender": {"block_tokens": BLOCK}},
                        {"prefix_route": {"policy": "cache_aware", "index": index,
                                          "block_tokens": BLOCK, "kv_events_probe_s": 0.2,
                                          "kv_events_timeout_s": 0.5}}]}


async def started(make_gateway, engines: dict, model_dir, index: str):
    gw = await make_gateway(config(engines, model_dir, index))
    if index == "kv_events":
        feeds = next(p for p in gw.gateway.chain.plugins if p.name == "prefix_route").feeds
        deadline = time.monotonic() + 10
        while feeds.live != set(engines):
            assert time.monotonic() < deadline, "the KV event feeds did not go live"
            await asyncio.sleep(0.02)
    return gw


def turns(tag: str, sessions: int = 8, depth: int = 3):
    """(session id, messages) of `sessions` conversations, `depth` turns each, round-robin:
    each system prompt starts with its own name, so no block is shared across them."""
    systems = [f"{tag}{i} rules. " + f"Conversation {tag}{i}: answer briefly. " * 6
               for i in range(sessions)]
    history = [[{"role": "system", "content": s}] for s in systems]
    for turn in range(depth):
        for i, h in enumerate(history):
            if turn:
                h.append({"role": "assistant", "content": f"answer {turn}"})
            h.append({"role": "user", "content": f"question {turn} of {tag}{i}"})
            yield f"{tag}{i}", list(h)


async def chat(client, gw, session: str, messages) -> str:
    async with client.post(gw.url + "/v1/chat/completions", headers={"x-session-id": session},
                           json={"model": MODEL, "messages": messages, "max_tokens": 1,
                                 "temperature": 0}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-prefixgate-upstream"]


async def parity(client, gw) -> dict[str, doctor_parity.UpstreamParity]:
    async with client.get(gw.url + "/metrics") as r:
        return doctor_parity.parse(await r.text())


def named(up: doctor_parity.UpstreamParity | None) -> bool:
    """Whether doctor's test would name this upstream (proxy/doctor/route_parity.py)."""
    return (up is not None and up.compared >= doctor_parity.MIN_COMPARED
            and up.far_apart >= doctor_parity.DISAGREE_SHARE)


async def drive(gw, tag: str) -> tuple[dict, int | None, int | None]:
    """Send the conversations; (where each went, the request after which b's metric first
    showed a large gap, the request after which doctor's test first names b)."""
    where, first_gap, first_named = {}, None, None
    async with aiohttp.ClientSession() as client:
        for n, (session, messages) in enumerate(turns(tag), 1):
            where[session] = await chat(client, gw, session, messages)
            b = (await parity(client, gw)).get("b")
            if first_gap is None and b is not None and b.far_apart > 0:
                first_gap = n
            if first_named is None and named(b):
                first_named = n
    return where, first_gap, first_named


async def run_doctor(gw, tmp_path) -> tuple[int, list[dict]]:
    """The real `prefixgate doctor` against the gateway (short probes); its parity findings."""
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "a short probe"}]}))
    rc, report, err = await doctor(gw.url, "--request", str(probe), "--max-tokens", "4")
    assert isinstance(report, dict), (report, err)
    return rc, [f for f in report["findings"] if f["check"] == "r"]


@pytest.mark.parametrize("index", ["approximate", "kv_events"])
async def test_a_planted_template_mismatch_is_named(fleet, tiny_llama_dir, make_gateway,
                                                    index, tmp_path):
    engines = {"a": fleet["a"], "b": fleet["b"]}
    gw = await started(make_gateway, engines, tiny_llama_dir, index)
    where, first_gap, first_named = await drive(gw, f"mm-{index}-")
    assert set(where.values()) == {"a", "b"}          # both engines have conversations
    print(f"\n[{index}] b's gap first showed after request {first_gap}; doctor's test names "
          f"b after request {first_named}")
    assert first_named is not None and first_named <= TARGET, (first_gap, first_named)

    async with aiohttp.ClientSession() as client:
        fleet_parity = await parity(client, gw)
    a, b = fleet_parity["a"], fleet_parity["b"]
    assert a.far_apart == 0 and abs(a.mean_gap) <= BLOCK, vars(a)
    assert b.mean_gap >= 3 * BLOCK and b.share("none_hit", "more") > 0.5, vars(b)
    if index == "kv_events":        # b's events hash to keys the gateway never computes
        assert b.share("none_hit") > 0.5, vars(b)

    rc, found = await run_doctor(gw, tmp_path)
    print("\n".join(f"[{f['status']}] {f['title']}: {f['detail']}\n  fix: {f['fix']}"
                    for f in found))
    assert rc == 1
    failing = [f for f in found if f["status"] == "FAIL"]
    assert [f["data"]["upstream"] for f in failing] == ["b"]
    assert "tokenizer or chat template" in failing[0]["fix"]
    assert "more cached than predicted" in failing[0]["detail"]
    assert failing[0]["data"]["compared"] >= b.compared      # and doctor's own probes
    passing = [f for f in found if f["status"] == "PASS"]
    assert list(passing[0]["data"]["agree"]) == ["a"]


async def test_an_agreeing_fleet_has_a_near_zero_gap(fleet, tiny_llama_dir, make_gateway,
                                                     tmp_path):
    engines = {"a": fleet["a"], "c": fleet["c"]}
    gw = await started(make_gateway, engines, tiny_llama_dir, "approximate")
    where, _, _ = await drive(gw, "ok-")
    assert set(where.values()) == {"a", "c"}
    async with aiohttp.ClientSession() as client:
        fleet_parity = await parity(client, gw)
    assert set(fleet_parity) == {"a", "c"}
    for name, up in fleet_parity.items():
        assert up.compared >= 8, (name, vars(up))
        assert up.far_apart == 0 and abs(up.mean_gap) <= BLOCK, (name, vars(up))
        assert up.outcomes.get("agree", 0) == up.compared
    rc, found = await run_doctor(gw, tmp_path)
    assert [f["status"] for f in found] == ["PASS"], found
    assert sorted(found[0]["data"]["agree"]) == ["a", "c"]


# --- stand-ins, text keys (no tokenizer): caching off, and an upstream that reports nothing ---

def streamed(i: int) -> dict:
    """Every other request streamed with its usage event (the stream-tail path)."""
    return {"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {}


async def test_caching_off_is_named_and_silent_upstreams_are_not_counted(make_standin,
                                                                         make_gateway):
    ups = {"on": await make_standin(prefix_cache=True), "off": await make_standin(
        prefix_cache=False), "silent": await make_standin()}   # silent: no cached count
    gw = await make_gateway({"upstreams": [{"name": n, "url": s.url} for n, s in ups.items()],
                             "plugins": [{"prefix_route": {"policy": "cache_aware"}}]})
    async with aiohttp.ClientSession() as client:
        for n, (session, messages) in enumerate(turns("st-", sessions=12, depth=3)):
            async with client.post(gw.url + "/v1/chat/completions",
                                   headers={"x-session-id": session},
                                   json={"messages": messages, **streamed(n)}) as r:
                assert r.status == 200
                await r.read()
        async with client.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert all(s.requests for s in ups.values())       # every upstream had conversations
    fleet_parity = doctor_parity.parse(text)
    assert set(fleet_parity) == {"on", "off"}          # silent's answers are not compared
    on, off = fleet_parity["on"], fleet_parity["off"]
    assert on.far_apart == 0 and abs(on.mean_gap) < BLOCK, vars(on)
    assert off.share("hit_none") > 0.5 and off.mean_gap < -BLOCK, vars(off)
    found = doctor_parity.route_parity(text)
    failing = [f for f in found if f.status == "FAIL"]
    assert [f.data["upstream"] for f in failing] == ["off"]
    assert "less cached than predicted" in failing[0].detail
    assert "prefix caching off" in failing[0].fix
