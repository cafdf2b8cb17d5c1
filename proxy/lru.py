"""A bounded mapping that forgets its least recently used key: one LRU for every cache here.

Built on `collections.OrderedDict`, whose `move_to_end` and `popitem(last=False)` are O(1) in
C, so a hit costs one dict lookup plus one relink, and an eviction no more. It is still an
OrderedDict: `in`, `len`, `values()` and iteration (oldest first) never touch recency.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
_MISSING = object()


class LRU(OrderedDict, Generic[K, V]):
    peek = OrderedDict.get      # `peek(key, default=None)`: the value, recency untouched

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def get(self, key: K, default=None):
        """The value, or `default`; a hit becomes the most recent."""
        value = self.peek(key, _MISSING)
        if value is _MISSING:
            return default
        self.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Insert or update as the most recent; the least recent beyond `capacity` goes."""
        OrderedDict.__setitem__(self, key, value)
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)

    __setitem__ = put

    def pop(self, key: K, default=None):
        return OrderedDict.pop(self, key, default)
