"""Parse: the first step of a proxied request (DESIGN.md §2) — who asks (their key and its
limits), the body as its endpoint takes it (JSON, a passthrough's raw bytes, an upload's head)
and the model it names, and the upstream a stored response pins it to."""
from __future__ import annotations

import asyncio
from urllib.parse import quote

from aiohttp import web

from prefixgate.common.cache_control import CacheControlError, breakpoints
from prefixgate.common.errors import HTTPError
from prefixgate.common.runtime import parse_json_object
from prefixgate.proxy import guard, warm
from prefixgate.proxy.context import RequestContext
from prefixgate.proxy.endpoints import Endpoint
from prefixgate.proxy.upstream import multipart


async def parse(gw, request: web.Request, ctx: RequestContext) -> None:
    """Key, body, model; the key's rate limit; a warm API request's rewrite; a stored
    response's upstream."""
    authenticate(gw, ctx)
    await _read(gw, request, ctx)
    if ctx.endpoint.prompt:
        ctx.cache_breakpoints = read_breakpoints(ctx.body)
    gw.isolation.apply(ctx)                  # the tenant's cache_salt
    await gw.limits.admit(ctx)               # per model too: after the body names it
    if ctx.endpoint.prompt and warm.requested(ctx):
        warm.prepare(ctx)                    # its prompt alone is computed
    if ctx.endpoint.responses:
        _follow_response(gw, request, ctx)
    ctx.stamp("parsed")


def authenticate(gw, ctx: RequestContext) -> None:
    key = gw.auth.identify(ctx.headers)
    if key is not None:
        ctx.key = key
        ctx.priority = key.priority or 0


def read_breakpoints(body: dict) -> list:
    """The request's cache breakpoints (routing holds the prefix they mark, the engine keeps
    it); a malformed `cache_control` is the client's error, answered before anything is
    sent."""
    try:
        return breakpoints(body)
    except CacheControlError as e:
        raise HTTPError(400, str(e), code="invalid_request") from None


def _follow_response(gw, request: web.Request, ctx: RequestContext) -> None:
    """A read, cancel or follow-up of a stored response: pinned to the upstream its id
    names, which is sent its own id (proxy/response_ids.py)."""
    in_path = request.match_info.get("response_id")
    client_id = in_path or ctx.body.get("previous_response_id")
    if not isinstance(client_id, str):
        return
    found = gw.response_ids.unwrap(client_id, gw.upstreams)
    if found is None:
        return
    ctx.pin, upstream_id = found
    if in_path is not None:
        ctx.target = ctx.endpoint.path.format(response_id=quote(upstream_id, safe=""))
    else:
        ctx.body["previous_response_id"] = upstream_id
        ctx.body_changed = True
        ctx.previous_response = (client_id, upstream_id)


async def _read(gw, request: web.Request, ctx: RequestContext) -> None:
    """The request's body as its endpoint takes it, and the model it names."""
    limits, kind = gw.config["limits"], ctx.endpoint.body
    if kind == "none":
        return
    if kind == "multipart":
        await _read_upload_head(gw, request, ctx)
        return
    ctx.raw_body = await guard.read_body(request, limits["body_timeout_s"])
    if kind == "raw":          # passthrough: routed by a JSON model when there is one
        try:
            ctx.body = parse_json_object(ctx.raw_body)
        except HTTPError:
            return
        _set_model(gw, ctx, ctx.body.get("model"), rewrite=False)
        ctx.stream = ctx.body.get("stream") is True
        return
    ctx.body = parse_json_object(ctx.raw_body)
    guard.check_depth(ctx.body, limits["max_json_depth"])
    if limits["validate_fields"]:
        guard.check_fields(ctx.path, ctx.body)
    ctx.stream = ctx.body.get("stream") is True
    _set_model(gw, ctx, ctx.body.get("model"), rewrite=True)


async def _read_upload_head(gw, request: web.Request, ctx: RequestContext) -> None:
    """A multipart upload: only its head (the form fields before the file part) is read
    here; the relay streams the rest."""
    limits = gw.config["limits"]
    if (request.content_length or 0) > limits["max_body_bytes"]:
        raise guard.too_large(limits["max_body_bytes"])
    boundary = multipart.boundary_of(request.headers.get("Content-Type", ""))
    if boundary is None:
        raise HTTPError(400, "expected a multipart/form-data body with a boundary",
                        code="invalid_request")
    spans: dict = {}
    try:
        async with asyncio.timeout(limits["body_timeout_s"]):
            head, fields = await multipart.read_head(request.content, boundary, spans=spans)
    except ValueError as e:
        raise HTTPError(400, f"malformed multipart body: {e}",
                        code="invalid_request") from None
    except TimeoutError:
        raise guard.too_slow(limits["body_timeout_s"]) from None
    _set_model(gw, ctx, fields.get("model"), rewrite=False)
    sent = head
    if ctx.model is not None and ctx.model != fields["model"]:    # an alias: rewrite it
        start, end = spans["model"]
        sent = head[:start] + ctx.model.encode() + head[end:]
    ctx.raw_body, ctx.stream = sent, fields.get("stream") == "true"
    if request.content_length is not None:      # else it goes on chunked, as it came
        ctx.upload_length = request.content_length - len(head) + len(sent)


def _set_model(gw, ctx: RequestContext, model, rewrite: bool) -> None:
    """ctx.model from the body's field, through `model_aliases` (rewritten in a JSON body
    here, so the backend sees the name it serves; an upload's by its reader)."""
    if not isinstance(model, str):
        return
    served = gw.config["model_aliases"].get(model)
    if served is not None:
        model = served
        if rewrite:
            ctx.body["model"] = served
            ctx.body_changed = True
    ctx.model = model


def upstream_path(endpoint: Endpoint, request: web.Request) -> str:
    """The endpoint's route with its path parts filled in, each percent-encoded (a response
    id can never add a path segment of its own)."""
    if "{" not in endpoint.path:
        return endpoint.path
    return endpoint.path.format(**{k: quote(v, safe="")
                                   for k, v in request.match_info.items()})
