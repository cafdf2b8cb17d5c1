"""Anthropic's Messages API on the bundled engine, as Claude-Code-style clients see it: the
`anthropic` SDK against the engine's `/v1/messages` and `/v1/messages/count_tokens` (text,
whole and streamed, the stream helper, system prompts, tool definitions and a tool-use
history, usage with cache reads, stop sequences, errors in Anthropic's shape); tool use with
the model's output fixed; and the answer converters of common/anthropic_answers.py on chat
answers recorded as the engine and vLLM send them."""
from __future__ import annotations

import dataclasses
import json
import uuid

import aiohttp
import anthropic
import openai
import pytest
from anthropic.lib.streaming._messages import accumulate_event

from prefixgate.common.anthropic_answers import (
    MessageStream,
    count_tokens_answer,
    message_of,
    stop_reason_of,
    usage_of,
)
from prefixgate.common.anthropic_messages import to_chat
from tests.helpers import ServerThread

MAX_LEN = 1024
GREEDY = {"temperature": 0}
SYSTEM = "You are a terse assistant. Answer in one short sentence, and never use lists."
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(["--model", str(model_dir), "--max-model-len", str(MAX_LEN),
                       "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture
def client(server):
    return anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def fresh(text: str = "Hello there!") -> list[dict]:
    """A prompt no earlier request has put in the prefix cache."""
    return user(f"{text} ({uuid.uuid4().hex})")


# --- text ------------------------------------------------------------------------------------

async def test_whole_message_is_the_chat_answer_in_anthropic_shape(client, server):
    messages = fresh()
    msg = await client.messages.create(model="tiny", max_tokens=10, system=SYSTEM,
                                       messages=messages, extra_body=GREEDY)
    assert (msg.type, msg.role, msg.model) == ("message", "assistant", "tiny")
    assert msg.content and msg.content[0].type == "text"
    assert msg.stop_reason in ("max_tokens", "end_turn") and msg.stop_sequence is None
    chat = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    same = await chat.chat.completions.create(
        model="tiny", max_tokens=10, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *messages])
    assert msg.content[0].text == same.choices[0].message.content
    assert msg.usage.output_tokens == same.usage.completion_tokens
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        same.choices[0].finish_reason]


async def test_usage_counts_cache_reads_and_count_tokens_is_the_prompt(client):
    kwargs = dict(model="tiny", system=f"{uuid.uuid4().hex} {SYSTEM}",   # nothing cached yet
                  messages=user("Tell me about the fox " * 8))
    counted = await client.messages.count_tokens(**kwargs)
    first = await client.messages.create(max_tokens=4, **kwargs, extra_body=GREEDY)
    second = await client.messages.create(max_tokens=4, **kwargs, extra_body=GREEDY)
    for msg in (first, second):
        assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted.input_tokens
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_read_input_tokens % 16 == 0        # whole KV blocks
    assert second.content[0].text == first.content[0].text


async def test_text_blocks_join_with_newlines_as_vllm_renders_them(client):
    blocks = [{"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
              {"type": "text", "text": "Fix the bug."}]
    counts = [(await client.messages.count_tokens(model="tiny", messages=[
        {"role": "user", "content": content}])).input_tokens
        for content in (blocks, "\n".join(b["text"] for b in blocks))]
    assert counts[0] == counts[1]


async def test_count_tokens_answers_as_vllm(server):
    body = {"model": "tiny", "messages": user("Hello")}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/messages/count_tokens", json=body) as r:
            assert r.status == 200
            answer = await r.json()
    n = answer["input_tokens"]
    assert n > 0 and answer == {"input_tokens": n,
                                "context_management": {"original_input_tokens": n}}


async def test_streamed_message_events_in_order_and_equal_to_the_whole(client):
    kwargs = dict(model="tiny", max_tokens=10, system=SYSTEM, messages=fresh(),
                  extra_body=GREEDY)
    whole = await client.messages.create(**kwargs)
    events = [e async for e in await client.messages.create(**kwargs, stream=True)]
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 5) \
        + ["content_block_stop"]
    start = events[0].message
    assert (start.id, start.model, start.content) == (start.id, "tiny", [])
    # message_start carries the prompt as it is known before the cache is consulted (vLLM's)
    assert start.usage.input_tokens == whole.usage.input_tokens + \
        whole.usage.cache_read_input_tokens and start.usage.output_tokens == 0
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    end = events[-2]
    assert end.delta.stop_reason == whole.stop_reason
    assert end.usage.output_tokens == whole.usage.output_tokens
    assert end.usage.cache_read_input_tokens is not None


