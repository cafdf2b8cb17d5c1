"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, SODA 2018).

Each upstream owns `virtual_nodes × weight` points on a 64-bit ring, placed by hashing its
name, so every gateway replica that knows the same names builds the same ring with no shared
state. A key goes to the first upstream clockwise from its hash whose load is under
`ceil(load_factor × (total load + 1) × its share of the weight)`; an upstream over that bound
passes the key on to the next one on the ring. No upstream ever holds more than
`load_factor` times its share, and a key only moves when its home is over the bound, down or
gone — and moves back when that ends.

`Rendezvous` is the other hashing replicas agree on without talking: a key's upstream among
any candidate set is the one with the highest hash of (key, upstream name), so when the set
changes only the keys of the upstreams that left or joined move.

`rank` orders every candidate for a key: those under their bound in ring order (the first is
the choice), then those under it but not eligible (saturated), then those over it, each in
ring order; the walk from a ring point is kept (`order`), so ranking costs one pass over
the candidates.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable

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
        self._orders: dict[int, tuple[str, ...]] = {}     # start point -> every name in order
        self._max_orders = max(64, (1 << 18) // max(1, len(self.names)))   # ~2 MB of names

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

    def order(self, key: int) -> tuple[str, ...]:
        """Every upstream name in ring order from the first point after `key` (kept per
        starting point: a prefix family starts its walk at one point)."""
        n = len(self._points)
        start = bisect_right(self._points, key) % n if n else 0
        names = self._orders.get(start)
        if names is None:
            if len(self._orders) >= self._max_orders:
                self._orders.clear()
            names = self._orders[start] = tuple(self.walk(key))
        return names

    def rank(self, key: int, loads: dict[str, float], weights: dict[str, float] | None,
             total_weight: float, load_factor: float, saturated=frozenset()
             ) -> tuple[list[str], str | None]:
        """(the candidates' names ranked, the home's name): the candidates are the names in
        `loads`, members of the ring (`weights` None: every weight is 1); the first ranked is
        the choice, the home is the first candidate met on the walk."""
        budget = load_factor * (sum(loads.values()) + 1) / total_weight
        if weights is None:
            bound = math.ceil(budget)
            over = {n for n, load in loads.items() if load >= bound}
        else:
            over = {n for n, load in loads.items() if load >= math.ceil(budget * weights[n])}
        order = self.order(key)
        if len(loads) != len(self.names):         # some members are not candidates
            order = [n for n in order if n in loads]
        if not order:
            return [], None
        if not over and not saturated:
            return list(order), order[0]
        bad = over | saturated if saturated else over
        ranked = [n for n in order if n not in bad]
        if saturated:                   # under the bound but saturated: after those that are not
            ranked += [n for n in order if n in saturated and n not in over]
        ranked += [n for n in order if n in over]
        return ranked, order[0]


class Rendezvous:
    """Highest-random-weight hashing of a key over a candidate set (module doc), unweighted:
    each candidate is picked for an equal share of the keys, whatever the set."""

    def __init__(self):
        self._seeds: dict[str, int] = {}       # upstream name -> its hash seed

    def pick(self, key: bytes, upstreams):
        """The candidate with the highest hash of (`key`, its name) (the first of equals);
        None when there is no candidate."""
        seeds = self._seeds
        best, best_h = None, -1
        for u in upstreams:
            seed = seeds.get(u.name)
            if seed is None:
                seed = seeds[u.name] = xxhash.xxh64_intdigest(u.name.encode())
            h = xxhash.xxh64_intdigest(key, seed)
            if h > best_h:
                best, best_h = u, h
        return best
