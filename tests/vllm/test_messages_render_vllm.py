"""prerender on `/v1/messages` against real vLLM: the token ids the gateway computes for a
Messages request (a system prompt with Claude Code's billing header, tools, a tool_use and its
tool_result, a message of several text blocks, an inline system reminder) are the ids vLLM
computes — its `/tokenize` of the chat request it converts the Messages request to, and its
own `/v1/messages/count_tokens` of the request itself."""
from __future__ import annotations

import json

import aiohttp
import pytest

from prefixgate.common.anthropic_messages import to_chat
from prefixgate.proxy.testing.vllm_install import prepare_model
from tests.plugins.helpers import Recorder
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.helpers import READ_FILE, READS_README, send

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BODY = {
    "model": SERVED_NAME, "max_tokens": 4, "temperature": 0,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.90; cch=7e"},
               {"type": "text", "text": "You are a coding agent in a Python repository. " * 6,
                "cache_control": {"type": "ephemeral"}}],
    "tools": [READ_FILE, {"name": "list_dir", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Use the tools.</system-reminder>"},
            {"type": "text", "text": "What does the README say?"}]},
        READS_README,
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "prefixgate cuts time to first token."}]},
            {"type": "text", "text": "Summarize it."}]},
        {"role": "system", "content": "Reminder: answer briefly."},
        {"role": "user", "content": "Go on."}]}


async def test_messages_token_ids_are_vllms(vllm_pair, make_gateway):
    server = vllm_pair[0]
    gw = await make_gateway({"upstreams": [{"name": "vllm0", "url": server.url}],
                             "model": {"tokenizer": str(prepare_model())},
                             "plugins": [{"prerender": {}},
                                         {"tests.plugins.helpers:Recorder": {}}]})
    Recorder.seen.clear()
    chat = to_chat(BODY)    # SmolLM2's template takes inline system messages: none merged
    counted = {k: v for k, v in BODY.items() if k not in ("max_tokens", "temperature")}
    async with aiohttp.ClientSession() as client:
        answer = await send(client, gw.url, "/v1/messages", BODY)
        tokenized = await send(client, server.url, "/tokenize", {
            "model": SERVED_NAME, "messages": chat["messages"], "tools": chat["tools"]})
        count = await send(client, server.url, "/v1/messages/count_tokens", counted)
    assert answer.status == 200, answer.raw
    assert json.loads(answer.raw)["type"] == "message"
    assert tokenized.status == 200 and count.status == 200, (tokenized.raw, count.raw)
    (seen,) = Recorder.seen
    tokens = seen.tokens
    assert tokens == json.loads(tokenized.raw)["tokens"]
    assert len(tokens) == json.loads(count.raw)["input_tokens"]
    usage = json.loads(answer.raw)["usage"]       # the prompt vLLM answered: the same length
    assert sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                           "cache_creation_input_tokens")) == len(tokens)