async def test_the_sdk_stream_helper_gives_the_final_message(client):
    kwargs = dict(model="tiny", max_tokens=8, messages=fresh(), extra_body=GREEDY)
    whole = await client.messages.create(**kwargs)
    async with client.messages.stream(**kwargs) as stream:
        pieces = [t async for t in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_events_on_the_wire(server):
    body = {"model": "tiny", "max_tokens": 3, "stream": True, "messages": fresh(), **GREEDY}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/messages", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    for event in events[:-1]:
        name, data = event.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == name[7:]


async def test_system_as_blocks_with_cache_control_equals_system_as_text(client):
    messages = fresh()
    blocks = [{"type": "text", "text": SYSTEM[:20], "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": SYSTEM[20:]}]
    as_text = await client.messages.create(model="tiny", max_tokens=6, system=SYSTEM,
                                           messages=messages, extra_body=GREEDY)
    as_blocks = await client.messages.create(
        model="tiny", max_tokens=6, system=blocks, messages=messages, metadata={"user_id": "u1"},
        extra_body={**GREEDY, "prompt_cache_key": "k"}, extra_headers={"anthropic-version": "x"})
    assert as_blocks.content[0].text == as_text.content[0].text
    count = [(await client.messages.count_tokens(model="tiny", system=system,
                                                 messages=messages)).input_tokens
             for system in (SYSTEM, blocks)]
    assert count[0] == count[1] == as_text.usage.input_tokens + \
        as_text.usage.cache_read_input_tokens


async def test_tool_definitions_and_a_tool_use_history_are_accepted(client):
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "Sunny, 21 C"}]},
            {"type": "text", "text": "Thanks. And tomorrow?",
             "cache_control": {"type": "ephemeral"}}]},
    ]
    msg = await client.messages.create(model="tiny", max_tokens=5, tools=TOOLS,
                                       tool_choice={"type": "auto"}, messages=history,
                                       extra_body=GREEDY)
    assert msg.content and msg.stop_reason in ("max_tokens", "end_turn", "tool_use")
    with_tools = await client.messages.count_tokens(model="tiny", tools=TOOLS, messages=history)
    without = await client.messages.count_tokens(model="tiny", messages=history)
    assert with_tools.input_tokens > without.input_tokens
    # Anthropic's total: the block marked with cache_control makes its prefix cache creation
    usage = msg.usage
    assert usage.cache_creation_input_tokens > 0
    assert with_tools.input_tokens == (usage.input_tokens + usage.cache_read_input_tokens
                                       + usage.cache_creation_input_tokens)


async def test_a_stop_sequence_is_reported(client):
    messages = fresh()
    full = (await client.messages.create(model="tiny", max_tokens=16, messages=messages,
                                         extra_body=GREEDY)).content[0].text
    words = [w for w in full.split() if len(w) >= 2]
    if not words:
        pytest.skip(f"the tiny model's answer has no word to stop on: {full!r}")
    stop = words[-1][:2]
    cut = full[:full.index(stop)]
    msg = await client.messages.create(model="tiny", max_tokens=16, messages=messages,
                                       stop_sequences=[stop], extra_body=GREEDY)
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert msg.content[0].text == cut if cut else msg.content[0].text == ""
    async with client.messages.stream(model="tiny", max_tokens=16, messages=messages,
                                      stop_sequences=[stop], extra_body=GREEDY) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("template,merge", [
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", False),
    ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
     "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
     "{{ m.content }}{% endfor %}", True),
    ("{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}{% endfor %}", True),
    ({"default": "{% for m in messages %}{{ m.content }}{% endfor %}",
      "tool_use": "{{ raise_exception('system first') }}"}, True),
    (None, True),
])
def test_inline_system_messages_merge_when_the_template_needs_system_first(model_dir, template,
                                                                          merge):
    """As vLLM probes it: render [system, user, system, user] in a bare sandbox, with the
    template used with and without tools; one that fails (calling a template global such as
    strftime_now fails too), or no template, merges them into the leading system message."""
    from types import SimpleNamespace

    from prefixgate.backend.server import EngineServer
    from prefixgate.common.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    tok.chat_template = template
    probe = SimpleNamespace(core=SimpleNamespace(tokenizer=tok), _merge_system=None)
    assert EngineServer.merge_inline_system(probe) is merge


# --- errors ----------------------------------------------------------------------------------

def anthropic_error(e: anthropic.APIStatusError, kind: str, needle: str) -> None:
    assert e.body["type"] == "error" and set(e.body) == {"type", "error"}
    assert e.body["error"]["type"] == kind and needle in e.body["error"]["message"]


