"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018).

Each upstream owns `virtual_nodes × weight` points on a 64-bit ring, placed by hashing its
name, so every gateway replica that knows the same names builds the same ring with no shared
state. A key goes to the first upstream clockwise from its hash whose load is under
`ceil(load_factor × (total load + 1) × its share of the weight)`; an upstream over that bound
passes the key on to the next one on the ring. No upstream ever holds more than
`load_factor` times its share, and a key only moves when its home is over the bound, down or
gone — and moves back when that ends.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable

import xxhash


class HashRing:
    def __init__(self, members: Iterable[tuple[str, float]], virtual_nodes: int):
        points = []
        for name, weight in members:
            for i in range(max(1, round(virtual_nodes * weight))):
                points.append((xxhash.xxh64_intdigest(f"{name}#{i}".encode()), name))
        points.sort()
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self.names = frozenset(self._owners)

    def __len__(self) -> int:
        return len(self.names)

    def walk(self, key: int):
        """Distinct upstream names in ring order, starting at the first point after `key`."""
        n = len(self._points)
        if not n:
            return
        start = bisect_right(self._points, key)
        seen = set()
        owners = self._owners
        for i in range(start, start + n):
            name = owners[i % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self.names):
                    return

    def choose(self, key: int, loads: dict[str, float], weights: dict[str, float],
               total_weight: float, load_factor: float,
               eligible: Callable[[str], bool] | None = None) -> tuple[str | None, str | None]:
        """(chosen name, home name): the first name on the walk that is in `loads` (the
        candidates), eligible and under its bound; the home is the first candidate met."""
        budget = load_factor * (sum(loads.values()) + 1) / total_weight
        home = fallback = None
        for name in self.walk(key):
            load = loads.get(name)
            if load is None:
                continue
            if home is None:
                home = name
            if load < math.ceil(budget * weights[name]):
                if eligible is None or eligible(name):
                    return name, home
                if fallback is None:
                    fallback = name
        # every candidate over its bound (e.g. all saturated): least-bad deterministic choice
        return fallback or home, home
