"""Seeing every request: its access-log line and its spans, made when it ends.

The gateway calls `begin` as a request arrives, `attempt`/`attempt_done` around each upstream
attempt (a CLIENT span, and the `traceparent` the upstream gets), and the middleware ends
every request — proxied or not (/health, /v1/models, the router's 404) — with `conclude`.
Nothing here runs when neither `access_log:` nor `tracing:` is configured (the gateway holds
no Observer then).

Spans follow the GenAI semantic conventions: the SERVER span is named
`{gen_ai.operation.name} {gen_ai.request.model}` ("chat llama-3-8b") with `gen_ai.*`
attributes, the breakdown as `prefixgate.*`; each attempt is a CLIENT span
`POST /v1/chat/completions` with the upstream's address.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from aiohttp import web

from prefixgate.proxy.observe import access_log, breakdown, usage
from prefixgate.proxy.observe.access_log import AccessLog
from prefixgate.proxy.observe.span_export import SpanExport

# where a proxied request's RequestContext waits for the middleware (aiohttp >= 3.12 has typed keys)
CTX_KEY = (web.RequestKey("prefixgate.ctx", object) if hasattr(web, "RequestKey")
           else "prefixgate.ctx")
# gen_ai.operation.name per endpoint (GenAI semconv's well-known values where one fits)
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings", "/v1/responses": "chat", "/v1/messages": "chat"}


@dataclass(slots=True)
class Attempt:
    span_id: int
    start_ns: int
    headers: list[tuple[str, str]]     # traceparent (+ tracestate) for the upstream


class Observer:
    def __init__(self, log: AccessLog | None, spans: SpanExport | None,
                 worker: int | None = None):
        self.log = log
        self.spans = spans
        self.worker = worker        # `serve --workers N`: this process's index, in every line

    @classmethod
    def from_config(cls, config: dict, worker=None) -> Observer | None:
        """`worker`: a worker of `serve --workers N` (proxy/workers.py), or None."""
        log_cfg, trace_cfg = config.get("access_log"), config.get("tracing")
        if log_cfg is None and trace_cfg is None:
            return None
        index = worker.index if worker is not None else None
        return cls(AccessLog(log_cfg) if log_cfg is not None else None,
                   SpanExport(trace_cfg, worker=index) if trace_cfg is not None else None,
                   index)

    def start(self) -> None:
        if self.log is not None:
            self.log.start()
        if self.spans is not None:
            self.spans.start()

    def close(self) -> None:
        """Flush and stop (blocking: call it off the event loop)."""
        if self.spans is not None:
            self.spans.close()
        if self.log is not None:
            self.log.close()

    def reopen(self) -> None:
        """SIGUSR1: reopen the access log file."""
        if self.log is not None:
            self.log.reopen()

    # --- a request's life ----------------------------------------------------------------
    def begin(self, request: web.Request, ctx) -> None:
        ctx.wall = time.time()
        request[CTX_KEY] = ctx
        if self.spans is not None:
            ctx.trace = self.spans.begin(request.headers)

    def begin_own(self, ctx) -> None:
        """A request the gateway sends itself (next-turn warming, proxy/warm.py): a trace of
        its own, sampled as any request."""
        ctx.wall = time.time()
        if self.spans is not None:
            ctx.trace = self.spans.begin({})

    def attempt(self, ctx) -> Attempt | None:
        trace = ctx.trace
        if trace is None:
            return None
        span_id = self.spans.new_span_id()
        headers = [("traceparent", trace.traceparent(span_id))]
        if trace.tracestate:
            headers.append(("tracestate", trace.tracestate))
        return Attempt(span_id, time.time_ns(), headers)

    def attempt_done(self, ctx, attempt: Attempt, up, path: str, resp,
                     failure: str | None) -> None:
        if not ctx.trace.sampled:
            return
        status = resp.status if resp is not None else None
        error = failure or (f"HTTP {status}" if status is not None and status >= 500 else None)
        facts = (ctx.endpoint.method, up.url + path, up.pool.host, up.pool.port, up.name,
                 ctx.attempts, ctx.model, status, failure)
        self.spans.record(ctx.trace, f"{ctx.endpoint.method} {ctx.path}", SpanExport.CLIENT,
                          attempt.span_id, ctx.trace.span_id, attempt.start_ns, time.time_ns(),
                          (attempt_attributes, facts), error)

    def middleware(self):
        @web.middleware
        async def observe(request: web.Request, handler):
            started, wall = time.monotonic(), time.time()
            try:
                resp = await handler(request)
            except BaseException as e:
                self.conclude(request, None, started, wall, e)
                raise
            self.conclude(request, resp, started, wall)
            return resp
        return observe

    def conclude(self, request: web.Request, resp, started: float, wall: float,
                 failed: BaseException | None = None) -> None:
        ctx = request.get(CTX_KEY)
        traced = ctx is not None and ctx.trace is not None and ctx.trace.sampled
        if self.log is None and not traced:
            return                          # an unsampled request: nothing to write
        if ctx is None:
            fields = self._plain_fields(request, resp, started, wall, failed)
        else:
            fields = self._fields(ctx, resp, request.remote, request.method, request.path)
        self._write(ctx, fields, traced)

    def conclude_own(self, ctx) -> None:
        """The end of a request the gateway sent itself (`begin_own`): its access-log line
        (its `warm` field says why it was sent) and span."""
        traced = ctx.trace is not None and ctx.trace.sampled
        if self.log is not None or traced:
            self._write(ctx, self._fields(ctx, None, None, ctx.endpoint.method, ctx.target),
                        traced)

    def _write(self, ctx, fields: dict, traced: bool) -> None:
        if self.worker is not None:
            fields["worker"] = self.worker
        if self.log is not None:
            self.log.write(fields)
        if traced:
            self._server_span(ctx, fields)

    # --- what is written -----------------------------------------------------------------
    def _fields(self, ctx, resp, client: str | None, method: str, path: str) -> dict:
        if ctx.tail:
            answer = usage.from_stream(ctx.tail)
            if answer is not None:
                ctx.usage, model = answer.get("usage"), answer.get("model")
                ctx.response_model = model if isinstance(model, str) else ctx.response_model
        prompt, cached, completion = usage.tokens(ctx.usage)
        end = ctx.t.get("done", time.monotonic())
        fields = {
            "ts": ctx.wall, "request_id": ctx.request_id, "client": client,
            "key": ctx.key.name if ctx.key is not None else None,
            "method": method, "path": path, "model": ctx.model,
            "stream": ctx.stream, "status": ctx.status or _status(resp),
            "upstream": ctx.upstream.name if ctx.upstream is not None else None,
            "attempts": ctx.attempts, "route": _route(ctx),
            # P/D (pd.py): the protocol or "fallback"; `upstream` is then the decode upstream
            "pd": ctx.pd,
            "prefill_upstream": ctx.prefill_upstream.name if ctx.prefill_upstream else None,
            "prefill_leg_ms": round(ctx.prefill_s * 1e3, 3) if ctx.prefill_s else None,
            "moved": [f"{m['type']}:{m['label']}" for m in ctx.moved] or None,
            "warm": ctx.warm,                      # api | next_turn (proxy/warm.py)
            "prompt_tokens": prompt, "cached_tokens": cached, "completion_tokens": completion,
            **breakdown.fields(ctx),
            "duration_ms": round((end - ctx.t["received"]) * 1e3, 3),
            "bytes_out": ctx.bytes_out or _body_length(resp), "error": ctx.error,
        }
        if fields["error"] is None and fields["status"] >= 400:    # a non-JSON error answer
            fields["error"] = f"HTTP {fields['status']}"
        return fields

    @staticmethod
    def _plain_fields(request, resp, started, wall, failed) -> dict:
        """A request that was not proxied (/health, /metrics, /v1/models, an unknown path)."""
        fields = dict.fromkeys(access_log.FIELDS)
        status = 499 if failed is not None else _status(resp)
        fields.update(ts=wall, request_id=request.headers.get("x-request-id"),
                      client=request.remote, method=request.method, path=request.path,
                      stream=False, status=status, attempts=0,
                      duration_ms=round((time.monotonic() - started) * 1e3, 3),
                      bytes_out=_body_length(resp),
                      error="the client closed the connection" if failed is not None
                      else _error_message(resp) if status >= 400 else None)
        return fields

    def _server_span(self, ctx, fields: dict) -> None:
        op = OPERATIONS.get(ctx.path) or ctx.path.rsplit("/", 1)[-1].strip("{}") or "request"
        status = fields["status"]
        # a server span's error is the server's failure (semconv): 5xx, not a client's 4xx
        error = (ctx.error or f"HTTP {status}") if status >= 500 else None
        facts = (op, ctx.response_model,
                 ctx.body.get("max_completion_tokens", ctx.body.get("max_tokens")))
        self.spans.record(ctx.trace, f"{op} {ctx.model}" if ctx.model else op,
                          SpanExport.SERVER, ctx.trace.span_id, ctx.trace.parent_id,
                          int(ctx.wall * 1e9), time.time_ns(), (server_attributes, (fields, facts)),
                          error)


# --- span attributes: named in the export process, from the facts the loop recorded -------

def server_attributes(f: dict, facts: tuple) -> dict:
    """The SERVER span's attributes (GenAI semconv, then prefixgate's own) from the request's
    access-log fields."""
    op, response_model, max_tokens = facts
    attrs = {"gen_ai.operation.name": op, "http.request.method": f["method"],
             "url.path": f["path"], "http.response.status_code": f["status"],
             "prefixgate.request_id": f["request_id"], "prefixgate.attempts": f["attempts"],
             "prefixgate.stream": f["stream"]}
    for key, value in (("client.address", f["client"]),
                       ("gen_ai.request.model", f["model"]),
                       ("gen_ai.response.model", response_model),
                       ("gen_ai.request.max_tokens", max_tokens),
                       ("gen_ai.usage.input_tokens", f["prompt_tokens"]),
                       ("gen_ai.usage.output_tokens", f["completion_tokens"]),
                       ("prefixgate.cached_tokens", f["cached_tokens"]),
                       ("prefixgate.upstream", f["upstream"]),
                       ("prefixgate.route", f["route"]), ("prefixgate.key", f["key"])):
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            attrs[key] = value
    for key in breakdown.FIELD_NAMES:
        if f[key] is not None:
            attrs[f"prefixgate.{key}"] = f[key]
    if f["status"] >= 500:
        attrs["error.type"] = str(f["status"])
    return attrs


def attempt_attributes(method, url, host, port, upstream, attempt, model, status,
                       failure) -> dict:
    """A CLIENT (attempt) span's attributes (HTTP client semconv)."""
    attrs = {"http.request.method": method, "url.full": url, "server.address": host,
             "server.port": port, "prefixgate.upstream": upstream, "prefixgate.attempt": attempt}
    if model is not None:
        attrs["gen_ai.request.model"] = model
    if status is not None:
        attrs["http.response.status_code"] = status
    if failure is not None:
        attrs["error.type"] = "upstream_failed"
    elif status is not None and status >= 500:
        attrs["error.type"] = str(status)
    return attrs


def _route(ctx) -> str | None:
    """Why this upstream: the routing plugin's account, else the scorers' names."""
    told = ctx.response_headers.get("x-prefixgate-route")
    if told is not None:
        return told
    if ctx.upstream is None or ctx.chain is None:
        return None
    return ",".join(s.name for s in ctx.chain.scorers) or None


def _status(resp) -> int:
    return resp.status if resp is not None else 500


def _error_message(resp) -> str | None:
    """An error answer's message: the JSON errors middleware wrote every one the gateway
    makes itself (the router's 404 and 405 among them)."""
    body = getattr(resp, "body", None)
    if not isinstance(body, (bytes, bytearray)):
        return None
    return usage.error_message(usage.from_body(body))


def _body_length(resp) -> int:
    body = getattr(resp, "body", None)
    return len(body) if isinstance(body, (bytes, bytearray)) else 0