async def test_a_missing_max_tokens_is_a_typed_400_naming_it(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.post("/v1/messages", cast_to=anthropic.types.Message,
                          body={"model": "tiny", "messages": user("hi")})
    anthropic_error(err.value, "invalid_request_error", "'max_tokens'")


@pytest.mark.parametrize("messages,needle", [
    ("hello", "'messages'"),
    ([{"role": "robot", "content": "hi"}], "'messages[0].role'"),
    ([{"role": "user", "content": 42}], "'messages[0].content'"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "'messages[0].content'"),
])
async def test_bad_messages_are_typed_400s_naming_the_field(client, messages, needle):
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.messages.create(model="tiny", max_tokens=4, messages=messages)
    anthropic_error(err.value, "invalid_request_error", needle)


async def test_an_unknown_model_is_a_typed_404(client):
    with pytest.raises(anthropic.NotFoundError) as err:
        await client.messages.create(model="claude-sonnet-4", max_tokens=4, messages=user("hi"))
    anthropic_error(err.value, "not_found_error", "claude-sonnet-4")
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="claude-sonnet-4", messages=user("hi"))


async def test_a_missing_model_is_a_typed_400(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        await client.post("/v1/messages/count_tokens", cast_to=dict,
                          body={"messages": user("hi")})
    anthropic_error(err.value, "invalid_request_error", "'model'")


# --- tool use, with the model's output fixed ---------------------------------------------------

class Scripted:
    """The engine's real output stream for a request, its text replaced by `pieces` (one per
    output; what is left joins the last) and its finish by `finish_reason`."""

    def __init__(self, real, pieces: list[str], finish_reason: str):
        self.real, self.pieces, self.finish_reason = real, list(pieces), finish_reason

    def __getattr__(self, name):            # request_id, completed, close()
        return getattr(self.real, name)

    def __aiter__(self):
        return self

    async def __anext__(self):
        out = await self.real.__anext__()
        if out.finished:
            text, self.pieces = "".join(self.pieces), []
            return dataclasses.replace(out, text=text, finish_reason=self.finish_reason)
        return dataclasses.replace(out, text=self.pieces.pop(0) if self.pieces else "")


@pytest.fixture
def scripted(server, monkeypatch):
    """scripted(pieces, finish_reason): the engine's next answers say `pieces`."""
    engine = server.server.engine
    real = engine.generate

    def use(pieces: list[str], finish_reason: str = "stop"):
        monkeypatch.setattr(engine, "generate", lambda *a, **kw: Scripted(
            real(*a, **kw), pieces, finish_reason), raising=False)
    return use


CALL_TEXT = ['Let me', ' check.', '<tool', '_call>\n{"name": "get_weather", ',
             '"arguments": {"city": ', '"Paris"}}\n</tool_call>', '\n']
TOOL_KW = dict(model="tiny", max_tokens=len(CALL_TEXT) + 1, tools=TOOLS,
               messages=user("Weather in Paris?"), extra_body={**GREEDY, "ignore_eos": True})


async def test_a_tool_call_in_a_whole_answer_is_a_tool_use_block(client, scripted):
    scripted(CALL_TEXT)
    msg = await client.messages.create(**TOOL_KW)
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    assert msg.content[0].text == "Let me check."
    call = msg.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("chatcmpl-tool-") and msg.stop_reason == "tool_use"


async def test_a_tool_call_in_a_stream_goes_out_when_it_closes(client, scripted):
    scripted(CALL_TEXT)
    events = [e async for e in await client.messages.create(**TOOL_KW, stream=True)]
    kinds = [(e.type, getattr(e, "index", None)) for e in events]
    assert kinds == [("message_start", None),
                     ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_delta", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    assert events[5].content_block.type == "tool_use"
    assert events[5].content_block.name == "get_weather"
    assert json.loads(events[6].delta.partial_json) == {"city": "Paris"}
    assert events[-2].delta.stop_reason == "tool_use"
    scripted(CALL_TEXT)
    async with client.messages.stream(**TOOL_KW) as stream:
        final = await stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"


async def test_chat_completions_return_the_tool_calls_too(server, scripted):
    chat = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                               "parameters": t["input_schema"]}} for t in TOOLS]
    kwargs = dict(model="tiny", max_tokens=len(CALL_TEXT) + 1, tools=tools,
                  messages=[{"role": "user", "content": "Weather?"}], temperature=0,
                  extra_body={"ignore_eos": True})
    scripted(CALL_TEXT)
    whole = await chat.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("get_weather", {"city": "Paris"})]
    scripted(CALL_TEXT)
    chunks = [c async for c in await chat.chat.completions.create(**kwargs, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    scripted(CALL_TEXT)         # tool_choice "none": the text is the answer
    plain = await chat.chat.completions.create(**kwargs, tool_choice="none")
    assert plain.choices[0].message.content == "".join(CALL_TEXT)
    assert not plain.choices[0].message.tool_calls


async def test_text_without_a_call_when_tools_are_offered(client, scripted):
    scripted(["Sunny", " <tool", " maybe"])
    msg = await client.messages.create(**TOOL_KW)
    assert [(b.type, b.text) for b in msg.content] == [("text", "Sunny <tool maybe")]
    assert msg.stop_reason == "end_turn"


# --- the converters on recorded chat answers ---------------------------------------------------

def test_usage_as_vllm_builds_it():
    assert usage_of(None) == {"input_tokens": 0, "output_tokens": 0}
    assert usage_of({"prompt_tokens": 10, "completion_tokens": 3}) == {
        "input_tokens": 10, "output_tokens": 3}
    assert usage_of({"prompt_tokens": 40, "completion_tokens": 3,
                     "prompt_tokens_details": {"cached_tokens": 32}}) == {
        "input_tokens": 8, "output_tokens": 3, "cache_read_input_tokens": 32}
    assert usage_of({"prompt_tokens": 40, "completion_tokens": None, "prompt_tokens_details": {
        "cached_tokens": 16, "created_cache_tokens": 16}}) == {
        "input_tokens": 8, "output_tokens": 0, "cache_creation_input_tokens": 16,
        "cache_read_input_tokens": 16}
    assert count_tokens_answer(7) == {"input_tokens": 7,
                                      "context_management": {"original_input_tokens": 7}}


@pytest.mark.parametrize("args,expected", [
    (("length", None, True, True), ("max_tokens", None)),
    (("stop", None, False, False), ("end_turn", None)),
    (("stop", "END", False, False), ("stop_sequence", "END")),
    (("stop", 7, False, False), ("end_turn", None)),                 # a stop token id
    (("tool_calls", None, True, True), ("tool_use", None)),
    (("stop", "END", True, True), ("tool_use", None)),               # the calls are whole
    (("stop", "END", True, False), ("stop_sequence", "END")),        # a call cut short
    (("stop", None, True, False), ("tool_use", None)),
    (("abort", None, False, False), (None, None)),
])
def test_stop_reasons_as_vllm_maps_them(args, expected):
    assert stop_reason_of(*args) == expected


def chat_answer(message: dict, finish_reason="stop", **choice) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message},
                         "finish_reason": finish_reason, **choice}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                      "prompt_tokens_details": {"cached_tokens": 16}}}


