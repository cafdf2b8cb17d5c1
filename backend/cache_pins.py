"""cache_control pins: prefix-cache blocks a client said it will send again, kept until their ttl.

A request's Anthropic `cache_control` breakpoints (common/cache_control.py) each mark a prefix
the next request repeats; the server maps each to a whole number of blocks of the prompt (the
longest common token prefix of the marked prefix's render and the prompt's, floored to
blocks). Once those blocks are in the prefix cache (computed, or hit), their hashes are pinned
until now + ttl (5 minutes, or an hour); a later mark extends a pin, never shortens it.

The block manager (backend/block_manager.py) reads the pins when a block's last reference goes:
a pinned block waits apart from the LRU free queue and is handed out only when no unpinned free
block is left, the soonest-expiring first (with a second KV tier, copied there before it is
dropped). An expired pin is an ordinary LRU block again. Pins never refuse an allocation: under
pressure they give way, so a pin is a preference, not a reservation.

The cap (`--cache-pin-fraction` of the KV cache's blocks): a new pin over it ends the pins that
expire soonest, a prefix's tail before its head (a head block alone still serves hits; a tail
block without its head serves none). Why a cap: pinned blocks leave the LRU, so without one a
busy marked workload would leave unmarked prompts no prefix cache at all.

Keys are block hashes (the salted chain: a pin is per `cache_salt` too); times are the block
manager's clock (time.monotonic unless a test gives its own).
"""
from __future__ import annotations

import heapq
import itertools


class CachePins:
    """Pinned block hashes and when each pin ends; at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = max(0, capacity)
        self.expiry: dict[int, float] = {}      # block hash -> when its pin ends
        # (expiry, order, hash), soonest first; among equal expiries the last pinned first.
        # Entries whose pin was extended or ended stay until they reach the top (skipped).
        self._heap: list[tuple[float, int, int]] = []
        self._order = itertools.count(0, -1)
        self.dropped = 0            # pinned blocks reused under pressure before their expiry

    def __len__(self) -> int:
        return len(self.expiry)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.expiry

    def pin(self, hashes: list[int], until: float) -> tuple[list[int], list[int]]:
        """Pin a prefix's block hashes (in chain order) until `until`, extending older pins.
        Returns (the hashes newly pinned, the hashes whose pins ended to keep to the cap)."""
        new: list[int] = []
        for h in hashes[:self.capacity]:      # more than fit: the head, which serves hits
            old = self.expiry.get(h)
            if old is not None and old >= until:
                continue
            if old is None:
                new.append(h)
            self.expiry[h] = until
            heapq.heappush(self._heap, (until, next(self._order), h))
        ended = []
        while len(self.expiry) > self.capacity:
            ended.append(self._pop())
        return [h for h in new if h in self.expiry], ended

    def unpin(self, block_hash: int) -> None:
        """End a pin now (its block is dropped); the heap entry goes when it reaches the top."""
        self.expiry.pop(block_hash, None)

    def expired(self, now: float) -> list[int]:
        """End and return the pins whose time is up."""
        out = []
        while self._top() is not None and self._heap[0][0] <= now:
            out.append(self._pop())
        return out

    def span(self) -> tuple[float, float] | None:
        """The soonest and the latest expiry (None: no pin). Read-only: a /metrics scrape calls
        it from the event loop while the engine thread pins, so the values are copied in one
        C call and nothing is changed."""
        values = list(self.expiry.values())
        return (min(values), max(values)) if values else None

    def _top(self) -> tuple[float, int, int] | None:
        """The heap's first live entry (stale ones above it are dropped)."""
        heap = self._heap
        while heap and self.expiry.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _pop(self) -> int:
        until, _, h = self._top()
        heapq.heappop(self._heap)
        del self.expiry[h]
        return h
