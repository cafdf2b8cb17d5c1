"""Rendezvous (hash_ring.py): equal weights take a shortcut past the logarithms, and pick what
the weighted formula picks, key for key."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import xxhash

from prefixgate.plugins.prefix_route.hash_ring import CLEAR_GAP, TWO_TO_MINUS_64, Rendezvous


def weighted_pick(key: bytes, upstreams, weights):
    """The formula, taken for every candidate: the highest w / -ln(hash / 2^64)."""
    best, best_s = None, -1.0
    for u, w in zip(upstreams, weights):
        h = xxhash.xxh64_intdigest(key, xxhash.xxh64_intdigest(u.name.encode()))
        s = w / -math.log((h + 0.5) * TWO_TO_MINUS_64)
        if s > best_s:
            best, best_s = u, s
    return best


def test_equal_weights_pick_what_the_weighted_formula_picks():
    rng = random.Random(7)
    ups = [SimpleNamespace(name=f"u{i}") for i in range(64)]
    r = Rendezvous()
    for _ in range(3000):
        key = rng.getrandbits(64).to_bytes(8, "little")
        some = rng.sample(ups, rng.choice((2, 3, 8, 64)))
        w = rng.choice((1.0, 0.25, 1 / 0.0213, 1e9))
        assert r.pick(key, some, [w] * len(some)) is weighted_pick(key, some, [w] * len(some))
        weights = [rng.uniform(0.5, 2.0) for _ in some]     # unequal: the formula itself
        assert r.pick(key, some, weights) is weighted_pick(key, some, weights)


def test_hashes_too_close_to_rank_without_the_logarithms_take_them():
    r = Rendezvous()
    a, b = SimpleNamespace(name="a"), SimpleNamespace(name="b")
    key = b"k" * 8
    ha = xxhash.xxh64_intdigest(key, xxhash.xxh64_intdigest(b"a"))
    hb = xxhash.xxh64_intdigest(key, xxhash.xxh64_intdigest(b"b"))
    assert abs(ha - hb) >= CLEAR_GAP
    assert r._clear_highest(key, [a, b]) is (a if ha > hb else b)
    # two names whose hashes of the key are closer than CLEAR_GAP: no shortcut
    r._seeds["a"] = r._seeds["b"] = 1            # the same seed: the same hash
    assert r._clear_highest(key, [a, b]) is None
    assert r.pick(key, [a, b], [1.0, 1.0]) is a  # the formula's tie: the first
    assert r.pick(key, [b, a], [1.0, 1.0]) is b


def test_one_candidate_and_none():
    r = Rendezvous()
    only = SimpleNamespace(name="only")
    assert r.pick(b"key", [only], [3.0]) is only
    assert r.pick(b"key", [only]) is only
    assert r.pick(b"key", []) is None
    assert r.pick(b"key", [], []) is None
