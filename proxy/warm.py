"""Warming a backend's prefix cache before the request that needs it.

- **The warm API.** A chat or completions request with `x-prefixgate-warm: 1` is routed like
  any other (normalize, prerender, prefix_route: it lands where the real request will), but
  only its prompt is computed: it goes out with `max_tokens: 1`, not streamed, and the client
  gets `{"warmed": true, "upstream": ..., "prompt_tokens": N, "cached_tokens": M}`, never the
  token. For applications that know what comes next: a RAG pipeline that has its documents
  before the question, an agent about to send a tool's result.
- **Next-turn warming** (`prerender: {warm_next_turn: true}`, plugins/prerender.py). When a
  chat answer ends, the conversation plus that answer, rendered through the chat template as
  the next request will begin, goes to the same upstream as a one-token completion of those
  token ids, so the next turn finds its whole history cached (the tokens an engine generated
  need not be the ones the template renders back, and the turn's closing tokens were never
  computed at all).

The gateway's own warm requests yield to clients' (`Warmer`): at most one at a time per
upstream, and none while requests wait for a slot on it or it has fewer than
`FREE_SLOTS` slots free; one that finds no room is dropped, never queued. Both kinds are
counted in `prefixgate_warm_requests_total{kind, outcome}`, with their tokens in
`prefixgate_warm_tokens_total{kind, part=prompt|cached}`, and logged in the access log
(`warm: api | next_turn`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from multidict import CIMultiDict, CIMultiDictProxy
from prometheus_client import Counter

from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import encode_body
from prefixgate.proxy.context import RequestContext
from prefixgate.proxy.endpoints import COMPLETIONS
from prefixgate.proxy.exchange import Attempt, UpstreamFailed
from prefixgate.proxy.observe import usage

HEADER = "x-prefixgate-warm"
FREE_SLOTS = 2              # an upstream with fewer free slots gets no next-turn warming
log = logging.getLogger("prefixgate.warm")


def requested(ctx) -> bool:
    return ctx.headers.get(HEADER, "").strip().lower() in ("1", "true")


def prepare(ctx) -> None:
    """A warm API request: its prompt alone is computed, in one whole (unstreamed) answer."""
    body = ctx.body
    body["max_tokens"] = 1
    for key in ("max_completion_tokens", "stream_options", "n", "best_of"):
        body.pop(key, None)
    body["stream"] = False
    ctx.body_changed, ctx.stream = True, False
    ctx.warm = "api"


class WarmAnswer:
    """The answer rewriter (proxy/rewrite.py) of a warm API request: the client gets what
    was warmed, never the token. (Its answer is never a stream: `prepare` saw to that.)"""

    def __init__(self, warmer: Warmer, ctx, upstream: str):
        self.warmer, self.ctx, self.upstream = warmer, ctx, upstream

    def whole(self, answer: dict) -> dict:
        return self.warmer.answered(self.ctx, self.upstream, answer)

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def flush(self) -> bytes:
        return b""


class Warmer:
    """Counts warm requests, and sends the gateway's own (next-turn warming) when there is
    room for them."""

    def __init__(self, gw):
        self.gw = gw                        # its upstreams' health, observer and registry
        registry = gw.registry
        self.requests = Counter("prefixgate_warm_requests", "Warm requests by kind (api, "
                                "next_turn) and outcome (warmed, failed, dropped: no room, "
                                "skipped: nothing to warm)",
                                ["kind", "outcome"], registry=registry)
        self.tokens = Counter("prefixgate_warm_tokens", "Prompt tokens of warm requests, and "
                              "those the backend had cached already", ["kind", "part"],
                              registry=registry)
        self._busy: set[str] = set()        # upstreams with a warm request of ours in flight
        self._tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- the warm API ----------------------------------------------------------------------
    def answered(self, ctx, upstream: str, answer: dict | None) -> dict:
        """The client's answer to a warm API request (the upstream answered 200)."""
        prompt, cached, _ = usage.tokens((answer or {}).get("usage"))
        self._count("api", "warmed", prompt, cached)
        return {"warmed": True, "upstream": upstream, "model": ctx.model,
                "prompt_tokens": prompt, "cached_tokens": cached}

    # --- next-turn warming -----------------------------------------------------------------
    def has_room(self, up) -> bool:
        return (up.name not in self._busy and up.healthy and not up.waiting
                and up.max_inflight - up.inflight >= FREE_SLOTS)

    def next_turn(self, up, model: str | None, request_id: str,
                  render: Callable[[], Awaitable[list[int] | None]],
                  cache_salt: str | None = None) -> bool:
        """If `up` has room (else the warm request is dropped): the token ids `render` makes
        (None: nothing to warm), sent to `up` as a one-token completion — under the turn's
        `cache_salt`, so it warms its tenant's cache and no other (proxy/isolation.py)."""
        if not self.has_room(up):
            self.requests.labels("next_turn", "dropped").inc()
            return False
        self._busy.add(up.name)
        task = asyncio.get_running_loop().create_task(
            self._send(up, model, request_id, render, cache_salt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _send(self, up, model, request_id: str, render, cache_salt) -> None:
        try:
            token_ids = await render()
            if not token_ids:
                self.requests.labels("next_turn", "skipped").inc()
                return
            await self._complete(up, model, request_id, token_ids, cache_salt)
        finally:
            self._busy.discard(up.name)

    async def _complete(self, up, model, request_id: str, token_ids: list[int],
                        cache_salt: str | None = None) -> None:
        """One warm request, an attempt like any other (proxy/exchange.py): counted in flight,
        its health outcome told, its span and access-log line written, marked `next_turn`."""
        body = {"prompt": token_ids, "max_tokens": 1, "temperature": 0}
        if model is not None:
            body["model"] = model
        if cache_salt is not None and self.gw.isolation.takes_salt(up):
            body["cache_salt"] = cache_salt
        ctx = RequestContext(request_id=f"{request_id}-warm", path=COMPLETIONS.path, body=body,
                             headers=CIMultiDictProxy(CIMultiDict()), endpoint=COMPLETIONS,
                             target=COMPLETIONS.path, model=model, upstream=up, warm="next_turn",
                             attempts=1)
        ctx.stamp("received")
        if self.gw.observer is not None:
            self.gw.observer.begin_own(ctx)
        try:
            with Attempt(self.gw, ctx, up, in_line=False) as attempt:
                answer = usage.from_body(await attempt.send("POST", encode_body(body), read="all"))
                ctx.status = attempt.resp.status
                if ctx.status == 200:
                    ctx.usage = (answer or {}).get("usage")
                else:
                    ctx.error = usage.error_message(answer) or f"HTTP {ctx.status}"
        except (UpstreamFailed, HTTPError) as e:
            ctx.status, ctx.error = getattr(e, "status", 502), str(e)
        ctx.stamp("done")
        prompt, cached, _ = usage.tokens(ctx.usage)
        self._count("next_turn", "warmed" if ctx.status == 200 else "failed", prompt, cached)
        if ctx.status != 200:
            log.debug("next-turn warm request to %s failed: %s", up.name, ctx.error)
        if self.gw.observer is not None:
            self.gw.observer.conclude_own(ctx)

    def _count(self, kind: str, outcome: str, prompt, cached) -> None:
        self.requests.labels(kind, outcome).inc()
        if prompt is not None:
            self.tokens.labels(kind, "prompt").inc(prompt)
            self.tokens.labels(kind, "cached").inc(cached or 0)