def test_a_whole_answer_as_vllm_converts_it():
    msg = message_of(chat_answer({"content": "Hi", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"x": 1}'}}]}, "tool_calls"))
    assert msg == {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "m",
                   "content": [{"type": "text", "text": "Hi"},
                               {"type": "tool_use", "id": "call_1", "name": "f",
                                "input": {"x": 1}}],
                   "stop_reason": "tool_use",
                   "usage": {"input_tokens": 4, "output_tokens": 5,
                             "cache_read_input_tokens": 16}}
    empty = message_of(chat_answer({"content": None}, "length"))
    assert empty["content"] == [{"type": "text", "text": ""}]
    assert empty["stop_reason"] == "max_tokens" and "stop_sequence" not in empty
    stopped = message_of(chat_answer({"content": "a"}, stop_reason="##"))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "##")
    thought = message_of(chat_answer({"content": "a", "reasoning": "hmm"}))
    assert [b["type"] for b in thought["content"]] == ["thinking", "text"]
    assert thought["content"][0]["thinking"] == "hmm" and thought["content"][0]["signature"]


def chunk(delta=None, finish_reason=None, usage=None, stop_reason=None, choices=True) -> dict:
    out = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "model": "m", "choices": []}
    if choices:
        choice = {"index": 0, "delta": delta or {}, "finish_reason": finish_reason}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        out["choices"] = [choice]
    if usage is not None:
        out["usage"] = usage
    return out


def events_of(data: bytes) -> list[dict]:
    out = []
    for event in data.decode().split("\n\n")[:-1]:
        name, body = event.split("\n")
        obj = json.loads(body.removeprefix("data: "))
        assert name == "event: " + obj["type"]
        out.append(obj)
    return out


