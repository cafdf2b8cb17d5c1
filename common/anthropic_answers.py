"""Anthropic's Messages API answers made of OpenAI chat answers, as vLLM makes them
(vllm/entrypoints/anthropic/serving.py, 0.32): the response side of anthropic_messages.to_chat,
for the bundled engine's `/v1/messages` and for anything that turns a chat upstream's answer
into a Messages answer.

- A whole chat completion becomes one message (`message_of`): `thinking` (from `reasoning`),
  `text` and `tool_use` blocks (`input` is the call's parsed `arguments`), one empty text block
  when there is nothing; the id and model are the chat answer's.
- A chat stream becomes Anthropic's events (`MessageStream`): `message_start` with the first
  chunk, then per block `content_block_start`, its deltas (`text_delta`, `thinking_delta` and a
  `signature_delta` before a thinking block ends, `input_json_delta` for a tool call's
  arguments), `content_block_stop`; `message_delta` (stop reason, usage) with the usage chunk
  (the one with no choices), `message_stop` at `[DONE]`. Text arriving inside a tool_use block
  is held and sent as a text block of its own after it.
- `stop_reason`: length -> max_tokens; a finished tool call -> tool_use; a matched stop string
  (the chat choice's `stop_reason`, a string, as vLLM reports it) -> stop_sequence; otherwise
  end_turn.
- `usage`: `input_tokens` is `prompt_tokens` less the cached (and cache-created) tokens,
  `cache_read_input_tokens` the cached ones when the answer says
  (`prompt_tokens_details.cached_tokens`), `output_tokens` the completion's.

Each event is `event: NAME\\ndata: JSON\\n\\n`, its JSON compact and with the keys vLLM sends.
Pure Python: no aiohttp, no torch.
"""
from __future__ import annotations

import json
import uuid

STREAM_CONTENT_TYPE = "text/event-stream"


# --- pieces ----------------------------------------------------------------------------------

def usage_of(usage: dict | None) -> dict:
    """Anthropic's usage of an OpenAI `usage` (vLLM's `_build_anthropic_usage`): the cache
    fields only when the chat answer reports them."""
    if not isinstance(usage, dict):
        return {"input_tokens": 0, "output_tokens": 0}
    out = {"input_tokens": 0, "output_tokens": usage.get("completion_tokens") or 0}
    input_tokens = usage.get("prompt_tokens") or 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        created = details.get("created_cache_tokens")
        if created is not None:
            input_tokens -= created
            out["cache_creation_input_tokens"] = created
        cached = details.get("cached_tokens")
        if cached is not None:
            input_tokens -= cached
            out["cache_read_input_tokens"] = cached
    out["input_tokens"] = max(0, input_tokens)
    return out


