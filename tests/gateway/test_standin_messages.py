"""The stand-in's Anthropic Messages API (proxy/testing/standin.py) against the `anthropic` SDK:
whole and streamed answers shaped as vLLM 0.32 converts its chat answers, the modelled prefix
cache reported as vLLM reports it, count_tokens over the chat conversion, errors in
Anthropic's shape, and what it received recorded with its chat conversion."""
from __future__ import annotations

import time

import aiohttp
import anthropic
import pytest

from prefixgate.common import sse
from prefixgate.common.anthropic_messages import to_chat

SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 30},
          {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
MESSAGES = [
    {"role": "user", "content": "Fix the bug."},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "print(1)"},
        {"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}}]},
]


def client_for(standin) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=standin.url, api_key="unused", max_retries=0)


async def test_a_whole_message_and_count_tokens_agree(make_standin):
    standin = await make_standin(tokens=5)
    client = client_for(standin)
    message = await client.messages.create(model="standin-model", max_tokens=32, system=SYSTEM,
                                           tools=TOOLS, messages=MESSAGES)
    assert message.type == "message" and message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "tok0 tok1 tok2 tok3 tok4 "
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 5
    # no prefix cache modelled: no cache fields, as vLLM without prompt-token details
    assert message.usage.cache_read_input_tokens is None
    counted = await client.messages.count_tokens(model="standin-model", system=SYSTEM,
                                                 tools=TOOLS, messages=MESSAGES)
    assert counted.input_tokens == message.usage.input_tokens > 100
    short = await client.messages.create(model="standin-model", max_tokens=2,
                                         messages=MESSAGES)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    # recorded as received, with the chat request vLLM would make of it
    first = standin.requests[0]
    assert first["path"] == "/v1/messages" and first["json"]["tools"] == TOOLS
    assert first["chat"] == to_chat(first["json"])
    assert [m["role"] for m in first["chat"]["messages"]] == [
        "system", "user", "assistant", "tool", "user"]
    assert standin.requests[1]["path"] == "/v1/messages/count_tokens"


async def test_a_streamed_message_in_vllms_event_order_with_the_cache_in_its_usage(
        make_standin):
    standin = await make_standin(tokens=4, first_delay=0.2, gap=0.1, prefix_cache=True)
    client = client_for(standin)
    finals = []
    for _ in range(2):                             # the second finds the prefix cached
        kinds, started, first_delta = [], time.monotonic(), None
        async with client.messages.stream(model="standin-model", max_tokens=64, system=SYSTEM,
                                          tools=TOOLS, messages=MESSAGES) as stream:
            async for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and first_delta is None:
                    first_delta = time.monotonic() - started
            finals.append(await stream.get_final_message())
        assert first_delta >= 0.15                     # its first_delay applies
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    cold, warm = finals
    assert warm.content[0].text == "tok0 tok1 tok2 tok3 " and warm.stop_reason == "end_turn"
    prompt = cold.usage.input_tokens + cold.usage.cache_read_input_tokens
    assert cold.usage.cache_read_input_tokens == 0
    # input_tokens = prompt - cached, as vLLM's _build_anthropic_usage reports it
    assert warm.usage.cache_read_input_tokens > 0.9 * prompt
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens == prompt
    assert warm.usage.output_tokens == 4


async def test_the_streams_bytes_are_vllms(make_standin):
    standin = await make_standin(tokens=2, prefix_cache=True)
    body = {"model": "standin-model", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as http:
        async with http.post(standin.url + "/v1/messages", json=body) as r:
            assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            raw = await r.read()
    events = [sse.parse(e) for e in sse.events_in([raw])]
    assert [e.event for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert events[0].data == (
        b'{"type":"message_start","message":{"id":"chatcmpl-standin","type":"message",'
        b'"role":"assistant","content":[],"model":"standin-model","stop_reason":null,'
        b'"stop_sequence":null,"usage":{"input_tokens":2,"output_tokens":0}}}')
    assert events[1].data == (b'{"type":"content_block_start","content_block":'
                              b'{"type":"text","text":""},"index":0}')
    assert events[2].data == (b'{"type":"content_block_delta","delta":{"type":"text_delta",'
                              b'"text":"tok0 "},"index":0}')
    assert events[4].data == b'{"type":"content_block_stop","index":0}'
    assert events[5].data == (b'{"type":"message_delta","delta":{"stop_reason":"max_tokens",'
                              b'"stop_sequence":null},"usage":{"input_tokens":2,'
                              b'"output_tokens":2,"cache_read_input_tokens":0}}')
    assert events[6].data == b'{"type":"message_stop"}'


@pytest.mark.parametrize("body,status,kind,words", [
    ({"model": "standin-model", "messages": MESSAGES}, 400, "invalid_request_error",
     "body.max_tokens"),
    ({"model": "standin-model", "max_tokens": 8, "messages": [{"role": "user"}]}, 400,
     "invalid_request_error", "body.messages.0.content"),
    ({"model": "other-model", "max_tokens": 8, "messages": MESSAGES}, 404, "NotFoundError",
     "The model `other-model` does not exist"),
])
async def test_errors_in_anthropics_shape(make_standin, body, status, kind, words):
    standin = await make_standin(models=["standin-model"])
    async with aiohttp.ClientSession() as http:
        async with http.post(standin.url + "/v1/messages", json=body) as r:
            payload = await r.json()
    assert r.status == status and set(payload) == {"type", "error"}, payload
    assert payload["type"] == "error" and payload["error"]["type"] == kind
    assert words in payload["error"]["message"]
    assert standin.requests[-1]["json"] == body


async def test_the_sdk_raises_on_a_failing_stand_in(make_standin):
    standin = await make_standin(fail="status", status=503)
    with pytest.raises(anthropic.APIStatusError) as e:
        await client_for(standin).messages.create(model="standin-model", max_tokens=8,
                                                  messages=MESSAGES)
    assert e.value.status_code == 503
    assert e.value.body == {"type": "error", "error": {"type": "ServiceUnavailableError",
                                                       "message": "stand-in failure"}}
    with pytest.raises(anthropic.NotFoundError):
        await client_for(await make_standin(models=["a"])).messages.count_tokens(
            model="b", messages=MESSAGES)
