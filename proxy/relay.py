"""Relay: one attempt whose answer the client gets (the plain path, a P/D decode leg), from the
upstream's bytes to the client's, whole or as a stream (DESIGN.md §2).

A stream is written on chunk by chunk as it arrives (no re-serialising, no gzip, the headers in
the same packet as the first event); nothing is parsed on the way unless an answer rewriter
(proxy/rewrite.py), chosen once for the attempt, needs it. A whole answer is parsed when it is
checked, rewritten or observed. `UpstreamFailed` from here: another upstream may take it.
"""
from __future__ import annotations

import asyncio
from collections import deque

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from prefixgate.common import server_timing
from prefixgate.common.errors import HTTPError, shape_for
from prefixgate.common.runtime import encode_body
from prefixgate.proxy import rewrite, token_forward
from prefixgate.proxy.exchange import HOP_BY_HOP, RETRY_STATUSES, Attempt, may_retry
from prefixgate.proxy.observe import breakdown, usage
from prefixgate.proxy.rewrite import AnswerRewriter
from prefixgate.proxy.upstream import h1pool
from prefixgate.proxy.upstream.upstreams import Upstream

# the upstream's own, replaced by the gateway's (Server-Timing: extended with its entries)
REPLACED_ANSWER_HEADERS = frozenset({"date", "server", "server-timing"})
STREAM_TAIL_CHUNKS = 3     # a stream's last chunks kept: its usage event is the last one


class EventStreamResponse(web.StreamResponse):
    """A streamed response whose headers go out in the same packet as the first event.

    (aiohttp otherwise sends headers in a write of their own at prepare(); the flag is
    aiohttp's own switch, used by web.Response.)
    """
    _send_headers_immediately = False


class ClientGone(Exception):
    """The client closed its connection before the response was complete."""


async def answer(gw, request, ctx, up: Upstream, data,
                 as_tokens: bool = False) -> web.StreamResponse:
    """One attempt on `up` whose answer the client gets (`as_tokens`: a chat sent as token
    ids, token_forward.py), relayed whole or as a stream."""
    path = ctx.target
    if as_tokens:
        path = "/v1/completions"
        data = encode_body(token_forward.chat_to_completions(ctx.body, ctx.tokens))
    rewriter = rewrite.for_attempt(gw, ctx, up, as_tokens)
    with Attempt(gw, ctx, up, path) as attempt:
        first = await attempt.send(ctx.endpoint.method, data, ctx.upload_length,
                                   read="first" if ctx.stream else "head")
        upstream_resp = attempt.resp
        ctx.upstream_timing = _header(upstream_resp, b"server-timing")
        if upstream_resp.status in RETRY_STATUSES and may_retry(gw, ctx, [*ctx.tried, up]):
            raise attempt.give_up()
        if ctx.stream and is_event_stream(upstream_resp):
            return await _stream(gw, request, ctx, attempt, first, rewriter)
        return await _whole(gw, ctx, attempt, first, rewriter)


async def _whole(gw, ctx, attempt: Attempt, first: bytes,
                 rewriter: AnswerRewriter | None) -> web.Response:
    up, upstream_resp = attempt.up, attempt.resp
    try:
        async with asyncio.timeout(up.timeouts["idle"]):
            rest = await upstream_resp.read_all()
    except (TimeoutError, h1pool.UpstreamError) as e:
        attempt.broken(describe(e))
        raise HTTPError(502, f"upstream {up.name} failed mid-response: {describe(e)}",
                        code="upstream_error") from None
    body = first + rest
    parsed = _parse_answer(gw, ctx, upstream_resp, body, rewriter is not None)
    problem = broken_success(upstream_resp, parsed) if ctx.endpoint.prompt else None
    if problem:
        attempt.broken(problem)
        raise HTTPError(502, f"upstream {up.name} {problem}", code="upstream_bad_response")
    if rewriter is not None and upstream_resp.status == 200 and isinstance(parsed, dict):
        body = encode_body(rewriter.whole(parsed))
    ctx.stamp("first_byte")
    ctx.client_has_bytes = True
    for hook in ctx.chain.on_first_byte:
        hook(ctx)
    ctx.status, ctx.bytes_out = upstream_resp.status, len(body)
    return web.Response(status=upstream_resp.status, body=body,
                        headers=response_headers(ctx, upstream_resp))


