"""The engine benchmarks' one client: a greedy completion of token ids over HTTP, streamed
and read through the one SSE reader (common/sse.py), timed from just before it is sent; or
whole, for throughput."""
from __future__ import annotations

import time
from dataclasses import dataclass

from prefixgate.common.sse import json_of, read_events


@dataclass
class Streamed:
    """What one streamed completion took and reported."""

    ttft_s: float | None = None     # seconds from sending it to its first token
    last_s: float | None = None     # ... to its last token
    tokens: int = 0                 # completion tokens (the usage chunk)
    cached: int = 0                 # prompt tokens the engine served from its cache (usage)


async def timed_events(session, url: str, path: str, body: dict):
    """POST `body` to `url` + `path` and yield (seconds since it was sent, event) for each
    JSON event of its stream. RuntimeError on a status other than 200."""
    t0 = time.perf_counter()
    async with session.post(url + path, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for raw in read_events(r.content.iter_any()):
            event = json_of(raw)
            if isinstance(event, dict):
                yield time.perf_counter() - t0, event


async def stream_completion(session, url: str, prompt: list[int], max_tokens: int = 1,
                            model: str | None = None) -> Streamed:
    """POST one streamed greedy completion of `prompt` (every token generated: ignore_eos) to
    `url`/v1/completions and read it to its end. RuntimeError on a status other than 200."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    seen = Streamed()
    async for elapsed, chunk in timed_events(session, url, "/v1/completions", body):
        if chunk.get("choices"):
            seen.last_s = elapsed
            seen.ttft_s = seen.ttft_s or seen.last_s
        if usage := chunk.get("usage"):
            seen.tokens = usage.get("completion_tokens", seen.tokens)
            details = usage.get("prompt_tokens_details") or {}
            seen.cached = details.get("cached_tokens") or 0
    return seen


async def ttft(session, url: str, prompt: list[int], max_tokens: int = 1) -> float:
    """Seconds from sending the request to the first streamed token; reads the stream to its
    end."""
    return (await stream_completion(session, url, prompt, max_tokens)).ttft_s


async def complete(session, url: str, prompt: list[int], max_tokens: int) -> int:
    """One whole (non-streamed) greedy completion; returns the completion tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        return (await r.json())["usage"]["completion_tokens"]
