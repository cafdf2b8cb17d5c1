"""Chat as token ids: the engine's answer to the token-id completion, turned back into chat,
equals its answer to the chat request itself (greedy), whole and streamed."""
from __future__ import annotations

import json
import random

import aiohttp
import pytest

from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.prerender import PromptCache
from prefixgate.proxy.token_forward import (
    ChatFromCompletions,
    chat_to_completions,
    completion_to_chat,
    eligible,
)
from tests.helpers import ServerThread, make_tiny_model

MESSAGES = [{"role": "system", "content": "You are brief. " * 20},
            {"role": "user", "content": "Hello there! 你好"}]
CHAT = {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fwd"), "qwen2")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(["--model", str(model_dir), "--served-model-name", "tiny"]) as s:
        yield s


def _tokens(model_dir) -> list[int]:
    return PromptCache(Tokenizer.from_dir(model_dir)).render(MESSAGES).tokens


def test_only_plain_chats_are_eligible():
    assert eligible(CHAT)
    assert not eligible({**CHAT, "tools": [{"type": "function"}]})
    assert not eligible({**CHAT, "response_format": {"type": "json_object"}})
    assert not eligible({**CHAT, "logprobs": True})
    assert not eligible({**CHAT, "n": 2})
    assert not eligible({"model": "standin-model", "prompt": "x"})
    assert not eligible({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]})
    body = chat_to_completions(CHAT, [1, 2, 3])
    assert body == {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "prompt": [1, 2, 3]}


async def test_whole_answer_matches_the_chat_endpoint(server, model_dir):
    async with aiohttp.ClientSession() as client:
        async with client.post(server.url + "/v1/chat/completions", json=CHAT) as r:
            direct = await r.json()
        body = chat_to_completions(CHAT, _tokens(model_dir))
        async with client.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            converted = completion_to_chat(await r.json())
    assert converted["object"] == "chat.completion"
    assert converted["choices"][0]["message"] == direct["choices"][0]["message"]
    assert converted["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]
    assert converted["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]


async def test_streamed_answer_matches_the_chat_endpoint(server, model_dir):
    stream = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as client:
        async with client.post(server.url + "/v1/chat/completions", json=stream) as r:
            direct = await r.read()
        body = chat_to_completions(stream, _tokens(model_dir))
        async with client.post(server.url + "/v1/completions", json=body) as r:
            raw = await r.read()
    conv, out, rng, i = ChatFromCompletions(), [], random.Random(0), 0
    while i < len(raw):                        # bytes split at arbitrary places
        step = rng.randint(1, 40)
        out.append(conv.feed(raw[i:i + step]))
        i += step
    out.append(conv.flush())
    converted = b"".join(out)

    def events(data):
        return [e[6:] for e in data.split(b"\n\n") if e]

    a, b = events(direct), events(converted)
    assert a[-1] == b[-1] == b"[DONE]"
    a, b = [json.loads(x) for x in a[:-1]], [json.loads(x) for x in b[:-1]]
    assert all(x["object"] == "chat.completion.chunk" for x in b)

    def text(evs):
        return "".join(c["delta"].get("content") or "" for x in evs for c in x["choices"])

    def finish(evs):
        return [c["finish_reason"] for x in evs for c in x["choices"] if c["finish_reason"]]

    assert text(b) == text(a) and text(b)
    assert b[0]["choices"][0]["delta"]["role"] == "assistant"
    assert finish(a) == finish(b)
    assert b[-1]["usage"]["prompt_tokens"] == a[-1]["usage"]["prompt_tokens"]


def test_errors_and_unknown_events_pass_unchanged():
    conv = ChatFromCompletions()
    err = b'data: {"error": {"message": "x", "type": "server_error", "code": null}}\n\n'
    assert conv.feed(err + b": keep-alive\n\n") == err + b": keep-alive\n\n"
    assert completion_to_chat({"error": {"message": "x"}}) == {"error": {"message": "x"}}


async def test_gateway_forwards_tokens_and_answers_in_chat_form(server, model_dir, make_gateway):
    """prerender + `forward: tokens` through the real gateway to the real engine."""
    gw = await make_gateway({"upstreams": [{"name": "engine", "url": server.url,
                                            "forward": "tokens"}],
                             "model": {"tokenizer": str(model_dir)},
                             "plugins": [{"prerender": {}}]})
    async with aiohttp.ClientSession() as client:
        async with client.post(server.url + "/v1/chat/completions", json=CHAT) as r:
            direct = await r.json()
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            proxied = await r.json()
        stream = {**CHAT, "stream": True}
        async with client.post(gw.url + "/v1/chat/completions", json=stream) as r:
            assert r.status == 200
            raw = await r.read()
        metrics = await (await client.get(server.url + "/metrics")).text()
    assert proxied["object"] == "chat.completion"
    assert proxied["choices"][0]["message"] == direct["choices"][0]["message"]
    events = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == direct["choices"][0]["message"]["content"]
    assert raw.endswith(b"data: [DONE]\n\n")
    assert "prefixgate:prefix_cache_hits" in metrics


async def test_forward_tokens_leaves_tool_requests_in_chat_form(make_standin, make_gateway,
                                                               model_dir):
    up = await make_standin(model="tiny")
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url, "forward": "tokens"}],
                             "model": {"tokenizer": str(model_dir)},
                             "plugins": [{"prerender": {}}]})
    async with aiohttp.ClientSession() as client:
        for extra in ({}, {"tools": [{"type": "function", "function": {"name": "f"}}]}):
            async with client.post(gw.url + "/v1/chat/completions", json={**CHAT, **extra}) as r:
                assert r.status == 200
                body = await r.json()
                assert body["object"] == "chat.completion"
    plain, tools = up.requests
    assert plain["path"] == "/v1/completions" and isinstance(plain["json"]["prompt"], list)
    assert all(isinstance(t, int) for t in plain["json"]["prompt"])
    assert tools["path"] == "/v1/chat/completions" and "messages" in tools["json"]
