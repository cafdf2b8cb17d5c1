"""Request hygiene before anything is sent upstream: body deadline, nesting depth, field types.

Only what every OpenAI-compatible server requires is checked here (a backend still validates
the rest): a malformed request is answered 400 by the gateway instead of costing an upstream
round trip or tripping a backend bug.
"""
from __future__ import annotations

import asyncio

from aiohttp import web

from prefixgate.common.errors import HTTPError

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "top_k", "seed")
_NUM_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty")


def too_slow(timeout_s: float) -> HTTPError:
    return HTTPError(408, f"request body not received within {timeout_s}s "
                     "(limits.body_timeout_s)", code="request_timeout",
                     headers={"Connection": "close"})


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"request body exceeds limits.max_body_bytes ({limit} bytes)",
                     code="body_too_large")


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    """The whole body, or 408 when it has not arrived within `timeout_s` (slowloris)."""
    if request.content.is_eof():        # all here already (it came with the head): no timer
        return await request.read()
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise too_slow(timeout_s) from None


async def capped(chunks, limit: int):
    """A streamed body's chunks, ended with a 413 once they pass `limit` bytes (a chunked
    upload announces no length to check up front)."""
    sent = 0
    async for chunk in chunks:
        sent += len(chunk)
        if sent > limit:
            raise too_large(limit)
        yield chunk


def check_depth(value, max_depth: int) -> None:
    """Reject JSON nested deeper than `max_depth` (iterative: deep input cannot recurse us)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise HTTPError(400, f"request JSON is nested deeper than {max_depth} levels "
                            "(limits.max_json_depth)", code="invalid_request")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def check_fields(path: str, body: dict) -> None:
    if path.endswith("/chat/completions"):
        _check_messages(body.get("messages"), content_required=False)
    elif path.endswith("/v1/completions"):
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)):
            _bad("prompt", "must be a string or a list")
    elif path.startswith("/v1/messages"):          # Anthropic's Messages and count_tokens
        _check_messages(body.get("messages"), content_required=True)
        if path == "/v1/messages" and "max_tokens" not in body:
            _bad("max_tokens", "is required")
    if "model" in body and not isinstance(body["model"], str):
        _bad("model", "must be a string")
    if "stream" in body and body["stream"] is not None and not isinstance(body["stream"], bool):
        _bad("stream", "must be a boolean")
    for name in _INT_FIELDS:
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            _bad(name, "must be an integer")
    for name in _NUM_FIELDS:
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            _bad(name, "must be a number")


def _check_messages(msgs, content_required: bool) -> None:
    """A chat's or a Messages request's `messages` (Anthropic's always carry content)."""
    if not isinstance(msgs, list) or not msgs:
        _bad("messages", "must be a non-empty list of message objects")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            _bad(f"messages[{i}]", "must be an object with a string 'role'")
        if content_required and not isinstance(m.get("content"), (str, list)):
            _bad(f"messages[{i}].content", "must be a string or a list of content blocks")


def _bad(field: str, reason: str):
    raise HTTPError(400, f"'{field}' {reason}", code="invalid_request")
