"""Which prefix blocks were sent to which upstream: a memory-bounded LRU index.

One dict maps a block hash to a bit mask of the upstreams that hold it, so matching a chain
against every upstream at once costs one lookup per matched block, however many upstreams
there are. Each upstream also keeps its own LRU order of at most `capacity` blocks (set it to
the backend's KV block count): the index forgets what the backend's cache has most likely
evicted, and memory stays bounded at `capacity × upstreams` entries.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._holders: dict[int, int] = {}                 # block hash -> bit mask of upstreams
        self._lru: dict[str, OrderedDict[int, None]] = {}  # upstream -> its blocks, oldest first
        self._bit: dict[str, int] = {}
        self._names: list[str | None] = []                 # bit -> upstream (None: free)
        self._free_bits: list[int] = []

    def __len__(self) -> int:
        return len(self._holders)

    def size(self, name: str) -> int:
        lru = self._lru.get(name)
        return len(lru) if lru is not None else 0

    def match(self, chain: list[int]) -> dict[str, int]:
        """Leading blocks of `chain` each upstream holds (only upstreams with at least one).

        What an upstream holds is prefix-closed (`insert`: a block is always more recent than
        its descendants, so evicted after them), so along a chain the set of upstreams holding
        a block only shrinks: each place where it shrinks is found by bisection, a handful of
        lookups however long the prompt (8k tokens: 512 blocks)."""
        if not chain or not self._holders:
            return {}
        get = self._holders.get
        alive = get(chain[0], 0)
        if not alive:
            return {}
        ends: dict[int, int] = {}          # upstreams' bits -> the blocks they hold
        n, lo = len(chain), 1
        while True:
            i = n if get(chain[-1], 0) == alive else bisect_left(
                chain, True, lo, n, key=lambda h, alive=alive: get(h, 0) != alive)
            if i == n:
                ends[alive] = n
                break
            mask = get(chain[i], 0)
            ends[alive & ~mask] = i
            alive &= mask
            if not alive:
                break
            lo = i + 1
        out = {}
        names = self._names
        for mask, m in ends.items():       # each bit in one mask: visit the set bits only
            while mask:
                low = mask & -mask
                out[names[low.bit_length() - 1]] = m
                mask ^= low
        return out

    def insert(self, name: str, chain: list[int]) -> None:
        """Record that `name` has computed `chain` (most recently used)."""
        bit = self._bit.get(name)
        if bit is None:
            bit = self._add(name)
        flag = 1 << bit
        lru = self._lru[name]
        holders = self._holders
        # tail first, so a block is always more recent than its parent: eviction takes tails
        # before heads, and whatever an upstream holds stays a prefix (like the engine's LRU)
        for h in reversed(chain):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | flag
        while len(lru) > self.capacity:
            self._forget(lru.popitem(last=False)[0], flag)

    def remove(self, name: str) -> None:
        """Forget an upstream that left (its bit is reused by the next one to join)."""
        bit = self._bit.pop(name, None)
        if bit is None:
            return
        self._names[bit] = None
        flag = 1 << bit
        for h in self._lru.pop(name):
            self._forget(h, flag)
        self._free_bits.append(bit)

    def retain(self, names) -> None:
        for name in [n for n in self._bit if n not in names]:
            self.remove(name)

    def _add(self, name: str) -> int:
        bit = self._free_bits.pop() if self._free_bits else len(self._bit)
        self._bit[name] = bit
        if bit == len(self._names):
            self._names.append(name)
        else:
            self._names[bit] = name
        self._lru[name] = OrderedDict()
        return bit

    def _forget(self, h: int, flag: int) -> None:
        mask = self._holders[h] & ~flag
        if mask:
            self._holders[h] = mask
        else:
            del self._holders[h]
