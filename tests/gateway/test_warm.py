"""Warming: the warm API (`x-prefixgate-warm: 1`) against a stand-in that models a prefix
cache, and next-turn warming (`prerender: {warm_next_turn: true}`) against the real bundled
engine: the next turn finds its whole history cached, which it does not without warming;
warm requests are dropped, never queued, when the upstream has no room; both are counted and
logged."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from prefixgate.common.tokenizer import Tokenizer
from prefixgate.proxy.testing.otlp import OtlpReceiver
from tests.helpers import ServerThread
from tests.plugins.helpers import metrics, sample

BLOCK = 16
SYSTEM = "You are the assistant of a warm test. Answer in one short sentence. " * 4


async def test_the_warm_api_computes_the_prompt_and_answers_what_it_cached(
        make_standin, make_gateway, tmp_path):
    standin = await make_standin(tokens=5, prefix_cache=True)
    log = tmp_path / "access.log"
    gw = await make_gateway({"upstreams": [{"name": "a", "url": standin.url}],
                             "access_log": {"path": str(log)}})
    body = {"model": "standin-model", "max_tokens": 200, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "the question comes later"}]}
    answers = []
    async with aiohttp.ClientSession() as client:
        for _ in range(2):
            async with client.post(gw.url + "/v1/chat/completions", json=body,
                                   headers={"x-prefixgate-warm": "1"}) as r:
                assert r.status == 200 and r.content_type == "application/json"
                answers.append(await r.json())
        m = await metrics(client, gw)
    first, second = answers
    assert first["warmed"] is True and first["upstream"] == "a"
    assert first["prompt_tokens"] > 0 and first["cached_tokens"] == 0
    assert second["cached_tokens"] > 0.8 * second["prompt_tokens"]     # the first one warmed it
    sent = standin.requests[-1]["json"]
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    assert sample(m, "prefixgate_warm_requests_total", kind="api", outcome="warmed") == 2
    await asyncio.sleep(0.2)                  # the access log is written off the request path
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["warm"] for line in lines if line["path"] == "/v1/chat/completions"] == \
        ["api", "api"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    with ServerThread(["--model", str(tiny_llama_dir), "--dtype", "float32", "--block-size",
                       str(BLOCK), "--num-kv-blocks", "256"]) as server:
        yield server


def warm_config(engine, model_dir, warm: bool, log=None, **upstream) -> dict:
    cfg = {"upstreams": [{"name": "e", "url": engine.url, **upstream}],
           "model": {"tokenizer": str(model_dir)},
           "plugins": [{"prerender": {"block_tokens": BLOCK, "warm_next_turn": warm}}]}
    if log is not None:
        cfg["access_log"] = {"path": str(log)}
    return cfg


async def chat(client, gw, messages, stream: bool) -> tuple[str, dict]:
    """(the answer's text, its usage) of one chat through the gateway."""
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            answer = await r.json()
            return answer["choices"][0]["message"]["content"], answer["usage"]
        text, usage = [], None
        for event in (await r.read()).decode().split("\n\n"):
            if event.startswith("data: {"):
                obj = json.loads(event[6:])
                usage = obj.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in obj["choices"]]
        return "".join(text), usage


