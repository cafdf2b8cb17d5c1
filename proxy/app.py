"""The gateway: its aiohttp app, its lifecycle and the handler every proxied request goes
through — parse → chain → decide → exchange → relay → finish (DESIGN.md §2). Parsing is
proxy/parse.py; each upstream tried is one exchange.Attempt (a P/D request's legs: pd.py),
whose answer proxy/relay.py hands the client as the upstream sent it; the gateway's own
endpoints are proxy/admin.py."""
from __future__ import annotations

import asyncio
import logging
import secrets
from functools import partial

from aiohttp import web
from prometheus_client import CollectorRegistry

from prefixgate.common.errors import HTTPError, shape_for
from prefixgate.common.runtime import encode_body, json_errors_middleware
from prefixgate.proxy import (
    admin,
    guard,
    isolation,
    pd,
    relay,
    response_ids,
    route,
    token_forward,
    warm,
    worker_metrics,
)
from prefixgate.proxy.auth import Auth
from prefixgate.proxy.chain import TrackingRegistry, build_chain
from prefixgate.proxy.config import reload
from prefixgate.proxy.context import RequestContext
from prefixgate.proxy.endpoints import ENDPOINTS, Endpoint, passthrough
from prefixgate.proxy.exchange import UpstreamFailed, may_retry
from prefixgate.proxy.observe.observer import Observer
from prefixgate.proxy.parse import parse, upstream_path
from prefixgate.proxy.rate_limits import RateLimits
from prefixgate.proxy.relay import ClientGone
from prefixgate.proxy.upstream import multipart
from prefixgate.proxy.upstream.discovery import Discovery
from prefixgate.proxy.upstream.health import Health
from prefixgate.proxy.upstream.upstreams import Upstream

log = logging.getLogger("prefixgate")


class Gateway:
    def __init__(self, config: dict, worker=None):
        self.config = config
        # one of the processes of `serve --workers N` (proxy/workers.py `Worker`), or None
        self.worker = worker
        self.registry: CollectorRegistry = TrackingRegistry()
        self.on_connect: list = []          # (upstream, seconds) callbacks, e.g. metrics
        self.upstreams = [Upstream(u, self.on_connect) for u in config["upstreams"]]
        self.retries = config["retries"]
        self.health = Health(config["health"], self)
        self.discovery = Discovery(config.get("discovery"), self)
        self.auth = Auth(config["auth"])
        self.isolation = isolation.for_config(config, self.auth.keys)
        self.limits = RateLimits(config["rate_limits"], self.auth.keys)
        self.plugin_owned: dict = {}        # plugin -> (its collectors, its connect hooks)
        self.plugin_keys: list = []         # [(config key, plugin)] in chain order
        self.chain = build_chain(self, config["plugins"])
        self.response_ids = response_ids.ResponseIds(config["responses"])
        # the access log and traces (None when neither is configured: nothing on the path)
        self.observer = Observer.from_config(config, worker)
        self.warmer = warm.Warmer(self)
        # /metrics for every worker (None: this process is the only one)
        self.siblings = worker_metrics.Siblings(self, worker) if worker is not None else None

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.observer is not None:
            self.observer.start()
        if self.siblings is not None:
            await self.siblings.start()
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
        if self.siblings is not None:
            await self.siblings.close()
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
        app.router.add_get("/v1/models", partial(admin.models, self))
        app.router.add_get("/health", partial(admin.health, self))
        if self.config.get("admin_listen") is None:
            app.router.add_get("/metrics", partial(admin.metrics, self))

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
        app.router.add_get("/metrics", partial(admin.metrics, self))
        app.router.add_get("/health", partial(admin.health_detail, self))
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
        request_id = request.headers.get("x-request-id") or secrets.token_hex(16)
        ctx = RequestContext(request_id=request_id, path=endpoint.path, body={},
                             headers=request.headers, endpoint=endpoint,
                             target=upstream_path(endpoint, request))
        ctx.stamp("received")
        if self.observer is not None:
            self.observer.begin(request, ctx)
        chain = ctx.chain = self.chain     # a reload does not change it mid-request
        chain.active += 1
        error: BaseException | None = None
        try:
            await parse(self, request, ctx)
            if endpoint.prompt:
                for hook in chain.on_request:
                    await hook(ctx)
            ctx.stamp("plugins_done")
            await self._route(ctx)
            return await self.forward(request, ctx)      # exchange → relay
        except HTTPError as e:
            error = e
            ctx.status, ctx.error = e.status, e.message
            resp = e.response(relay.our_headers(ctx), shape=shape_for(ctx.path))
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

    # --- exchange ---------------------------------------------------------------------------
    async def forward(self, request: web.Request, ctx: RequestContext) -> web.StreamResponse:
        """Send to the chosen upstream; before the first byte, fail over to another one."""
        if not ctx.endpoint.replayable:
            data = guard.capped(multipart.iter_body(ctx.raw_body, request.content),
                                self.config["limits"]["max_body_bytes"])
        else:
            data = self._body_for(ctx)
        while True:
            ctx.attempts += 1
            try:
                if pd.active(ctx):
                    return await pd.exchange(self, request, ctx, data)   # a prefill leg first
                return await relay.answer(self, request, ctx, ctx.upstream, data,
                                          token_forward.applies(ctx, ctx.upstream))
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
                if ctx.endpoint.replayable:
                    data = self._body_for(ctx)

    def _body_for(self, ctx: RequestContext) -> bytes:
        """The bytes `ctx.upstream` is sent: with or without the salt, as it takes it."""
        self.isolation.fit(ctx, ctx.upstream)
        return encode_body(ctx.body) if ctx.body_changed else ctx.raw_body
