"""Coding-agent traffic through the gateway in front of real vLLM, with the clients agents use:
the `anthropic` SDK on /v1/messages (streamed and whole, tools, a tool_use and its tool_result,
count_tokens, errors) with the whole chain on it, and the `openai` SDK with `prompt_cache_key`
on chat and responses (vLLM takes the field)."""
from __future__ import annotations

import json

import aiohttp
import anthropic
import openai
import pytest

from prefixgate.proxy.testing.vllm_install import prepare_model
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.helpers import READ_FILE, READS_README, upstreams

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

TOOLS = [READ_FILE]
SYSTEM = [{"type": "text", "text": "You are a coding agent. Answer in one short sentence. " * 8,
           "cache_control": {"type": "ephemeral"}}]
HISTORY = [
    {"role": "user", "content": "What does the README say?"},
    READS_README,
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_01",
         "content": "prefixgate cuts time to first token."},
        {"type": "text", "text": "Summarize it."}]},
]


@pytest.fixture
async def gw(vllm_pair, make_gateway):
    return await make_gateway({
        "upstreams": upstreams(vllm_pair),
        "model": {"tokenizer": str(prepare_model())},
        "plugins": [{"normalize": {}}, {"prerender": {}},
                    {"prefix_route": {"policy": "predicted_ttft"}}, {"metrics": {}}]})


async def test_messages_with_tools_streamed_and_whole_through_the_chain(gw):
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
    ask = {"model": SERVED_NAME, "max_tokens": 12, "system": SYSTEM, "tools": TOOLS,
           "messages": HISTORY, "extra_body": {"temperature": 0}}
    whole = await client.messages.with_raw_response.create(**ask)
    message = await whole.parse()
    assert message.type == "message" and message.content
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert whole.headers["x-prefixgate-route"].startswith("predicted_ttft")
    async with client.messages.stream(**ask) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    # the same prompt again: the gateway sent it where its prefix was cached
    assert final.usage.cache_read_input_tokens > 0
    counted = await client.messages.count_tokens(model=SERVED_NAME, system=SYSTEM, tools=TOOLS,
                                                 messages=HISTORY)
    assert counted.input_tokens == (final.usage.input_tokens
                                    + final.usage.cache_read_input_tokens)


async def test_messages_errors_are_anthropics(gw):
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:          # vLLM's own, passed through
        await client.messages.create(model="no-such-model", max_tokens=8, messages=HISTORY)
    assert e.value.body["type"] == "error"
    async with aiohttp.ClientSession() as http:     # the gateway's own check (the SDK's too)
        async with http.post(gw.url + "/v1/messages",
                             json={"model": SERVED_NAME, "messages": HISTORY}) as r:
            body = await r.json()
    assert r.status == 400 and body["error"]["type"] == "invalid_request_error"


async def test_prompt_cache_key_on_chat_and_responses(gw):
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    homes = set()
    for question in ("What is 2 + 2?", "And 3 + 3?"):
        chat = await client.chat.completions.with_raw_response.create(
            model=SERVED_NAME, max_tokens=4, temperature=0, prompt_cache_key="conversation-7",
            messages=[{"role": "user", "content": question}])
        assert chat.parse().choices[0].message.content is not None
        homes.add(chat.headers["x-prefixgate-upstream"])
    response = await client.responses.with_raw_response.create(
        model=SERVED_NAME, input="Hello", max_output_tokens=4, prompt_cache_key="conversation-7")
    homes.add(response.headers["x-prefixgate-upstream"])
    assert json.loads(response.content)["status"] in ("completed", "incomplete")
    assert len(homes) == 1          # one key, one backend
