"""The gateway's own endpoints, answered without an upstream attempt: `GET /v1/models` (the
fleet's models), `/health`, `/metrics` (Prometheus text). With `admin_listen:` the detailed
/health and /metrics move to the admin address."""
from __future__ import annotations

import asyncio

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixgate.common.errors import HTTPError


async def models(gw, request: web.Request) -> web.Response:
    """Every healthy upstream's models (asked afresh, which also updates routing), and the
    `model_aliases` names beside the models they stand for."""
    gw.auth.identify(request.headers)
    healthy = [u for u in gw.upstreams if u.healthy]
    await asyncio.gather(*(gw.health.refresh_models(u) for u in healthy))
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
    for public, served in gw.config["model_aliases"].items():
        if served in merged:
            merged.setdefault(public, {**merged[served], "id": public, "root": served})
    return web.json_response({"object": "list", "data": list(merged.values())})


async def health(gw, request: web.Request) -> web.Response:
    # with an admin address, the public /health says only up or down: upstream names,
    # addresses and errors are for operators
    return _health(gw, detail=gw.config.get("admin_listen") is None)


async def health_detail(gw, request: web.Request) -> web.Response:
    return _health(gw, detail=True)


def _health(gw, detail: bool) -> web.Response:
    ok = any(u.healthy for u in gw.upstreams)
    body: dict = {"status": "ok" if ok else "unavailable"}
    if detail:
        body["upstreams"] = {u.name: gw.health.report(u) for u in gw.upstreams}
    return web.json_response(body, status=200 if ok else 503)


async def metrics(gw, request: web.Request) -> web.Response:
    """This process's series; with `serve --workers N`, every worker's, labelled with its
    index (proxy/worker_metrics.py)."""
    body = (generate_latest(gw.registry) if gw.siblings is None
            else await gw.siblings.exposition())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
