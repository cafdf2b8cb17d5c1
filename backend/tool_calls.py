"""Tool calls in the model's output text, in the Hermes format vLLM's `hermes` parser reads
(vllm/tool_parsers/hermes_tool_parser.py): each call is a JSON object with `name` and
`arguments` between `<tool_call>` and `</tool_call>`, as Qwen2.5/Qwen3, Hermes and the
templates written for them ask of the model:

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

As vLLM: the answer's text is what comes before the first `<tool_call>` (text between and after
calls is dropped); a last call whose `</tool_call>` never came counts when its JSON is whole;
each call gets an id `chatcmpl-tool-<hex>`, and its `arguments` are JSON text. A call whose JSON
does not parse (or has no name) is dropped; when no call parses at all, the whole text is the
answer, as if the model had written no call.

`ToolCallStream` does this as text arrives: text before the first `<tool_call>` goes out at
once (less a tail that may be the start of the tag), a call goes out whole when its closing tag
arrives; `parse_tool_calls` is the same on a whole text.
"""
from __future__ import annotations

import json
import logging
import uuid

log = logging.getLogger("prefixgate.engine")

START = "<tool_call>"
END = "</tool_call>"


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call_of(text: str) -> dict | None:
    """One call's JSON as a chat tool call (None: it does not parse)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):           # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": tool_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _tag_overlap(text: str, tag: str) -> int:
    """The length of the longest start of `tag` that `text` ends with (short of the whole)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallStream:
    """The calls in a text that arrives in pieces (module doc):

        calls = ToolCallStream()
        text, new_calls = calls.feed(delta)      # for each piece
        text, new_calls = calls.finish()         # at the end
    """

    def __init__(self):
        self.sent = 0               # characters of the text before the first call, sent
        self.text = ""              # everything so far
        self.scan = -1              # where the calls start (-1: no <tool_call> yet)
        self.pos = 0                # where the next call's search starts
        self.calls: list[dict] = []

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.text += delta
        if self.scan < 0:
            at = self.text.find(START, max(0, self.sent - len(START)))
            if at < 0:
                end = len(self.text) - _tag_overlap(self.text, START)
                out, self.sent = self.text[self.sent:end], max(self.sent, end)
                return out, []
            self.scan = self.pos = at
            out, self.sent = self.text[self.sent:at], at
        else:
            out = ""
        return out, self._closed_calls()

    def finish(self) -> tuple[str, list[dict]]:
        """What is left: a last unclosed call whose JSON is whole; or, when no call parsed,
        the held text."""
        if self.scan < 0:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        new = self._closed_calls()
        start = self.text.find(START, self.pos)
        if start >= 0:
            call = _call_of(self.text[start + len(START):].strip())
            if call is not None:
                new.append(call)
                self.calls.append(call)
            self.pos = len(self.text)
        if not self.calls:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        return "", new

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _closed_calls(self) -> list[dict]:
        new = []
        while True:
            start = self.text.find(START, self.pos)
            if start < 0:
                break
            end = self.text.find(END, start + len(START))
            if end < 0:
                break
            body = self.text[start + len(START):end].strip()
            self.pos = end + len(END)
            call = _call_of(body)
            if call is None:
                log.debug("dropped a tool call that does not parse: %.200r", body)
                continue
            new.append(call)
            self.calls.append(call)
        return new


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the answer's text, its tool calls) of a whole output; the text is None when the model
    called tools and wrote nothing before them."""
    calls = ToolCallStream()
    head, found = calls.feed(text)
    tail, more = calls.finish()
    found += more
    content = head + tail
    return (content or None) if found else content, found
