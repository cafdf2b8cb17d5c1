"""Client-side measurement for `prefixgate bench`: one streamed request, and the two load
shapes (closed-loop concurrency, open-loop Poisson arrivals).

TTFT is measured where a user feels it: from just before the request is sent to the arrival
of the first SSE event that carries content (role-only and empty events do not count).

Two stream shapes are read (`api`, else the path decides): OpenAI's chat and completions
chunks, and Anthropic's Messages events (`/v1/messages`): there content is a
`content_block_delta` with text, tool input (`input_json_delta`) or thinking, and the usage
comes in `message_start` and `message_delta` (the later wins field by field): the prompt is
`input_tokens + cache_read_input_tokens + cache_creation_input_tokens`, the cached part
`cache_read_input_tokens`, the output `output_tokens`.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

import aiohttp

from prefixgate.common import server_timing as st
from prefixgate.common.sse import DONE, Event, EventSplitter, parse

MESSAGES_PATH = "/v1/messages"       # Anthropic's Messages API: its events, its usage
CONTENT_DELTAS = {"text_delta": "text", "input_json_delta": "partial_json",
                  "thinking_delta": "thinking"}


@dataclass
class Sample:
    index: int
    warmup: bool = False
    start: float = 0.0               # monotonic send time
    ttft: float | None = None        # seconds to the first content event
    latency: float | None = None     # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)   # gaps between content events
    output_tokens: int = 0           # usage.completion_tokens, else content events
    content_events: int = 0
    prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, likewise
    # (Messages: input + cache read + cache creation tokens, and the cache read ones)
    status: int | None = None
    error: str | None = None
    server_timing: dict[str, float] | None = None   # the response's Server-Timing, {name: ms}
    upstream: str | None = None      # x-prefixgate-upstream: where a prefixgate gateway sent it
    predicted_ttft_ms: float | None = None   # the gateway's prediction there (predicted_ttft)
    text: list[str] | None = None    # the answer's content pieces, when asked for (not archived)
    message_usage: dict | None = None  # a Messages stream's usage so far, merged (not archived)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.latency is None or self.output_tokens < 2 or not self.itl:
            return None
        return sum(self.itl) / len(self.itl)

    def to_json(self, origin: float) -> dict:
        d = asdict(self)
        d["start"] = round(self.start - origin, 6)
        del d["text"], d["message_usage"]
        return d


def has_content(event: dict) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") \
                or choice.get("text"):
            return True
    return False


def api_of(url: str) -> str:
    """The stream shape a URL answers in: "messages" (Anthropic's) or "openai"."""
    return "messages" if url.rstrip("/").endswith(MESSAGES_PATH) else "openai"


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict, headers: dict,
                      sample: Sample, keep_text: bool = False, api: str | None = None) -> Sample:
    """POST `body` to `url` with stream=true and fill `sample` with what arrived when (and,
    with `keep_text`, the answer's text in `sample.text`). `api`: "openai" or "messages"
    (Anthropic's events), by default as the URL's path says (`api_of`)."""
    on_event = _on_message_event if (api or api_of(url)) == "messages" else _on_event
    sample.text = [] if keep_text else None
    sample.start = t0 = time.monotonic()
    last = None
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            sample.status = resp.status
            sample.server_timing = header_timing(resp.headers)
            sample.upstream = resp.headers.get("x-prefixgate-upstream")
            sample.predicted_ttft_ms = route_prediction(resp.headers.get("x-prefixgate-route"))
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {error_message(await resp.read())}"
                return sample
            splitter = EventSplitter()      # an unterminated last event is dropped, as spec'd
            async for chunk in resp.content.iter_any():
                now = time.monotonic()
                for raw in splitter.feed(chunk):
                    last = on_event(parse(raw), now, t0, last, sample)
            sample.latency = time.monotonic() - t0
            sample.output_tokens = sample.output_tokens or sample.content_events
            if sample.ttft is None and sample.error is None:
                sample.error = "stream ended without content"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        sample.error = f"{type(e).__name__}: {e}"
    return sample


def header_timing(headers) -> dict[str, float] | None:
    """{name: ms} of a response's Server-Timing header(s), None when it has none."""
    values = headers.getall(st.HEADER, []) if hasattr(headers, "getall") else [
        v for k, v in headers.items() if k.lower() == st.HEADER.lower()]
    return st.parse(", ".join(values)) or None