def accumulate(events: list[dict]):
    snapshot, bufs = None, {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


FINAL_USAGE = {"prompt_tokens": 20, "completion_tokens": 4, "total_tokens": 24,
               "prompt_tokens_details": {"cached_tokens": 16}}


def test_a_text_stream_as_vllm_converts_it():
    stream = MessageStream()
    data = stream.chunk(chunk({"role": "assistant", "content": ""},
                              usage={"prompt_tokens": 20, "completion_tokens": 0}))
    data += stream.chunk(chunk({"content": "Hel"}))
    data += stream.chunk(chunk({"content": "lo"}))
    data += stream.chunk(chunk({}, "stop", stop_reason="##"))
    data += stream.data(json.dumps(chunk(usage=FINAL_USAGE, choices=False)).encode())
    data += stream.data(b"[DONE]")
    events = events_of(data)
    assert events == [
        {"type": "message_start", "message": {
            "id": "chatcmpl-9", "type": "message", "role": "assistant", "content": [],
            "model": "m", "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 20, "output_tokens": 0}}},
        {"type": "content_block_start", "content_block": {"type": "text", "text": ""},
         "index": 0},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"},
         "index": 0},
        {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"},
         "index": 0},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "stop_sequence",
                                            "stop_sequence": "##"},
         "usage": {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 16}},
        {"type": "message_stop"}]
    final = accumulate(events)
    assert final.content[0].text == "Hello" and final.stop_sequence == "##"


def test_a_tool_stream_as_vllm_converts_it():
    """vLLM's hermes parser streams a call's name, then its arguments in pieces; text that
    arrives inside the tool_use block is sent after it as a block of its own."""
    stream = MessageStream()
    data = stream.chunk(chunk({"role": "assistant", "content": ""}))
    data += stream.chunk(chunk({"reasoning": "think"}))
    data += stream.chunk(chunk({"content": "Look."}))
    data += stream.chunk(chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                                "function": {"name": "f"}}]}))
    data += stream.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}))
    data += stream.chunk(chunk({"content": " stray"}))
    data += stream.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": ': 1}'}}]}))
    data += stream.chunk(chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                                "function": {"name": "g", "arguments": "{}"}}]}))
    data += stream.chunk(chunk({}, "tool_calls"))
    data += stream.chunk(chunk(usage=FINAL_USAGE, choices=False)) + stream.done()
    events = events_of(data)
    blocks = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "text"), (4, "tool_use")]
    assert [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"] == [
        "thinking_delta", "signature_delta", "text_delta", "input_json_delta",
        "input_json_delta", "text_delta", "input_json_delta"]
    final = accumulate(events)
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "text",
                                               "tool_use"]
    assert final.content[2].input == {"x": 1} and final.content[3].text == " stray"
    assert (final.content[4].name, final.content[4].input) == ("g", {})
    assert final.stop_reason == "tool_use" and final.usage.cache_read_input_tokens == 16


def test_a_stream_without_a_usage_chunk_still_ends_with_message_delta():
    stream = MessageStream()
    data = stream.chunk(chunk({"role": "assistant", "content": ""}))
    data += stream.chunk(chunk({"content": "x"}, "length"))
    data += stream.done()
    events = events_of(data)
    assert [e["type"] for e in events][-3:] == ["content_block_stop", "message_delta",
                                                "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


# --- the request side: to_chat's conversions checked against vLLM's ----------------------------

def test_a_top_level_system_string_is_kept_whole_as_vllm_keeps_it():
    header = "x-anthropic-billing-header: cch=1;"
    assert to_chat({"system": header + " Be brief.", "messages": []})["messages"] == [
        {"role": "system", "content": header + " Be brief."}]
    assert to_chat({"system": [{"type": "text", "text": header}, {"type": "text", "text": "B"}],
                    "messages": []})["messages"] == [{"role": "system", "content": "B"}]


def test_tools_as_vllm_hands_them_on():
    chat = to_chat({"messages": [], "tools": [
        {"name": "a", "input_schema": {"properties": {}}, "strict": True},
        {"name": "b", "description": "B", "input_schema": {"type": "object"},
         "defer_loading": False}]})
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "a", "description": None, "parameters": {
            "properties": {}, "type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "b", "description": "B", "parameters": {
            "type": "object"}, "defer_loading": False}}]
    assert chat["tool_choice"] == "auto"


def test_a_tool_result_s_images_and_references_follow_its_tool_message():
    chat = to_chat({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "one"}, {"type": "text", "text": "two"},
            {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}},
            {"type": "tool_reference", "tool_name": "grep"}]}]}]})
    assert chat["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "one\ntwo"},
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "http://x/i.png"}}]},
        {"role": "tool", "tool_call_id": "t1",
         "content": [{"type": "tool_reference", "name": "grep"}]}]
