"""Client-side measurement for `prefixgate bench`: one streamed request, and the two load
shapes (closed-loop concurrency, open-loop Poisson arrivals).

TTFT is measured where a user feels it: from just before the request is sent to the arrival
of the first SSE event that carries content (role-only and empty events do not count).
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
from prefixgate.common.sse import DONE, EventSplitter, data_of


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
    status: int | None = None
    error: str | None = None
    server_timing: dict[str, float] | None = None   # the response's Server-Timing, {name: ms}
    upstream: str | None = None      # x-prefixgate-upstream: where a prefixgate gateway sent it
    predicted_ttft_ms: float | None = None   # the gateway's prediction there (predicted_ttft)
    text: list[str] | None = None    # the answer's content pieces, when asked for (not archived)

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
        del d["text"]
        return d


def has_content(event: dict) -> bool:
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") \
                or choice.get("text"):
            return True
    return False


async def stream_once(session: aiohttp.ClientSession, url: str, body: dict, headers: dict,
                      sample: Sample, keep_text: bool = False) -> Sample:
    """POST `body` to `url` with stream=true and fill `sample` with what arrived when (and,
    with `keep_text`, the answer's text in `sample.text`)."""
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
                    last = _on_event(data_of(raw), now, t0, last, sample)
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


def _on_event(data: bytes | None, now: float, t0: float, last: float | None, s: Sample):
    """One event's data (common/sse.py; None: it has none) into `s`; returns the time of the
    last content event so far."""
    if data is None or data.strip() == DONE:
        return last
    data = data.strip()
    try:
        obj = json.loads(data)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        s.error = f"bad SSE event: {data[:80]!r}"
        return last
    if "error" in obj:
        s.error = f"error event: {error_message(data)}"
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
        if last is None:
            s.ttft = now - t0
        else:
            s.itl.append(now - last)
        s.content_events += 1
        return now
    return last


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
