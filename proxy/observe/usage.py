"""What an upstream's answer says about itself: token usage, the model, an error message.

Found without parsing every SSE event: a stream's usage chunk is its last data event (the
gateway keeps the last few chunks, `ctx.tail`; only the event naming `usage` is parsed); a
whole answer's JSON is parsed once.
"""
from __future__ import annotations

import json
import re

from prefixgate.common import sse

MAX_ERROR_CHARS = 300
WHOLE_PARSE_BYTES = 64 * 1024   # larger answers (embeddings): only their usage is parsed
USAGE_NEAR_END_BYTES = 8192     # where a large answer's `usage` is looked for
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')


def from_stream(tail) -> dict | None:
    """The last data event that has a `usage` key, parsed (None: no such event)."""
    if b'"usage"' not in b"".join(tail):
        return None                 # most streams: no usage asked for, nothing to split
    for raw in reversed(sse.events_in(tail)):
        if b'"usage"' in raw:
            event = sse.json_of(raw)
            return event if isinstance(event, dict) else None
    return None


def from_body(body: bytes) -> dict | None:
    """A whole JSON answer, parsed (None when it is not a JSON object)."""
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return answer if isinstance(answer, dict) else None


def from_large_body(body: bytes) -> dict | None:
    """{"usage": ...} of a large JSON answer, read near its end where servers put it."""
    near_end = body[-USAGE_NEAR_END_BYTES:]
    found = None
    for match in _USAGE_OBJECT.finditer(near_end):
        found = match                 # the last one
    if found is None:
        return None
    try:
        found, _ = json.JSONDecoder().raw_decode(
            near_end[found.end() - 1:].decode("utf-8", "replace"))
    except ValueError:
        return None
    return {"usage": found}


def tokens(usage) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, cached_tokens, completion_tokens) of an answer's `usage` — OpenAI's,
    the Responses API's, or Anthropic's (whose `input_tokens` leaves out the cache's: the
    prompt is input + cache read + cache creation)."""
    if not isinstance(usage, dict):
        return None, None, None
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        return _anthropic_tokens(usage)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    # the Responses API names them input/output tokens
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    return _count(prompt), _count(cached), _count(completion)


def _anthropic_tokens(usage: dict) -> tuple[int | None, int | None, int | None]:
    read = _count(usage.get("cache_read_input_tokens"))
    parts = [_count(usage.get(k)) for k in ("input_tokens", "cache_read_input_tokens",
                                            "cache_creation_input_tokens")]
    prompt = None if parts[0] is None else sum(p or 0 for p in parts)
    return prompt, read, _count(usage.get("output_tokens"))


def error_message(answer: dict | None) -> str | None:
    """An OpenAI-shaped error's message, cut to a log line's size."""
    err = answer.get("error") if answer else None
    if isinstance(err, dict):
        err = err.get("message", err)
    if err is None:
        return None
    return str(err)[:MAX_ERROR_CHARS]


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
