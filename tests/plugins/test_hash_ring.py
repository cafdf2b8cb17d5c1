"""Rendezvous (hash_ring.py): a key's pick is the highest hash of (key, name) over the
candidates, the same in every replica, and only the keys of a candidate that leaves move."""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import xxhash

from prefixgate.plugins.prefix_route.hash_ring import Rendezvous


def highest_hash(key: bytes, upstreams):
    """The definition, written out: xxh64 of the key seeded with xxh64 of the name."""
    return max(upstreams, key=lambda u: xxhash.xxh64_intdigest(
        key, xxhash.xxh64_intdigest(u.name.encode())), default=None)


def test_the_pick_is_the_highest_hash_in_every_replica_and_candidates_share_the_keys():
    rng = random.Random(7)
    ups = [SimpleNamespace(name=f"u{i}") for i in range(64)]
    replicas = [Rendezvous(), Rendezvous()]
    picks = Counter()
    for _ in range(3000):
        key = rng.getrandbits(64).to_bytes(8, "little")
        some = rng.sample(ups, rng.choice((2, 3, 8, 64)))
        expected = highest_hash(key, some)
        assert replicas[0].pick(key, some) is expected
        assert replicas[1].pick(key, list(reversed(some))) is expected   # order does not matter
        if len(some) == 2:
            picks[some.index(expected)] += 1
    assert 0.4 < picks[0] / sum(picks.values()) < 0.6


def test_only_the_keys_of_a_candidate_that_leaves_move():
    rng = random.Random(3)
    ups = [SimpleNamespace(name=f"u{i}") for i in range(8)]
    r = Rendezvous()
    keys = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(2000)]
    before = {k: r.pick(k, ups) for k in keys}
    after = {k: r.pick(k, ups[1:]) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is ups[0] for k in moved)


def test_one_candidate_and_none():
    r = Rendezvous()
    only = SimpleNamespace(name="only")
    assert r.pick(b"key", [only]) is only
    assert r.pick(b"key", []) is None
