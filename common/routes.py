"""An aiohttp app's routes from a table, for the gateway's and the engine's servers and the
test stand-ins: `{"POST /v1/chat/completions": handler, "GET /health": handler, ...}`."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(app: web.Application, routes: dict[str, Handler]) -> None:
    """Each "METHOD PATH" of `routes` on `app`'s router, in order; a GET answers HEAD too
    (as `add_get` does)."""
    for route, handler in routes.items():
        method, path = route.split()
        if method == "GET":
            app.router.add_get(path, handler)
        else:
            app.router.add_route(method, path, handler)