async def next_turn_cached(engine, model_dir, make_gateway, warm: bool, stream: bool,
                           tag: str, log=None) -> tuple[int, int, dict]:
    """(history tokens, the next turn's cached tokens, the gateway's metrics once the first
    turn's warm request was counted) of a two-turn conversation of its own (`tag`), with
    next-turn warming on or off. (Metrics read after the second turn may already count that
    turn's own warm request: it runs as soon as the answer ends.)"""
    gw = await make_gateway(warm_config(engine, model_dir, warm, log))
    messages = [{"role": "system", "content": f"{tag}: {SYSTEM}"},
                {"role": "user", "content": f"{tag}: tell me something"}]
    async with aiohttp.ClientSession() as client:
        text, _ = await chat(client, gw, messages, stream)
        history = messages + [{"role": "assistant", "content": text}]
        for _ in range(200):          # the warm request runs after the answer ends
            m = await metrics(client, gw)
            if not warm or sample(m, "prefixgate_warm_requests_total", kind="next_turn",
                                  outcome="warmed"):
                break
            await asyncio.sleep(0.02)
        _, usage = await chat(client, gw, history + [{"role": "user", "content": "and?"}],
                              stream)
    tok = Tokenizer.from_dir(model_dir)
    rendered = tok.encode(tok.apply_chat_template(history, add_generation_prompt=False))
    return len(rendered), usage["prompt_tokens_details"]["cached_tokens"], m


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_turn_finds_its_whole_history_cached(engine, tiny_llama_dir,
                                                             make_gateway, tmp_path, stream):
    log = tmp_path / "access.log"
    history, cached, m = await next_turn_cached(engine, tiny_llama_dir, make_gateway, True,
                                                stream, f"warm-{stream}", log)
    assert cached >= history // BLOCK * BLOCK, (history, cached)
    assert sample(m, "prefixgate_warm_requests_total", kind="next_turn", outcome="warmed") >= 1
    assert sample(m, "prefixgate_warm_tokens_total", kind="next_turn", part="prompt") == history
    _, unwarmed, _ = await next_turn_cached(engine, tiny_llama_dir, make_gateway, False, stream,
                                            f"cold-{stream}")
    assert unwarmed < cached, (unwarmed, cached)   # the answer's turn was not in the cache
    await asyncio.sleep(0.2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    warmed = [line for line in lines if line["warm"] == "next_turn"]
    assert warmed and warmed[0]["request_id"].endswith("-warm")
    assert warmed[0]["prompt_tokens"] == history and warmed[0]["status"] == 200


async def test_a_warm_request_without_room_is_dropped(engine, tiny_llama_dir, make_gateway):
    gw = await make_gateway(warm_config(engine, tiny_llama_dir, True, max_inflight=1))
    async with aiohttp.ClientSession() as client:
        await chat(client, gw, [{"role": "user", "content": "no room for warming here"}], False)
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_warm_requests_total", kind="next_turn", outcome="dropped") == 1
    assert sample(m, "prefixgate_warm_requests_total", kind="next_turn", outcome="warmed") == 0


async def test_a_warm_api_request_warms_no_next_turn(engine, tiny_llama_dir, make_gateway):
    gw = await make_gateway(warm_config(engine, tiny_llama_dir, True))
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", headers={"x-prefixgate-warm": "1"},
                               json={"messages": [{"role": "user", "content": "warm me"}]}) as r:
            assert r.status == 200 and (await r.json())["warmed"] is True
        await asyncio.sleep(0.1)
        m = await metrics(client, gw)
    assert sample(m, "prefixgate_warm_requests_total", kind="api", outcome="warmed") == 1
    assert not any(sample(m, "prefixgate_warm_requests_total", kind="next_turn", outcome=o)
                   for o in ("warmed", "dropped", "skipped", "failed"))


async def test_a_next_turn_warm_request_is_an_attempt_with_its_own_trace(
        engine, tiny_llama_dir, make_gateway, tmp_path):
    receiver = await OtlpReceiver().start()
    try:
        cfg = warm_config(engine, tiny_llama_dir, True, tmp_path / "access.log")
        cfg["tracing"] = {"otlp_endpoint": receiver.url}
        gw = await make_gateway(cfg)
        async with aiohttp.ClientSession() as client:
            await chat(client, gw, [{"role": "user", "content": "trace my warming"}], False)
            spans = await receiver.wait_for(lambda s: len(s) >= 4)
            async with client.get(gw.url + "/health") as r:
                health = await r.json()
    finally:
        await receiver.stop()
    warm_server = next(s for s in spans if s["kind"] == "SERVER"
                       and s["attributes"]["prefixgate.request_id"].endswith("-warm"))
    warm_client = next(s for s in spans if s["kind"] == "CLIENT"
                       and s["trace_id"] == warm_server["trace_id"])
    assert warm_client["name"] == "POST /v1/completions"
    assert warm_client["parent_span_id"] == warm_server["span_id"]
    assert warm_client["attributes"]["http.response.status_code"] == 200
    assert warm_server["attributes"]["gen_ai.usage.input_tokens"] > 0
    # its answer told the upstream's health, and its slot was given back
    assert health["upstreams"]["e"]["healthy"] is True
    assert gw.gateway.upstreams[0].inflight == 0
