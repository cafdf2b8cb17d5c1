"""The one SSE reader (common/sse.py) reads what the spec allows — `data:` with or without its
space, `\\r\\n` and `\\r` line ends, several data lines, comments — byte-exact however the
stream is cut; and every reader of answers (usage, token forwarding, response ids, next-turn
warming) reads through it."""
from __future__ import annotations

import json
import random

import pytest

from prefixgate.common import sse
from prefixgate.plugins.prerender import answer_message
from prefixgate.proxy.observe import usage
from prefixgate.proxy.response_ids import ResponseIds, Rewriter
from prefixgate.proxy.token_forward import ChatFromCompletions

LINE_ENDS = [b"\n", b"\r\n", b"\r"]


def stream(events: list[bytes], end: bytes) -> bytes:
    """Events of `field: value` lines (joined by `\\n` in `events`) with `end` line ends."""
    return b"".join(e.replace(b"\n", end) + end + end for e in events)


def cut(data: bytes, seed: int) -> list[bytes]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(data):
        step = rng.randint(1, 7)
        out.append(data[i:i + step])
        i += step
    return out


@pytest.mark.parametrize("end", LINE_ENDS)
def test_events_are_cut_whole_and_byte_exact_wherever_the_reads_split(end):
    events = [b'data: {"a": 1}', b'data:{"b": 2}', b": keep-alive", b"event: ping\ndata: x",
              b"data: one\ndata:two\ndata:  three", b"data: [DONE]"]
    data = stream(events, end)
    for seed in range(20):
        splitter = sse.EventSplitter()
        got = [e for piece in cut(data, seed) for e in splitter.feed(piece)]
        rest = splitter.flush()          # a `\r` last may yet be a `\r\n`: held to the end
        assert b"".join(got) + rest == data and rest in (b"", events[-1] + end * 2)
        got += [rest] if rest else []
        assert [sse.parse(e).data for e in got] == [b'{"a": 1}', b'{"b": 2}', None, b"x",
                                                   b"one\ntwo\n three", b"[DONE]"]
        assert sse.parse(got[3]).event == "ping"


def test_an_unterminated_last_event_is_kept_for_flush():
    splitter = sse.EventSplitter()
    assert splitter.feed(b"data: 1\n\ndata: 2") == [b"data: 1\n\n"]
    assert splitter.flush() == b"data: 2"
    assert sse.events_in([b"data: 1\n\nda", b"ta: 2"]) == [b"data: 1\n\n", b"data: 2"]


@pytest.mark.parametrize("end", LINE_ENDS)
def test_usage_is_read_from_a_stream_with_any_line_end_and_no_space(end):
    events = [b'data:{"choices": [{"delta": {"content": "hi"}}]}',
              b'data:{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 1}}',
              b"data:[DONE]"]
    tail = cut(stream(events, end), 3)
    assert usage.from_stream(tail)["usage"]["prompt_tokens"] == 7


@pytest.mark.parametrize("end", LINE_ENDS)
def test_token_forwarding_converts_every_spelling_of_an_event(end):
    events = [b'data:{"id": "c", "choices": [{"index": 0, "text": "Hel"}]}',
              b'data: {"id": "c", "choices": [{"index": 0, "text": "lo", '
              b'"finish_reason": "stop"}]}', b": comment", b"data: [DONE]"]
    conv, out = ChatFromCompletions(), []
    for piece in cut(stream(events, end), 5):
        out.append(conv.feed(piece))
    out.append(conv.flush())
    chunks = [sse.json_of(e) for e in sse.events_in([b"".join(out)])]
    chat = [c for c in chunks if c is not None]
    assert [c["object"] for c in chat] == ["chat.completion.chunk"] * 2
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hel"}
    assert chat[1]["choices"][0]["delta"] == {"content": "lo"}
    assert b"".join(out).count(b"[DONE]") == 1 and b": comment" in b"".join(out)


@pytest.mark.parametrize("end", LINE_ENDS)
def test_response_ids_are_swapped_in_events_with_any_line_end(end):
    ids = ResponseIds({"id_secret": "s" * 16})
    events = [b'event: response.created\ndata:{"response": {"id": "resp_up1"}}',
              b'data: {"type": "response.completed", "response": {"id": "resp_up1"}}']
    rewriter = Rewriter(ids, "a", None)
    out = b"".join(rewriter.feed(p) for p in cut(stream(events, end), 2)) + rewriter.flush()
    assert b"resp_up1\"" not in out.replace(b"_resp_up1", b"")
    assert out.count(ids.wrap("a", "resp_up1").encode()) == 2


def test_the_next_turn_is_assembled_from_a_crlf_stream_without_spaces():
    events = [b'data:{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}',
              b'data:{"choices": [{"index": 0, "delta": {"content": "Hi "}}]}',
              b'data:{"choices": [{"index": 0, "delta": {"content": "there"}}]}',
              b"data:[DONE]"]
    reply = answer_message(None, cut(stream(events, b"\r\n"), 4))
    assert reply == {"role": "assistant", "content": "Hi there"}


def test_json_of_gives_none_for_done_comments_and_non_json():
    assert sse.json_of(b"data: [DONE]\n\n") is None
    assert sse.json_of(b": ping\n\n") is None
    assert sse.json_of(b"data: {not json\n\n") is None
    assert sse.json_of(b"data: " + json.dumps({"x": 1}).encode() + b"\n\n") == {"x": 1}