def route_prediction(route: str | None) -> float | None:
    """The chosen upstream's predicted TTFT in an `x-prefixgate-route` header
    (`predicted_ttft_ms=chosen:78.6,runner-up:336.7`), None without one."""
    m = re.search(r"predicted_ttft_ms=([^,;\s]+)", route or "")
    if m is None:
        return None
    try:
        return float(m.group(1).rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None


def _event_json(data: bytes, s: Sample) -> dict | None:
    """An event's data as a JSON object; None (and `s.error` set) when it is not one or it is
    an error."""
    data = data.strip()
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        s.error = f"bad SSE event: {data[:80]!r}"
        return None
    if "error" in obj:
        s.error = f"error event: {error_message(data)}"
        return None
    return obj


def _content_at(now: float, t0: float, last: float | None, s: Sample) -> float:
    """A content event at `now`: the first sets TTFT, each later one adds a gap."""
    if last is None:
        s.ttft = now - t0
    else:
        s.itl.append(now - last)
    s.content_events += 1
    return now


def _on_event(event: Event, now: float, t0: float, last: float | None, s: Sample):
    """One OpenAI event (common/sse.py) into `s`; returns the time of the last content event
    so far."""
    data = event.data
    if data is None or data.strip() == DONE:
        return last
    obj = _event_json(data, s)
    if obj is None:
        return last
    usage = obj.get("usage")
    if usage:
        s.prompt_tokens = usage.get("prompt_tokens", s.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        s.cached_tokens = details.get("cached_tokens", s.cached_tokens)
        s.output_tokens = usage.get("completion_tokens") or s.output_tokens
    if s.text is not None:
        s.text.extend(c["delta"]["content"] for c in obj.get("choices") or ()
                      if isinstance((c.get("delta") or {}).get("content"), str))
    if has_content(obj) or (last is None and finished(obj)):
        return _content_at(now, t0, last, s)
    return last


def _on_message_event(event: Event, now: float, t0: float, last: float | None, s: Sample):
    """One Anthropic Messages event into `s` (module doc); returns the time of the last content
    event so far."""
    if event.data is None or event.event == "ping":
        return last
    obj = _event_json(event.data, s)
    if obj is None:
        return last
    kind = obj.get("type") or event.event
    if kind == "message_start":
        _message_usage((obj.get("message") or {}).get("usage"), s)
    elif kind == "message_delta":
        _message_usage(obj.get("usage"), s)
    elif kind == "content_block_delta":
        delta = obj.get("delta") or {}
        piece = delta.get(CONTENT_DELTAS.get(delta.get("type"), ""))
        if piece:
            if s.text is not None and delta["type"] == "text_delta":
                s.text.append(piece)
            return _content_at(now, t0, last, s)
    return last


def _message_usage(usage: dict | None, s: Sample) -> None:
    """A Messages usage block into `s`: the fields it has replace the ones before (vLLM's
    `message_start` has the whole prompt as `input_tokens`, its `message_delta` splits off
    the cached part; Anthropic's own `message_delta` may carry `output_tokens` alone)."""
    if not isinstance(usage, dict):
        return
    merged = s.message_usage = {**(s.message_usage or {}),
                                **{k: v for k, v in usage.items() if isinstance(v, int)}}
    parts = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    if any(k in merged for k in parts):
        s.prompt_tokens = sum(merged.get(k, 0) for k in parts)
    s.cached_tokens = merged.get("cache_read_input_tokens", s.cached_tokens)
    s.output_tokens = merged.get("output_tokens") or s.output_tokens


def finished(event: dict) -> bool:
    """A finish reason: when nothing came before it, the only token decoded to no text (a
    special token, a partial UTF-8 sequence), yet it was produced: that is the first token."""
    return any(c.get("finish_reason") for c in event.get("choices") or ())


def error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace")


Send = Callable[[Sample], Awaitable[Sample]]


async def closed_loop(send: Send, samples: list[Sample], concurrency: int,
                      on_done: Callable[[Sample], None], think_s: float = 0.0,
                      seed: int = 0) -> None:
    """`concurrency` users, each sending its next request when its last one ended, after a
    pause (exponential, mean `think_s`; 0: back to back). With pauses the users start at
    random moments within one mean pause, as users of a live service do."""
    queue = iter(samples)

    async def user(rng: random.Random):
        pause = rng.uniform(0.0, think_s) if think_s > 0 else 0.0
        for s in queue:          # a shared iterator: each sample is taken once
            if pause:
                await asyncio.sleep(pause)
            await send(s)
            on_done(s)
            pause = rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
    await asyncio.gather(*(user(random.Random(f"{seed}:user:{u}"))
                           for u in range(max(1, concurrency))))


async def open_loop(send: Send, samples: list[Sample], rate: float, seed: int,
                    on_done: Callable[[Sample], None]) -> None:
    """Poisson arrivals at `rate` requests/s, whatever the server's pace (no back-pressure)."""
    rng = random.Random(seed)
    tasks = []
    next_at = time.monotonic()

    async def one(s):
        await send(s)
        on_done(s)
    for s in samples:
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(s)))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
