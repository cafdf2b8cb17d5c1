"""One request's TTFT breakdown: its `Server-Timing` header and its `llm_request` span.

Made of time.monotonic() stamps: the HTTP arrival (the server's, kept here) and the engine's
own, which every RequestOutput carries (the ones the Prometheus histograms observe too):
arrival (add_request, after tokenization, as vLLM's), first scheduled, first token sampled,
last token sampled. The header's entries, in ms:

  tokenize  HTTP arrival -> handed to the engine (body, JSON, chat template, tokenization)
  kv_pull   (a decode engine's leg 2 only) pulling the prompt's KV from the prefill engine
  queue     engine arrival -> first scheduled        (prefixgate:request_queue_time_seconds,
            which includes kv_pull: the sequence arrives before its pull)
  prefill   first scheduled -> first token sampled   (prefixgate:request_prefill_time_seconds),
            desc="computed=N cached=M": prompt tokens computed / served from the prefix cache
  decode    first token sampled -> the server writing it (detokenize, the engine thread ->
            event loop hand-off, SSE framing); a whole answer writes its first token with
            its last, so there it spans the decode steps too

queue + prefill is prefixgate:time_to_first_token_seconds; the entries add up to the server's
share of the client's time to first token. With tracing, one SERVER span `llm_request`
(vLLM's name and `gen_ai.*` attributes) runs from the HTTP arrival to the request's end.
"""
from __future__ import annotations

import asyncio
import time

from prefixgate.backend.engine import RequestOutput
from prefixgate.common import server_timing
from prefixgate.common.errors import HTTPError
from prefixgate.common.tracing import wall_ns


class RequestTiming:
    """Stamps of one chat/completions request; `with` it around the handler to end its span."""

    def __init__(self, tracer=None, headers=None):
        self.arrival = time.monotonic()           # HTTP arrival
        self.first: RequestOutput | None = None   # the first output (carries the first token)
        self.last: RequestOutput | None = None
        self.kv_pull: float | None = None         # seconds, on a decode engine's leg 2
        self.span = None
        if tracer is not None:          # a proxy.tracing.Tracing
            self._wall0 = wall_ns(self.arrival)
            self.span = tracer.start("llm_request", kind=tracer.kind_server,
                                     parent=tracer.parent(headers), start_ns=self._wall0)

    def output(self, out: RequestOutput) -> None:
        """Each output the server takes from the engine, in order."""
        if self.first is None:
            self.first = out
        self.last = out

    def header(self) -> str:
        """The Server-Timing value, the first token being written now."""
        out, now = self.first, time.monotonic()
        cached = out.cached_tokens
        pull = self.kv_pull or 0.0
        return server_timing.join(
            server_timing.entry("tokenize", (out.arrival_time - self.arrival) * 1e3),
            *([server_timing.entry("kv_pull", pull * 1e3)]
              if self.kv_pull is not None else []),
            server_timing.entry("queue",
                                (out.first_scheduled_time - out.arrival_time - pull) * 1e3),
            server_timing.entry("prefill", (out.first_token_time - out.first_scheduled_time) * 1e3,
                                f"computed={out.prompt_tokens - cached} cached={cached}"),
            server_timing.entry("decode", (now - out.first_token_time) * 1e3))

    def describe(self, request_id: str, model: str, params) -> None:
        """What was asked for (the span's request attributes)."""
        if self.span is not None:
            self.span.set_attributes({
                "gen_ai.request.id": request_id, "gen_ai.response.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p})

    def __enter__(self) -> RequestTiming:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if self.span is not None:
            self._end(error)
        return False

    def _end(self, error: BaseException | None) -> None:
        span, out = self.span, self.last
        if out is not None:
            t0 = out.arrival_time
            span.set_attributes({
                "gen_ai.usage.input_tokens": out.prompt_tokens,
                "gen_ai.usage.output_tokens": out.completion_tokens,
                "prefixgate.cached_tokens": out.cached_tokens,
                "prefixgate.latency.tokenize": t0 - self.arrival,
                "gen_ai.latency.time_in_queue": out.first_scheduled_time - t0,
                "gen_ai.latency.time_to_first_token": out.first_token_time - t0,
                "gen_ai.latency.e2e": out.last_token_time - t0,
                "gen_ai.latency.time_in_model_prefill":
                    out.first_token_time - out.first_scheduled_time,
                "gen_ai.latency.time_in_model_decode": out.last_token_time - out.first_token_time,
                "gen_ai.latency.time_in_model_inference":
                    out.last_token_time - out.first_scheduled_time})
            span.add_event("scheduled", timestamp=self._ns(out.first_scheduled_time))
            span.add_event("first_token", timestamp=self._ns(out.first_token_time))
        failed = _why(error) if error is not None else (
            None if out is not None and out.finished else "the engine did not finish the request")
        if failed is not None:
            from opentelemetry.trace import StatusCode  # loaded already: a span exists

            span.set_status(StatusCode.ERROR, failed)
        span.end()

    def _ns(self, t: float) -> int:
        """A stamp on the span's clock (one offset per request, so events stay in order)."""
        return self._wall0 + int((t - self.arrival) * 1e9)


def _why(error: BaseException) -> str:
    if isinstance(error, asyncio.CancelledError | ConnectionResetError):
        return "aborted: the client disconnected"
    if isinstance(error, HTTPError):
        return f"{error.status}: {error.message}"
    return f"{type(error).__name__}: {error}"
