"""prerender on Anthropic's Messages API (`/v1/messages`): the prompt rendered is the one vLLM
renders of the request — the chat request it converts it to (common/anthropic_messages.py),
shaped as its chat path hands messages and tools to the template, inline system messages
merged only for a template that needs its system first, thinking turned off through the
template's own switch —; its token ids equal the bundled engine's chat render of the same
conversation, reach every plugin after it, and key routing like a chat's; a Messages answer,
whole or streamed, warms the next turn as the client will send it."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from prefixgate.backend.demo import write_tokenizer_files
from prefixgate.common.anthropic_messages import to_chat
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.prerender import (
    PromptCache,
    anthropic_answer_message,
    messages_chat,
    needs_system_first,
)
from tests.helpers import QWEN_STYLE_TEMPLATE, ServerThread, make_tiny_model, tiny_tokenizer
from tests.plugins.helpers import Recorder, metrics, sample

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 6
TOOLS = [{"name": "read_file", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}},
         {"name": "run", "input_schema": {"type": "object"}, "strict": True}]
# a Claude Code turn: billing header in the system blocks, a tool call and its result
BODY = {"model": "tiny", "max_tokens": 8, "tools": TOOLS,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=9f"},
                   {"type": "text", "text": SYSTEM}],
        "messages": [
            {"role": "user", "content": "Show me the README."},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "read_file",
                 "input": {"path": "README.md"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "# prefixgate"}]}]}]}

# Qwen's own guard: a system message anywhere but first is an error
SYSTEM_FIRST_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a template with a thinking switch (Qwen3's `enable_thinking`)
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")


def _tok(tmp_path_factory, template: str) -> Tokenizer:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d, tiny_tokenizer(), chat_template=template)
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return _tok(tmp_path_factory, QWEN_STYLE_TEMPLATE)


def test_the_conversation_is_shaped_as_vllms_chat_path_hands_it_over(qwen_tok):
    body = {**BODY, "messages": [
        *BODY["messages"],
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look closer", "signature": "s"},
            {"type": "text", "text": "It is short."},
            {"type": "tool_use", "id": "toolu_2", "name": "run", "input": {"cmd": "ls é"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "a\nb"},
            {"type": "text", "text": "<system-reminder>keep going</system-reminder>"},
            {"type": "text", "text": "And now?"}]}]}
    messages, tools, kwargs = messages_chat(body, PromptCache(qwen_tok))
    assert messages == [
        {"role": "system", "content": SYSTEM},            # the billing header dropped
        {"role": "user", "content": "Show me the README."},
        {"role": "assistant", "content": "", "tool_calls": [{    # arguments: a mapping
            "id": "toolu_1", "type": "function",
            "function": {"name": "read_file", "arguments": {"path": "README.md"}}}]},
        {"role": "tool", "content": "# prefixgate", "tool_call_id": "toolu_1"},
        {"role": "assistant", "content": "It is short.", "tool_calls": [{
            "id": "toolu_2", "type": "function",
            "function": {"name": "run", "arguments": {"cmd": "ls é"}}}],
         "reasoning": "look closer", "reasoning_content": "look closer"},
        {"role": "tool", "content": "a\nb", "tool_call_id": "toolu_2"},
        # text blocks joined with "\n", as vLLM joins a message's text parts
        {"role": "user", "content": "<system-reminder>keep going</system-reminder>\nAnd now?"}]
    # ChatCompletionToolsParam.model_dump(): description and parameters always, strict when set
    assert tools == [
        {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                          "parameters": TOOLS[0]["input_schema"]}},
        {"type": "function", "function": {"name": "run", "description": None,
                                          "parameters": {"type": "object"}, "strict": True}}]
    assert kwargs == {}
    image = {**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}
    assert messages_chat(image, PromptCache(qwen_tok)) is None     # not text: not rendered


def test_inline_system_messages_merge_only_where_the_template_needs_system_first(
        tmp_path_factory, qwen_tok):
    first = _tok(tmp_path_factory, SYSTEM_FIRST_TEMPLATE)
    assert needs_system_first(first) and not needs_system_first(qwen_tok)
    body = {**BODY, "messages": [{"role": "user", "content": "hi"},
                                 {"role": "system", "content": "Reminder: be brief."},
                                 {"role": "user", "content": "go"}]}
    merged, _, _ = messages_chat(body, PromptCache(first))
    kept, _, _ = messages_chat(body, PromptCache(qwen_tok))
    assert [m["role"] for m in merged] == ["system", "user", "user"]
    assert merged[0]["content"] == SYSTEM + "Reminder: be brief."
    assert [m["role"] for m in kept] == ["system", "user", "system", "user"]
    first.apply_chat_template(merged)           # renders; the unmerged one would not


def test_thinking_off_goes_through_the_templates_own_switch(tmp_path_factory, qwen_tok):
    off = {**BODY, "thinking": {"type": "disabled"}}
    switch = PromptCache(_tok(tmp_path_factory, THINKING_TEMPLATE))
    _, _, kwargs = messages_chat(off, switch)
    assert kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    # a template without the switch renders "none" like an effort: vLLM then sends "low"
    _, _, kwargs = messages_chat(off, PromptCache(qwen_tok))
    assert kwargs == {"reasoning_effort": "low", "enable_thinking": True}
    _, _, kwargs = messages_chat({**BODY, "output_config": {"effort": "high"},
                                  "chat_template_kwargs": {"enable_thinking": False,
                                                           "add_generation_prompt": False}},
                                 switch)
    assert kwargs == {"enable_thinking": False, "reasoning_effort": "high"}


# --- through the gateway ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("qwen"), "qwen2")
    write_tokenizer_files(d, tiny_tokenizer(), chat_template=QWEN_STYLE_TEMPLATE)
    return d


@pytest.fixture(scope="module")
def engine(qwen_model):
    with ServerThread(["--model", str(qwen_model), "--max-model-len", "2048",
                       "--served-model-name", "tiny"]) as s:
        yield s


async def test_token_ids_equal_the_bundled_engines_chat_render(engine, qwen_model,
                                                               make_gateway):
    gw = await make_gateway({"upstreams": [{"name": "e", "url": engine.url}],
                             "model": {"tokenizer": str(qwen_model)},
                             "plugins": [{"prerender": {"block_tokens": 16}},
                                         {"tests.plugins.helpers:Recorder": {}},
                                         {"prefix_route": {"block_tokens": 16}}]})
    Recorder.seen.clear()
    body = BODY
    chat = to_chat(body)
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/messages", json=body) as r:
            await r.read()
            route = r.headers["x-prefixgate-route"]
        async with client.post(engine.url + "/tokenize", json={
                "model": "tiny", "messages": chat["messages"], "tools": chat["tools"]}) as r:
            assert r.status == 200, await r.text()
            expected = (await r.json())["tokens"]
        m = await metrics(client, gw)
    (seen,) = Recorder.seen
    path, tokens, hashes = seen.path, seen.tokens, seen.block_hashes
    assert path == "/v1/messages" and tokens == expected and len(tokens) > 100
    assert hashes == block_hash_chain(expected, 16)
    assert f"blocks={len(tokens) // 16}" in route          # prefix_route keyed on them
    assert sample(m, "prefixgate_prerender_prefix_cache_total", result="miss") == 1


async def test_a_messages_answer_warms_the_next_turn_as_the_client_sends_it(
        qwen_model, make_standin, make_gateway):
    up = await make_standin(tokens=6)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "model": {"tokenizer": str(qwen_model)},
                             "plugins": [{"prerender": {"warm_next_turn": True}}]})
    cache = PromptCache(Tokenizer.from_dir(qwen_model))
    warmed, replies = [], []
    async with aiohttp.ClientSession() as client:
        for stream in (False, True):
            body = {**BODY, "model": "standin-model", "stream": stream}
            async with client.post(gw.url + "/v1/messages", json=body) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            answer = json.loads(raw) if not stream else None
            reply = anthropic_answer_message(answer, [raw])
            assert reply["content"][0]["type"] == "text" and reply["content"][0]["text"]
            replies.append(reply)
            inputs = messages_chat({**body, "messages": [*BODY["messages"], reply]}, cache)
            expected = cache.render(*inputs[:2], False, inputs[2]).tokens
            for _ in range(200):
                sent = [q["json"]["prompt"] for q in up.requests
                        if q["path"] == "/v1/completions"]
                if len(sent) > len(warmed):
                    break
                await asyncio.sleep(0.02)
            warmed = sent
            assert warmed[-1] == expected
        m = await metrics(client, gw)
    assert replies[0] == replies[1]         # the stream's blocks rebuilt: the whole answer's
    assert sample(m, "prefixgate_warm_requests_total", kind="next_turn", outcome="warmed") == 2
