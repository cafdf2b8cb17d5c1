"""One routing decision: filters → weighted scorers → pick (DESIGN.md §2).

Filters narrow the upstreams to those that can take the request: serving its model (404 when
none does), healthy and of the wanted role (P/D: `prefill` upstreams take only prefill legs;
everything else goes to `decode` and `both` ones), not already tried by this request (unless
every one was), and with room (the chain's `with_room` hooks, else fewer in flight than
`max_inflight`). When none has room and the chain can queue (an `admit` hook), every
candidate stays in: the best one is picked all the same and the request waits for a slot on
it. Scorers then add their weighted scores and the best total wins, ties broken at random.
The scorers run even when one candidate is left, so each request is counted once in the
route metrics and carries its route header whatever the fleet's size.
A decision is made once per attempt: a queued request is not scored again while it waits.
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prefixgate.common.errors import HTTPError

if TYPE_CHECKING:
    from prefixgate.proxy.chain import Chain
    from prefixgate.proxy.context import RequestContext
    from prefixgate.proxy.upstream.upstreams import Upstream


# upstream roles (the `role:` key) a decision may pick: plain requests and P/D decode legs,
# and P/D prefill legs
SERVING = frozenset({"decode", "both"})
PREFILL = frozenset({"prefill"})


class LeastLoaded:
    """The built-in load scorer (a P/D request's decode upstream): the lowest `Upstream.load`,
    with the polled KV-cache usage (0..1, where a poller scrapes it) breaking ties between
    equally loaded upstreams."""
    name = "least_loaded"
    weight = 1.0

    @staticmethod
    def score(ctx, upstreams) -> dict:
        return {u: -(u.load + (u.kv_usage or 0.0)) for u in upstreams}


def decide(upstreams: list[Upstream], chain: Chain, ctx: RequestContext,
           tried: Iterable[Upstream] = (), roles: frozenset = SERVING,
           scorers: list | None = None) -> Upstream:
    """The upstream for this attempt among those of `roles`, by `scorers` (default: the
    chain's); HTTPError 503 (none healthy) or 429 (all full)."""
    pinned = [u for u in upstreams if u.name == ctx.pin] if ctx.pin is not None else None
    if pinned:
        upstreams = pinned      # a stored response lives there and nowhere else
    elif ctx.model is not None or ctx.endpoint is None or ctx.endpoint.body != "none":
        upstreams = serving(upstreams, ctx.model)
    healthy = [u for u in upstreams if u.healthy and u.role in roles]
    if not healthy:
        raise HTTPError(503, _none_healthy(upstreams, roles), code="no_healthy_upstream",
                        headers={"Retry-After": "1"})
    candidates = ([u for u in healthy if u not in tried] or healthy) if tried else healthy
    free = with_room(chain, candidates)
    if not free:
        if not chain.admit:
            raise HTTPError(429, "all upstreams are at max_inflight", code="overloaded",
                            headers={"Retry-After": "1"})
        free = candidates          # all full: the request waits for the one picked here
    return pick(chain.scorers if scorers is None else scorers, ctx, free)


def with_room(chain: Chain, candidates: list[Upstream]) -> list[Upstream]:
    """The candidates with a free slot: by the chain's `with_room` hooks (admission counts
    its own slots), else those with fewer requests in flight than their `max_inflight`."""
    if not chain.with_room:
        return [u for u in candidates if u.inflight < u.max_inflight]
    for narrow in chain.with_room:
        candidates = narrow(candidates)
    return candidates


def _none_healthy(upstreams: list[Upstream], roles: frozenset) -> str:
    if not upstreams or any(u.role in roles for u in upstreams):
        return "no healthy upstream"
    return (f"no upstream with role {' or '.join(sorted(roles))} serves this request "
            f"(roles here: {', '.join(sorted({u.role for u in upstreams}))})")


def serving(upstreams: list[Upstream], model: str | None) -> list[Upstream]:
    """The upstreams that serve `model`; HTTPError 404 when none does, 400 when the request
    names no model and the fleet serves several (a single-model fleet takes it, as vLLM)."""
    if model is None:
        served = fleet_models(upstreams)
        if len(served) > 1:
            raise HTTPError(400, f"'model' is required: this gateway serves several models "
                            f"({', '.join(sorted(served))})", code="missing_model")
        return upstreams
    found = [u for u in upstreams if u.models is None or model in u.models]   # u.serves()
    if not found:
        raise HTTPError(404, f"model {model!r} is not served here; available: "
                        f"{', '.join(sorted(fleet_models(upstreams))) or 'none'}",
                        type="invalid_request_error", code="model_not_found")
    return found


def fleet_models(upstreams: list[Upstream]) -> set[str]:
    """Every model id some upstream is known to serve."""
    return set().union(*(u.models for u in upstreams if u.models is not None))


def pick(scorers: list, ctx: RequestContext, candidates: list[Upstream]) -> Upstream:
    """The candidate with the best weighted sum of scores (ties at random)."""
    if len(scorers) == 1:            # one scorer scoring every candidate: its scores are the
        totals = scorers[0].score(ctx, candidates)     # ranking (weights are > 0)
        if len(totals) < len(candidates):
            totals = {**dict.fromkeys(candidates, 0.0), **totals}
    else:
        totals = dict.fromkeys(candidates, 0.0)
        for scorer in scorers:
            for up, score in scorer.score(ctx, candidates).items():
                totals[up] += scorer.weight * score
    best = max(totals.values())
    winners = [u for u, s in totals.items() if s == best]
    return winners[0] if len(winners) == 1 else random.choice(winners)