def _parse_answer(gw, ctx, upstream_resp, body: bytes, rewritten: bool) -> dict | None:
    """A whole JSON answer, parsed when it is checked (chat/completions), rewritten, observed
    or counted (its usage, model and error message go into ctx)."""
    if "json" not in upstream_resp.content_type or not (
            ctx.endpoint.prompt or rewritten or gw.observer is not None
            or gw.limits.counts_tokens):
        return None
    small = ctx.endpoint.prompt or rewritten or len(body) <= usage.WHOLE_PARSE_BYTES
    parsed = usage.from_body(body) if small else usage.from_large_body(body)
    if parsed is not None:
        ctx.answer = parsed
        ctx.usage, model = parsed.get("usage"), parsed.get("model")
        ctx.response_model = model if isinstance(model, str) else None
        if upstream_resp.status >= 400:
            ctx.error = usage.error_message(parsed)
    return parsed


async def _stream(gw, request, ctx, attempt: Attempt, first: bytes,
                  rewriter: AnswerRewriter | None) -> web.StreamResponse:
    """Write each upstream chunk to the client as it arrives (through `rewriter`, if any)."""
    up, upstream_resp = attempt.up, attempt.resp
    resp = EventStreamResponse(status=upstream_resp.status,
                               headers=response_headers(ctx, upstream_resp))
    ctx.status = upstream_resp.status
    chain = ctx.chain
    on_chunk = chain.on_chunk
    idle = up.timeouts["idle"]
    # events counted for TPOT: OpenAI's data events, Anthropic's content deltas
    token_mark = b'"content_block_delta"' if ctx.endpoint.api == "anthropic" else b"data:"
    keep_tail = gw.observer is not None or chain.keeps_tail or gw.limits.counts_tokens
    tail = ctx.tail = deque(maxlen=STREAM_TAIL_CHUNKS) if keep_tail else None
    try:
        ctx.stamp("first_byte")
        ctx.client_has_bytes = True      # from here on the answer is the client's
        await resp.prepare(request)      # headers are held back and sent with the first chunk
        chunk = first
        for hook in chain.on_first_byte:
            hook(ctx)
        while chunk:
            ctx.chunks += chunk.count(token_mark)
            ctx.bytes_out += len(chunk)
            if tail is not None:
                tail.append(chunk)
            for hook in on_chunk:
                hook(ctx, chunk)
            if rewriter is not None:
                chunk = rewriter.feed(chunk) + (rewriter.flush() if upstream_resp.is_eof()
                                                else b"")
            if upstream_resp.is_eof():   # last piece: send it with the chunked terminator
                await resp.write_eof(chunk)
                return resp
            if chunk:
                await resp.write(chunk)
            try:
                async with asyncio.timeout(idle):
                    chunk = await upstream_resp.read()
            except (TimeoutError, h1pool.UpstreamError) as e:
                attempt.broken(describe(e))
                err = HTTPError(502, f"upstream {up.name} failed mid-stream: {describe(e)}",
                                code="upstream_error")
                ctx.status, ctx.error = 502, err.message
                await resp.write(err.sse_event(shape_for(ctx.path)))
                break
        await resp.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
        raise ClientGone(str(e)) from None
    return resp


# --- headers -------------------------------------------------------------------------------
def our_headers(ctx) -> dict[str, str]:
    """The gateway's own headers on every answer, an error's too."""
    headers = {"x-prefixgate-request-id": ctx.request_id, **ctx.response_headers}
    if ctx.upstream is not None:
        headers["x-prefixgate-upstream"] = ctx.upstream.name
    return headers


def response_headers(ctx, upstream_resp) -> CIMultiDict:
    headers = CIMultiDict()
    for name, value in upstream_resp.headers:
        key = name.decode("latin-1")
        if key.lower() not in HOP_BY_HOP and key.lower() not in REPLACED_ANSWER_HEADERS:
            headers.add(key, value.decode("latin-1"))
    if ctx.stream:
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"       # tell any proxy in front not to buffer
    headers.update(our_headers(ctx))
    headers[server_timing.HEADER] = breakdown.header(ctx)
    return headers


def broken_success(resp: h1pool.Response, answer: dict | None) -> str | None:
    """Why a 2xx completion answer cannot come from an OpenAI-compatible server, if it can't
    (`answer`: its body parsed as a JSON object, or None)."""
    if not 200 <= resp.status < 300 or resp.content_type == "text/event-stream":
        return None
    if "json" not in resp.content_type:
        return f"sent a non-JSON answer ({resp.content_type or 'no content type'})"
    if answer is None:
        return "sent invalid JSON (not a JSON object)"
    return None


def _header(resp: h1pool.Response, name: bytes) -> str | None:
    value = resp.header(name)
    return value.decode("latin-1") if value is not None else None


def is_event_stream(resp: h1pool.Response) -> bool:
    return resp.status == 200 and resp.content_type == "text/event-stream"


def describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "idle timeout"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
