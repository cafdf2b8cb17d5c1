"""The gateway's aiohttp app and its handlers. A proxied request goes parse → chain → decide
→ exchange → relay → finish (DESIGN.md §2): each upstream tried is one exchange.Attempt (a P/D
request's legs: pd.py), and the answer the client gets is relayed as the upstream sent it."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from urllib.parse import quote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from prefixgate.common import server_timing
from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import encode_body, json_errors_middleware, parse_json_object
from prefixgate.proxy import guard, pd, response_ids, route, token_forward, warm
from prefixgate.proxy.auth import Auth
from prefixgate.proxy.chain import TrackingRegistry, build_chain
from prefixgate.proxy.config import reload
from prefixgate.proxy.context import RequestContext
from prefixgate.proxy.endpoints import ENDPOINTS, Endpoint, passthrough
from prefixgate.proxy.exchange import HOP_BY_HOP, RETRY_STATUSES, Attempt, UpstreamFailed, may_retry
from prefixgate.proxy.observe import breakdown, usage
from prefixgate.proxy.observe.observer import Observer
from prefixgate.proxy.rate_limits import RateLimits
from prefixgate.proxy.upstream import h1pool, multipart
from prefixgate.proxy.upstream.discovery import Discovery
from prefixgate.proxy.upstream.health import Health
from prefixgate.proxy.upstream.upstreams import Upstream

log = logging.getLogger("prefixgate")

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


class Gateway:
    def __init__(self, config: dict):
        self.config = config
        self.registry: CollectorRegistry = TrackingRegistry()
        self.on_connect: list = []          # (upstream, seconds) callbacks, e.g. metrics
        self.upstreams = [Upstream(u, self.on_connect) for u in config["upstreams"]]
        self.retries = config["retries"]
        self.health = Health(config["health"], self)
        self.discovery = Discovery(config.get("discovery"), self)
        self.auth = Auth(config["auth"])
        self.limits = RateLimits(config["rate_limits"], self.auth.keys)
        self.plugin_owned: dict = {}        # plugin -> (its collectors, its connect hooks)
        self.plugin_keys: list = []         # [(config key, plugin)] in chain order
        self.chain = build_chain(self, config["plugins"])
        self.response_ids = response_ids.ResponseIds(config["responses"])
        # the access log and traces (None when neither is configured: nothing on the path)
        self.observer = Observer.from_config(config)
        self.warmer = warm.Warmer(self)

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.observer is not None:
            self.observer.start()
        for up in self.upstreams:
            await up.start()
        await self.health.start()
        await self.discovery.start()
        for start in self.chain.start:
            await start()

    async def close(self) -> None:
        for close in self.chain.close:
            await close()
        await self.discovery.close()
        await self.health.close()
        for up in self.upstreams:
            await up.close()
        await self.limits.close()
        await self.warmer.close()
        if self.observer is not None:
            await asyncio.to_thread(self.observer.close)

    async def set_upstreams(self, configs: list[dict]) -> None:
        """Replace the upstream set (discovery, hot reload) without a restart.

        Upstreams whose name and URL are unchanged keep their pool and counters; new ones
        are started; removed ones stop receiving requests at once and are closed after
        their in-flight requests finish.
        """
        current = {(u.name, u.url): u for u in self.upstreams}
        wanted, new = [], []
        for cfg in configs:
            up = current.pop((cfg["name"], cfg["url"]), None)
            if up is None:
                up = Upstream(cfg, self.on_connect)
                await up.start()
                new.append(up)
            wanted.append(up)
        self.upstreams = wanted
        for gone in current.values():
            asyncio.get_running_loop().create_task(self._drain_and_close(gone))

    @staticmethod
    async def _drain_and_close(up: Upstream, poll_s: float = 0.1) -> None:
        while up.inflight:
            await asyncio.sleep(poll_s)
        await up.close()

    def make_app(self) -> web.Application:
        observing = [self.observer.middleware()] if self.observer is not None else []
        app = web.Application(client_max_size=self.config["limits"]["max_body_bytes"],
                              middlewares=[*observing, self._errors_middleware()])
        for endpoint in ENDPOINTS + passthrough(self.config["passthrough"]):
            app.router.add_route(endpoint.method, endpoint.path, self._handler(endpoint))
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        if self.config.get("admin_listen") is None:
            app.router.add_get("/metrics", self.handle_metrics)

        async def on_startup(_):
            await self.start()

        async def on_cleanup(_):
            await self.close()
        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    def make_admin_app(self) -> web.Application:
        """/metrics and /health for `admin_listen:` (kept off the public address)."""
        app = web.Application(middlewares=[self._errors_middleware()])
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/health", self.handle_health_detail)
        return app

    def server_kw(self) -> dict:
        """start_app() settings from `limits:` and `shutdown_timeout_s`."""
        limits = self.config["limits"]
        return {"max_line_size": limits["max_line_bytes"],
                "max_field_size": limits["max_header_bytes"],
                "max_headers": limits["max_headers"],
                # aiohttp arms this at connect and after each response: it also ends
                # connections that trickle a request head (header slowloris)
                "keepalive_timeout": limits["idle_timeout_s"],
                "shutdown_timeout": self.config["shutdown_timeout_s"]}

    async def reload(self, cfg: dict) -> None:
        """Apply a new validated config; in-flight requests finish on what they started with."""
        await reload.apply(self, cfg)

    # --- errors ----------------------------------------------------------------------------
    def _error_reason(self, request: web.Request, status: int) -> str | None:
        """Messages for aiohttp's own errors (the router's 404/405, the body limit's 413)."""
        if status == 413:
            return guard.too_large(self.config["limits"]["max_body_bytes"]).message
        if status == 404:
            return f"no route for {request.method} {request.path}"
        if status == 405:
            return f"method {request.method} not allowed on {request.path}"
        return None

    def _errors_middleware(self):
        return json_errors_middleware(self._error_reason, passthrough=(ClientGone,),
                                      internal_message="internal gateway error", logger=log)

    # --- routing ---------------------------------------------------------------------------
    def decide(self, ctx: RequestContext, tried: list[Upstream] = ()) -> Upstream:
        """One routing decision for this attempt, on the chain the request is pinned to
        (a P/D request's decode upstream: by load alone, proxy/pd.py)."""
        scorers = pd.DECODE_SCORERS if pd.active(ctx) else None
        return route.decide(self.upstreams, ctx.chain or self.chain, ctx, tried,
                            scorers=scorers)

    # --- handlers --------------------------------------------------------------------------
    def _handler(self, endpoint: Endpoint):
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.handle(request, endpoint)
        return handle

    async def handle(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """One proxied request: parse → chain → decide → exchange → relay → finish."""
        # the route's own path, never the request's: nothing a client sends picks the URL
        ctx = RequestContext(request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
                             path=endpoint.path, body={}, headers=request.headers,
                             endpoint=endpoint, target=upstream_path(endpoint, request))
        ctx.stamp("received")
        if self.observer is not None:
            self.observer.begin(request, ctx)
        chain = ctx.chain = self.chain     # a reload does not change it mid-request
        chain.active += 1
        error: BaseException | None = None
        try:
            await self._parse(request, ctx)
            if endpoint.prompt:
                for hook in chain.on_request:
                    await hook(ctx)
            ctx.stamp("plugins_done")
            await self._route(ctx)
            return await self.forward(request, ctx)      # exchange → relay
        except HTTPError as e:
            error = e
            ctx.status, ctx.error = e.status, e.message
            resp = e.response(self._our_headers(ctx))
            if e.headers.get("Connection") == "close":
                resp.force_close()        # e.g. a trickled body: don't wait for the rest
            return resp
        except (asyncio.CancelledError, ClientGone) as e:
            error = e
            ctx.status = 499          # nginx's "client closed request"
            ctx.error = ctx.error or "the client closed the connection"
            raise
        except BaseException as e:
            error = e
            ctx.status, ctx.error = 500, f"internal gateway error ({type(e).__name__})"
            raise
        finally:
            self._finish(ctx, error)

    async def _parse(self, request: web.Request, ctx: RequestContext) -> None:
        """Who asks (their key and its limits), the body and the model it names, and the
        upstream a stored response pins the request to."""
        self._authenticate(ctx)
        await self._read(request, ctx)
        await self.limits.admit(ctx)             # per model too: after the body names it
        if ctx.endpoint.prompt and warm.requested(ctx):
            warm.prepare(ctx)                    # its prompt alone is computed
        if ctx.endpoint.responses:
            self._follow_response(request, ctx)
        ctx.stamp("parsed")

    def _follow_response(self, request: web.Request, ctx: RequestContext) -> None:
        """A read, cancel or follow-up of a stored response: pinned to the upstream its id
        names, which is sent its own id (proxy/response_ids.py)."""
        in_path = request.match_info.get("response_id")
        client_id = in_path or ctx.body.get("previous_response_id")
        if not isinstance(client_id, str):
            return
        found = self.response_ids.unwrap(client_id, self.upstreams)
        if found is None:
            return
        ctx.pin, upstream_id = found
        if in_path is not None:
            ctx.target = ctx.endpoint.path.format(response_id=quote(upstream_id, safe=""))
        else:
            ctx.body["previous_response_id"] = upstream_id
            ctx.body_changed = True
            ctx.previous_response = (client_id, upstream_id)

    def _response_ids_for(self, ctx: RequestContext, up: Upstream) -> response_ids.Rewriter:
        return response_ids.Rewriter(self.response_ids, up.name, ctx.previous_response)

    async def _route(self, ctx: RequestContext) -> None:
        """The request's flow (plain or P/D) and upstream, then its slot there (an `admit`
        hook may queue it)."""
        ctx.pd = pd.protocol_for(self, ctx)
        ctx.upstream = self.decide(ctx)
        ctx.stamp("routed")
        for hook in ctx.chain.admit:
            await hook(ctx)
        ctx.stamp("admitted")

    def _finish(self, ctx: RequestContext, error: BaseException | None) -> None:
        """The key's tokens counted, the on_finish hooks (the access log line and the span
        end follow, in the observer's middleware)."""
        ctx.stamp("done")
        ctx.chain.active -= 1
        self.limits.charge(ctx)
        for hook in ctx.chain.on_finish:
            try:
                hook(ctx, error)
            except Exception:
                log.exception("plugin on_finish failed")

    async def _read(self, request: web.Request, ctx: RequestContext) -> None:
        """The request's body as its endpoint takes it, and the model it names."""
        limits, kind = self.config["limits"], ctx.endpoint.body
        if kind == "none":
            return
        if kind == "multipart":
            await self._read_upload_head(request, ctx)
            return
        ctx.raw_body = await guard.read_body(request, limits["body_timeout_s"])
        if kind == "raw":          # passthrough: routed by a JSON model when there is one
            try:
                ctx.body = parse_json_object(ctx.raw_body)
            except HTTPError:
                return
            self._set_model(ctx, ctx.body.get("model"), rewrite=False)
            ctx.stream = ctx.body.get("stream") is True
            return
        ctx.body = parse_json_object(ctx.raw_body)
        guard.check_depth(ctx.body, limits["max_json_depth"])
        if limits["validate_fields"]:
            guard.check_fields(ctx.path, ctx.body)
        ctx.stream = ctx.body.get("stream") is True
        self._set_model(ctx, ctx.body.get("model"), rewrite=True)

    async def _read_upload_head(self, request: web.Request, ctx: RequestContext) -> None:
        """A multipart upload: only its head (the form fields before the file part) is read
        here; `forward` streams the rest."""
        limits = self.config["limits"]
        if (request.content_length or 0) > limits["max_body_bytes"]:
            raise guard.too_large(limits["max_body_bytes"])
        boundary = multipart.boundary_of(request.headers.get("Content-Type", ""))
        if boundary is None:
            raise HTTPError(400, "expected a multipart/form-data body with a boundary",
                            code="invalid_request")
        spans: dict = {}
        try:
            async with asyncio.timeout(limits["body_timeout_s"]):
                head, fields = await multipart.read_head(request.content, boundary,
                                                         spans=spans)
        except ValueError as e:
            raise HTTPError(400, f"malformed multipart body: {e}",
                            code="invalid_request") from None
        except TimeoutError:
            raise guard.too_slow(limits["body_timeout_s"]) from None
        self._set_model(ctx, fields.get("model"), rewrite=False)
        sent = head
        if ctx.model is not None and ctx.model != fields["model"]:    # an alias: rewrite it
            start, end = spans["model"]
            sent = head[:start] + ctx.model.encode() + head[end:]
        ctx.raw_body, ctx.stream = sent, fields.get("stream") == "true"
        if request.content_length is not None:      # else it goes on chunked, as it came
            ctx.upload_length = request.content_length - len(head) + len(sent)

    def _set_model(self, ctx: RequestContext, model, rewrite: bool) -> None:
        """ctx.model from the body's field, through `model_aliases` (rewritten in a JSON
        body here, so the backend sees the name it serves; an upload's by its reader)."""
        if not isinstance(model, str):
            return
        served = self.config["model_aliases"].get(model)
        if served is not None:
            model = served
            if rewrite:
                ctx.body["model"] = served
                ctx.body_changed = True
        ctx.model = model

    def _authenticate(self, ctx: RequestContext) -> None:
        key = self.auth.identify(ctx.headers)
        if key is not None:
            ctx.key = key
            ctx.priority = key.priority or 0

    # --- exchange and relay ----------------------------------------------------------------
    async def forward(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        """Send to the chosen upstream; before the first byte, fail over to another one."""
        data = encode_body(ctx.body) if ctx.body_changed else ctx.raw_body
        if not ctx.endpoint.replayable:
            data = guard.capped(multipart.iter_body(ctx.raw_body, request.content),
                                self.config["limits"]["max_body_bytes"])
        while True:
            ctx.attempts += 1
            try:
                if pd.active(ctx):
                    return await pd.exchange(self, request, ctx, data)   # a prefill leg first
                return await self.relay(request, ctx, ctx.upstream, data)
            except UpstreamFailed as e:
                ctx.tried.append(ctx.upstream)
                failed = HTTPError(502, f"upstream {ctx.upstream.name} failed: {e}",
                                   code="upstream_unavailable")
                if not may_retry(self, ctx, ctx.tried):
                    raise failed from None
                try:
                    ctx.upstream = self.decide(ctx, ctx.tried)
                except HTTPError as no_other:
                    raise (failed if no_other.status == 503 else no_other) from None

    async def relay(self, request, ctx, up: Upstream, data) -> web.StreamResponse:
        """One attempt on `up` whose answer the client gets (the plain path, a P/D decode
        leg), relayed whole or as a stream; UpstreamFailed: another upstream may take it."""
        path, as_tokens = ctx.target, self._as_tokens(ctx, up)
        if as_tokens:
            path = "/v1/completions"
            data = encode_body(token_forward.chat_to_completions(ctx.body, ctx.tokens))
        with Attempt(self, ctx, up, path) as attempt:
            first = await attempt.send(ctx.endpoint.method, data, ctx.upload_length,
                                       read="first" if ctx.stream else "head")
            upstream_resp = attempt.resp
            ctx.upstream_timing = _header(upstream_resp, b"server-timing")
            if upstream_resp.status in RETRY_STATUSES and may_retry(self, ctx,
                                                                    [*ctx.tried, up]):
                raise attempt.give_up()
            if ctx.stream and is_event_stream(upstream_resp):
                return await self._relay_stream(request, ctx, attempt, first,
                                                token_forward.StreamConverter() if as_tokens
                                                else None)
            return await self._relay_whole(request, ctx, attempt, first, as_tokens)

    @staticmethod
    def _as_tokens(ctx: RequestContext, up: Upstream) -> bool:
        """Send this chat as token ids? (`forward: tokens` and prerender's tokens at hand)"""
        return (up.cfg.get("forward") == "tokens" and ctx.tokens is not None
                and not pd.active(ctx)                     # P/D legs go as the client sent
                and ctx.path == "/v1/chat/completions" and token_forward.eligible(ctx.body))

    async def _relay_whole(self, request, ctx, attempt: Attempt, first: bytes,
                           as_tokens: bool = False) -> web.Response:
        up, upstream_resp = attempt.up, attempt.resp
        try:
            async with asyncio.timeout(up.timeouts["idle"]):
                rest = await upstream_resp.read_all()
        except (TimeoutError, h1pool.UpstreamError) as e:
            attempt.broken(describe(e))
            raise HTTPError(502, f"upstream {up.name} failed mid-response: {describe(e)}",
                            code="upstream_error") from None
        body = first + rest
        answer = self._answer(ctx, upstream_resp, body)
        problem = broken_success(upstream_resp, answer) if ctx.endpoint.prompt else None
        if problem:
            attempt.broken(problem)
            raise HTTPError(502, f"upstream {up.name} {problem}", code="upstream_bad_response")
        if as_tokens and upstream_resp.status == 200:
            body = encode_body(token_forward.completion_to_chat(answer))
        if ctx.endpoint.responses and upstream_resp.status == 200 and isinstance(answer, dict):
            body = encode_body(self._response_ids_for(ctx, up).whole(answer))
        if ctx.warm == "api" and upstream_resp.status == 200:
            body = encode_body(self.warmer.answered(ctx, up.name, answer))
        ctx.stamp("first_byte")
        ctx.client_has_bytes = True
        for hook in ctx.chain.on_first_byte:
            hook(ctx)
        ctx.status, ctx.bytes_out = upstream_resp.status, len(body)
        return web.Response(status=upstream_resp.status, body=body,
                            headers=self._response_headers(ctx, upstream_resp))

    def _answer(self, ctx, upstream_resp, body: bytes) -> dict | None:
        """A whole JSON answer, parsed when it is checked (chat/completions), rewritten (the
        Responses API's ids), observed or counted (its usage, model and error message go
        into ctx)."""
        if "json" not in upstream_resp.content_type or not (
                ctx.endpoint.prompt or ctx.endpoint.responses or self.observer is not None
                or self.limits.counts_tokens):
            return None
        small = (ctx.endpoint.prompt or ctx.endpoint.responses
                 or len(body) <= usage.WHOLE_PARSE_BYTES)
        answer = usage.from_body(body) if small else usage.from_large_body(body)
        if answer is not None:
            ctx.answer = answer
            ctx.usage, model = answer.get("usage"), answer.get("model")
            ctx.response_model = model if isinstance(model, str) else None
            if upstream_resp.status >= 400:
                ctx.error = usage.error_message(answer)
        return answer

    async def _relay_stream(self, request, ctx, attempt: Attempt, first: bytes,
                            convert: token_forward.StreamConverter | None = None
                            ) -> web.StreamResponse:
        """Write each upstream chunk to the client as it arrives (`convert`: token-id
        completions rewritten into chat chunks, or the Responses API's ids swapped for the
        client's, event by event)."""
        up, upstream_resp = attempt.up, attempt.resp
        resp = EventStreamResponse(status=upstream_resp.status,
                                   headers=self._response_headers(ctx, upstream_resp))
        ctx.status = upstream_resp.status
        chain = ctx.chain
        on_chunk = chain.on_chunk
        idle = up.timeouts["idle"]
        if convert is None and ctx.endpoint.responses:      # the client's response ids
            convert = self._response_ids_for(ctx, up)
        keep_tail = self.observer is not None or chain.keeps_tail or self.limits.counts_tokens
        tail = ctx.tail = deque(maxlen=STREAM_TAIL_CHUNKS) if keep_tail else None
        try:
            ctx.stamp("first_byte")
            ctx.client_has_bytes = True      # from here on the answer is the client's
            await resp.prepare(request)      # headers are held back and sent with the first chunk
            chunk = first
            for hook in chain.on_first_byte:
                hook(ctx)
            while chunk:
                ctx.chunks += chunk.count(b"data:")
                ctx.bytes_out += len(chunk)
                if tail is not None:
                    tail.append(chunk)
                for hook in on_chunk:
                    hook(ctx, chunk)
                if convert is not None:
                    chunk = convert.feed(chunk) + (convert.flush() if upstream_resp.is_eof()
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
                    await resp.write(err.sse_event())
                    break
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as e:
            raise ClientGone(str(e)) from None
        return resp

    # --- headers ---------------------------------------------------------------------------
    def _our_headers(self, ctx: RequestContext) -> dict[str, str]:
        headers = {"x-prefixgate-request-id": ctx.request_id, **ctx.response_headers}
        if ctx.upstream is not None:
            headers["x-prefixgate-upstream"] = ctx.upstream.name
        return headers

    def _response_headers(self, ctx, upstream_resp) -> CIMultiDict:
        headers = CIMultiDict()
        for name, value in upstream_resp.headers:
            key = name.decode("latin-1")
            if key.lower() not in HOP_BY_HOP and key.lower() not in REPLACED_ANSWER_HEADERS:
                headers.add(key, value.decode("latin-1"))
        if ctx.stream:
            headers["Cache-Control"] = "no-cache"
            headers["X-Accel-Buffering"] = "no"       # tell any proxy in front not to buffer
        headers.update(self._our_headers(ctx))
        headers[server_timing.HEADER] = breakdown.header(ctx)
        return headers

    # --- other endpoints -------------------------------------------------------------------
    async def handle_models(self, request: web.Request) -> web.Response:
        """Every healthy upstream's models (asked afresh, which also updates routing), and
        the `model_aliases` names beside the models they stand for."""
        self.auth.identify(request.headers)
        healthy = [u for u in self.upstreams if u.healthy]
        await asyncio.gather(*(self.health.refresh_models(u) for u in healthy))
        known = [u for u in healthy if u.models is not None]
        if not known:
            raise HTTPError(502, "no upstream answered /v1/models", code="upstream_unavailable")
        merged: dict[str, dict] = {}
        for up in known:
            for card in up.model_cards or []:
                if card["id"] in up.models:
                    merged.setdefault(card["id"], card)
            for model in sorted(up.models - merged.keys()):     # a static `models:` list
                merged[model] = {"id": model, "object": "model", "owned_by": "prefixgate"}
        for public, served in self.config["model_aliases"].items():
            if served in merged:
                merged.setdefault(public, {**merged[served], "id": public, "root": served})
        return web.json_response({"object": "list", "data": list(merged.values())})

    async def handle_health(self, request: web.Request) -> web.Response:
        # with an admin address, the public /health says only up or down: upstream names,
        # addresses and errors are for operators
        return self._health(detail=self.config.get("admin_listen") is None)

    async def handle_health_detail(self, request: web.Request) -> web.Response:
        return self._health(detail=True)

    def _health(self, detail: bool) -> web.Response:
        ok = any(u.healthy for u in self.upstreams)
        body: dict = {"status": "ok" if ok else "unavailable"}
        if detail:
            body["upstreams"] = {u.name: self.health.report(u) for u in self.upstreams}
        return web.json_response(body, status=200 if ok else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})


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


def upstream_path(endpoint: Endpoint, request: web.Request) -> str:
    """The endpoint's route with its path parts filled in, each percent-encoded (a response
    id can never add a path segment of its own)."""
    if "{" not in endpoint.path:
        return endpoint.path
    return endpoint.path.format(**{k: quote(v, safe="")
                                   for k, v in request.match_info.items()})