def stop_reason_of(finish_reason: str | None, stop_reason=None, tool_used: bool = False,
                   tool_complete: bool = False) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat finish (vLLM's `_to_anthropic_stop_reason`):
    max_tokens always wins; a matched stop string (`stop_reason`, a str) wins unless the tool
    calls are complete."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def count_tokens_answer(input_tokens: int) -> dict:
    """`/v1/messages/count_tokens`' answer, as vLLM gives it."""
    return {"input_tokens": input_tokens,
            "context_management": {"original_input_tokens": input_tokens}}


def event(name: str, data: dict) -> bytes:
    """One SSE event: `event: NAME`, then its data as compact JSON."""
    try:
        text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        body = text.encode()
    except UnicodeEncodeError:      # a lone surrogate: keep it escaped
        body = json.dumps(data, separators=(",", ":")).encode()
    return b"event: " + name.encode() + b"\ndata: " + body + b"\n\n"


def _signature() -> str:
    return uuid.uuid4().hex


def _arguments(text) -> dict:
    """A tool call's `arguments` (a JSON text) as the tool_use block's `input`."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text) if text else {}
    except (TypeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# --- a whole answer --------------------------------------------------------------------------

def message_of(chat: dict) -> dict:
    """The Anthropic message of a whole chat completion (vLLM's `messages_full_converter`,
    serialised without its None fields)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    calls = message.get("tool_calls") or []
    stop, sequence = stop_reason_of(choice.get("finish_reason"), choice.get("stop_reason"),
                                    tool_used=bool(calls), tool_complete=bool(calls))
    content: list[dict] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": _signature()})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in calls:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _arguments(function.get("arguments"))})
    if not content:     # Anthropic's empty answer is one empty text block, not []
        content.append({"type": "text", "text": ""})
    out = {"id": chat.get("id"), "type": "message", "role": "assistant", "content": content,
           "model": chat.get("model")}
    if stop is not None:
        out["stop_reason"] = stop
    if sequence is not None:
        out["stop_sequence"] = sequence
    out["usage"] = usage_of(chat.get("usage"))
    for extra in ("kv_transfer_params", "ec_transfer_params"):
        if chat.get(extra) is not None:
            out[extra] = chat[extra]
    return out


# --- a stream --------------------------------------------------------------------------------

class MessageStream:
    """Turns one chat stream's chunks into Anthropic's events (vLLM's
    `message_stream_converter`, in the same order):

        stream = MessageStream()
        for chunk in chat_chunks:            # each a parsed `data:` JSON object
            out = stream.chunk(chunk)        # bytes of zero or more events
        out = stream.done()                  # at `data: [DONE]`

    `data(payload)` takes a raw `data:` field (bytes or str) and dispatches on `[DONE]`.
    Should the chat stream carry no usage chunk, `done()` sends the `message_delta` vLLM would
    have sent with it (stop reason from the finish, usage from the last chunk that had one).
    """

    def __init__(self):
        self.started = False        # message_start sent
        self.finished = False       # message_delta sent
        self.index = 0              # the next block's index
        self.block: str | None = None       # the open block's type
        self.tool_id: str | None = None     # the open tool_use block's id
        self.signature: str | None = None   # the open thinking block's, sent at its end
        self.pending: list[str] = []        # text that arrived inside a tool_use block
        self.ids: dict[int, str] = {}       # tool call index -> id
        self.tool_used = False
        self.last_args: list[str] = []      # the latest tool call's arguments so far
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.usage: dict | None = None      # the latest chunk's usage

    # the chat side

    def data(self, payload: bytes | str) -> bytes:
        text = payload.decode() if isinstance(payload, bytes) else payload
        text = text.strip()
        if text == "[DONE]":
            return self.done()
        return self.chunk(json.loads(text))

    def chunk(self, chunk: dict) -> bytes:
        out: list[bytes] = []
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            out.append(event("message_start", {"type": "message_start", "message": {
                "id": chunk.get("id"), "type": "message", "role": "assistant", "content": [],
                "model": chunk.get("model"), "stop_reason": None, "stop_sequence": None,
                "usage": usage_of(chunk.get("usage"))}}))
        choices = chunk.get("choices")
        if not choices:                 # the usage chunk: the message ends
            out += self._flush()
            out.append(self._message_delta(chunk.get("usage")))
            return b"".join(out)
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning:
            if self.block != "thinking":
                out += self._flush()
                out.append(self._start({"type": "thinking", "thinking": ""}))
            out.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        text = delta.get("content")
        if text:
            if self.block == "tool_use":
                self.pending.append(text)
            else:
                if self.block != "text":
                    out += self._flush()
                    out.append(self._start({"type": "text", "text": ""}))
                out.append(self._delta({"type": "text_delta", "text": text}))
        for call in delta.get("tool_calls") or ():
            out += self._tool_call(call)
        return b"".join(out)

    def done(self) -> bytes:
        out = self._flush()
        if not self.finished:
            out.append(self._message_delta(self.usage))
        out.append(event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    # the Anthropic side

    def _tool_call(self, call: dict) -> list[bytes]:
        out: list[bytes] = []
        function = call.get("function") or {}
        args = function.get("arguments")
        if call.get("id") is not None:
            self.ids[call.get("index", 0)] = call["id"]
            name = function.get("name")
            if self.tool_id != call["id"] and name is not None:
                out += self._flush()
                self.tool_used = True
                self.last_args = []
                out.append(self._start({"type": "tool_use", "id": call["id"], "name": name,
                                        "input": {}}))
            current = call["id"]
        else:
            current = self.ids.get(call.get("index", 0))
        if args and current is not None and self.tool_id == current:
            self.last_args.append(args)
            out.append(self._delta({"type": "input_json_delta", "partial_json": args}))
        return out

    def _start(self, block: dict) -> bytes:
        self.block = block["type"]
        self.tool_id = block.get("id") if block["type"] == "tool_use" else None
        self.signature = _signature() if block["type"] == "thinking" else None
        return event("content_block_start", {"type": "content_block_start",
                                              "content_block": block, "index": self.index})

    def _delta(self, delta: dict) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                              "index": self.index})

    def _stop(self) -> list[bytes]:
        if self.block is None:
            return []
        out = []
        if self.signature is not None:
            out.append(self._delta({"type": "signature_delta", "signature": self.signature}))
        out.append(event("content_block_stop", {"type": "content_block_stop",
                                                "index": self.index}))
        self.block = self.tool_id = self.signature = None
        self.index += 1
        return out

    def _flush(self) -> list[bytes]:
        """Close the open block; text held during a tool_use block becomes a text block."""
        held, self.pending = "".join(self.pending), []
        out = self._stop()
        if held:
            out.append(self._start({"type": "text", "text": ""}))
            out.append(self._delta({"type": "text_delta", "text": held}))
            out += self._stop()
        return out

    def _message_delta(self, usage: dict | None) -> bytes:
        self.finished = True
        stop, sequence = stop_reason_of(
            self.finish_reason or "stop", self.stop_reason, tool_used=self.tool_used,
            tool_complete=self.tool_used and _is_json("".join(self.last_args)))
        return event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": stop, "stop_sequence": sequence},
                                       "usage": usage_of(usage)})
