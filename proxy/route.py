"""One routing decision: filters → weighted scorers → pick (DESIGN.md §2).

Filters narrow the upstreams to those that can take the request: healthy, not already tried
by this request (unless every one was), and with room. When none has room and the chain can
queue (an `admit` hook), every candidate stays in: the best one is picked all the same and the
request waits for a slot on it. Scorers then add their weighted scores and the best total
wins, ties broken at random. The scorers run even when one candidate is left, so each request
is counted once in the route metrics and carries its route header whatever the fleet's size.
A decision is made once per attempt: a queued request is not scored again while it waits.
"""
from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterable

from prefixgate.proxy.errors import HTTPError

if TYPE_CHECKING:
    from prefixgate.proxy.context import RequestContext
    from prefixgate.proxy.chain import Chain
    from prefixgate.proxy.upstream import Upstream


def has_room(up: "Upstream") -> bool:
    return up.inflight < up.max_inflight


def decide(upstreams: list["Upstream"], chain: "Chain", ctx: "RequestContext",
           tried: Iterable["Upstream"] = ()) -> "Upstream":
    """The upstream for this attempt; HTTPError 503 (none healthy) or 429 (all full)."""
    healthy = [u for u in upstreams if u.healthy]
    if not healthy:
        raise HTTPError(503, "no healthy upstream", code="no_healthy_upstream",
                        headers={"Retry-After": "1"})
    candidates = [u for u in healthy if u not in tried] or healthy
    room = chain.room or has_room
    free = [u for u in candidates if room(u)]
    if not free:
        if not chain.admit:
            raise HTTPError(429, "all upstreams are at max_inflight", code="overloaded",
                            headers={"Retry-After": "1"})
        free = candidates          # all full: the request waits for the one picked here
    return pick(chain.scorers, ctx, free)


def pick(scorers: list, ctx: "RequestContext", candidates: list["Upstream"]) -> "Upstream":
    """The candidate with the best weighted sum of scores (ties at random)."""
    totals = dict.fromkeys(candidates, 0.0)
    for scorer in scorers:
        for up, score in scorer.score(ctx, candidates).items():
            totals[up] += scorer.weight * score
    best = max(totals.values())
    winners = [u for u, s in totals.items() if s == best]
    return winners[0] if len(winners) == 1 else random.choice(winners)
