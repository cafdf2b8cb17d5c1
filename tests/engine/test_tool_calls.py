"""Tool calls read from the model's text in the Hermes format vLLM's `hermes` parser reads
(backend/tool_calls.py): whole texts, and the same texts arriving a piece at a time, as the
engine streams them."""
from __future__ import annotations

import json

import pytest

from prefixgate.backend.tool_calls import ToolCallStream, parse_tool_calls

CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
        '</tool_call>')
SECOND = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_text_without_calls_is_the_answer():
    assert parse_tool_calls("Hello <tool there") == ("Hello <tool there", [])
    assert parse_tool_calls("") == ("", [])


def test_a_call_after_text():
    content, calls = parse_tool_calls("Let me look. " + CALL)
    assert content == "Let me look. "
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "unit": "C"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("chatcmpl-tool-")


def test_calls_alone_have_no_text_and_text_between_them_is_dropped():
    content, calls = parse_tool_calls(CALL + "\nand then\n" + SECOND + "\n")
    assert content is None
    assert [name for name, _ in calls_of(calls)] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2


def test_a_last_call_without_its_closing_tag_counts_when_its_json_is_whole():
    content, calls = parse_tool_calls('Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert content == "Sure." and calls_of(calls) == [("f", {"x": 1})]


@pytest.mark.parametrize("text", [
    'Hi<tool_call>{"name": "f", "arguments": {"x": </tool_call>',      # broken JSON
    'Hi<tool_call>{"arguments": {"x": 1}}</tool_call>',                # no name
    'Hi<tool_call>{"name": "f", "arguments": [1]}</tool_call>',        # arguments not an object
    'Hi<tool_call>{"name": "f", "arguments": {"x": 1',                 # cut off
])
def test_when_no_call_parses_the_whole_text_is_the_answer(text):
    assert parse_tool_calls(text) == (text, [])


def test_arguments_written_as_json_text_and_missing_arguments():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
                                '<tool_call>{"name": "g"}</tool_call>')
    assert calls_of(calls) == [("f", {"x": 2}), ("g", {})]


def test_non_ascii_arguments_stay_as_written():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"q": "café 你好"}}'
                                '</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q": "café 你好"}'


TEXTS = ["plain text with a < and <tool but no call", "Let me look. " + CALL,
         "Two: " + CALL + " " + SECOND, CALL + "\ntrailing",
         'Hi<tool_call>{"name": "f", "arguments": {"x": </tool_call>',
         'Sure.<tool_call>{"name": "f", "arguments": {"x": 1}}']


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_pieces_give_what_the_whole_text_gives(text, size):
    stream, sent, calls = ToolCallStream(), [], []
    for i in range(0, len(text), size):
        piece, new = stream.feed(text[i:i + size])
        sent.append(piece)
        calls += new
    piece, new = stream.finish()
    sent.append(piece)
    calls += new
    content, whole_calls = parse_tool_calls(text)
    assert "".join(sent) == (content or "")
    assert calls_of(calls) == calls_of(whole_calls)


def test_text_goes_out_at_once_but_a_possible_tag_is_held_back():
    stream = ToolCallStream()
    assert stream.feed("Hello ") == ("Hello ", [])
    assert stream.feed("<tool_") == ("", [])             # may be the start of <tool_call>
    assert stream.feed("x>") == ("<tool_x>", [])          # it was not
    assert stream.feed(" ok <tool_call>{\"name\"") == (" ok ", [])
    assert stream.feed(': "f", "arguments": {}}') == ("", [])
    text, new = stream.feed("</tool_call>")             # the call goes out when it closes
    assert text == "" and calls_of(new) == [("f", {})] and stream.called
    assert stream.finish() == ("", [])


def test_a_history_s_tool_call_arguments_reach_the_template_as_objects():
    """As vLLM hands them over (chat templates index and dump them): bad or empty JSON is {}."""
    from prefixgate.backend.openai import chat_messages

    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
             {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}},
             {"id": "d", "type": "function", "function": {"name": "k", "arguments": {"y": 2}}}]
    [user, assistant] = chat_messages({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]})
    assert user == {"role": "user", "content": "hi"}
    assert [c["function"]["arguments"] for c in assistant["tool_calls"]] == [
        {"x": 1}, {}, {}, {"y": 2}]
    assert calls[0]["function"]["arguments"] == '{"x": 1}'         # the request is left as it was
