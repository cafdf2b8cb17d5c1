"""Paged KV blocks and the prefix cache.

The KV cache is a pool of fixed-size blocks; a sequence's block table lists the blocks that
hold its tokens in order. A block that is full and computed gets a hash chained over the
whole prefix, `xxh64(parent hash, its token ids)`, and is entered in the prefix cache, so a
later prompt starting with the same tokens reuses the block instead of recomputing it. Only
full blocks are cached. A hit also compares the stored token ids and parent hash, so a hash
collision cannot serve another prompt's KV.

Free blocks wait in one LRU queue. A freed block keeps its hash (and its KV) until the queue
hands it out again, so it can still be hit; blocks are handed out least-recently-used first,
blocks without a hash before any cached one, and a sequence's tail blocks before its head
blocks (the head is the part other prompts are likely to share).

With a second KV tier (backend/kv_tier.py), a hashed block whose last reference goes is also
offered to the tier, and a block the tier is still copying is not reused before the copy ends. A
prefix lookup (`match_prefix`) continues the chain in the tier after the device cache's hits;
`allocate` loads those blocks into fresh blocks and counts them computed and cached, as device
hits. A load stops at the first block that fails its checksum: from there the prompt is computed.

KV events (backend/kv_events.py): with a sink in `events`, a block entering the prefix cache
(computed, or loaded from the tier) is recorded as stored on the "GPU" medium, and a cached
block handed out for new KV as removed; the engine publishes them after the step.

cache_salt (vLLM's): a sequence's first block chains from `salted_root(salt)` instead of
ROOT_HASH, so every hash of a salted prompt differs from the same tokens' under another salt
(or none): the device cache and the second tier, both keyed and checked by (hash, parent hash,
tokens), serve a block only to a request with the same salt.

cache_control pins (backend/cache_pins.py): once the blocks up to a sequence's breakpoint are
cached, their hashes are pinned until now + ttl. A pinned block whose last reference goes waits
in `pinned_free`, not in the LRU queue: it is handed out only when the queue is empty, the
soonest-expiring first, and with a second tier it is copied there first. Expired pins are
checked whenever blocks are taken or given back; such a block rejoins the queue at its front
(the client's promise to reuse it ran out, so it is the least likely block to be hit). A pin
the cap ends rejoins it at the recent end: that promise still holds.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixgate.backend.cache_pins import CachePins
from prefixgate.backend.config import DEFAULT_CACHE_PIN_FRACTION
from prefixgate.backend.kv_events import MEDIUM_GPU
from prefixgate.backend.sequence import Sequence
from prefixgate.common.block_hash import ROOT_HASH, hash_block

if TYPE_CHECKING:
    from prefixgate.backend.kv_events import KVEventSink
    from prefixgate.backend.kv_tier import KVTier

@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None           # set while the block is in the prefix cache
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()
    salt: str | None = None           # a salted sequence's first block: its cache_salt


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a sequence: blocks of the device cache, then the number of
    blocks after them that the second KV tier holds."""
    block_ids: list[int]
    num_tier_blocks: int
    block_size: int

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids) + self.num_tier_blocks

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tier: KVTier | None = None, pin_fraction: float = DEFAULT_CACHE_PIN_FRACTION,
                 clock=time.monotonic):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if not 0 <= pin_fraction <= 1:
            raise ValueError(f"pin_fraction must be in [0, 1], got {pin_fraction}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # front: the next block out
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}       # block hash -> block id
        self.prefix_queries = 0                # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                   # of which were served from it (or the tier)
        self.tier = tier                       # the second KV tier, if any
        self.events: KVEventSink | None = None   # where KV events go, when they are published
        self.pins = CachePins(int(num_blocks * pin_fraction))
        self.pinned_free: dict[int, None] = {}     # free blocks whose hash is pinned
        self.clock = clock                         # the pins' time (seconds)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: pinned free blocks too (pins give way under need)."""
        return len(self.free_queue) + len(self.pinned_free)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1); freed cached blocks count as free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """The longest cached prefix of a sequence that has no blocks: device cache hits, then
        the blocks the second tier holds after them.

        At least one token is left out so the step that follows still produces logits.
        """
        bs = self.block_size
        if not self.enable_prefix_caching:
            return PrefixMatch([], 0, bs)
        self._extend_hashes(seq)
        usable = (len(seq) - 1) // bs
        hits: list[int] = []
        for i in range(usable):
            block_hash, parent, token_ids = self._block_key(seq, i)
            bid = self.cached.get(block_hash)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.parent_hash != parent or block.token_ids != token_ids:
                # a hash collision: never serve KV computed for other tokens
                return PrefixMatch(hits, 0, bs)
            hits.append(bid)
        in_tier = 0
        if self.tier is not None:
            while (len(hits) + in_tier < usable
                   and self.tier.holds(*self._block_key(seq, len(hits) + in_tier))):
                in_tier += 1
        return PrefixMatch(hits, in_tier, bs)

    def allocate(self, seq: Sequence, num_tokens: int, match: PrefixMatch | None = None) -> bool:
        """Make `seq`'s block table cover its first `num_tokens` tokens.

        A `match` (from `match_prefix`, only for a sequence without blocks; `num_tokens` covers
        it) has its device blocks taken first and its tier blocks loaded into fresh ones; the
        tokens they hold count computed. Returns False, changing nothing, when too few blocks are
        free.
        """
        self._expire_pins()
        cached_blocks = match.block_ids if match is not None else []
        new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_blocks)
        revived = sum(1 for bid in cached_blocks if self.blocks[bid].ref_count == 0)
        if max(new, 0) + revived > self.num_free_blocks:
            return False
        admitted = not seq.block_table
        for bid in cached_blocks:
            block = self.blocks[bid]
            if block.ref_count == 0:
                self._unfree(bid)
            block.ref_count += 1
            seq.block_table.append(bid)
        for _ in range(new):
            seq.block_table.append(self._pop_free())
        if admitted:
            n = len(cached_blocks)
            if match is not None:
                n += self._load_from_tier(seq, n, match.num_tier_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = n * self.block_size
            seq.num_hashed_blocks = n
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens
            self._pin_cached(seq)
        return True

    def _load_from_tier(self, seq: Sequence, first: int, count: int) -> int:
        """Load `count` tier blocks into `seq`'s fresh blocks from index `first` and enter them in
        the prefix cache; how many loaded (a load stops at a block that fails its checksum)."""
        count = min(count, len(seq.block_table) - first)
        if count <= 0 or self.tier is None:
            return 0
        keys = [self._block_key(seq, first + j) for j in range(count)]
        loaded = self.tier.load(keys, seq.block_table[first:first + count])
        for (block_hash, parent, token_ids), bid in zip(keys[:loaded], seq.block_table[first:]):
            if block_hash not in self.cached:
                block = self.blocks[bid]
                block.hash, block.parent_hash, block.token_ids = block_hash, parent, token_ids
                block.salt = seq.cache_salt if parent == seq.root_hash else None
                self.cached[block_hash] = bid
                self._record_cached(block)
        return loaded

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Enter the sequence's newly computed full blocks into the prefix cache."""
        n_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or n_full <= seq.num_hashed_blocks:
            return
        self._extend_hashes(seq)
        bs = self.block_size
        for i in range(seq.num_hashed_blocks, n_full):
            h = seq.block_hashes[i]
            block = self.blocks[seq.block_table[i]]
            if h in self.cached or block.hash is not None:
                continue    # the same prefix is already cached in another block
            block.hash = h
            block.parent_hash = seq.block_hashes[i - 1] if i else seq.root_hash
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            block.salt = seq.cache_salt if i == 0 else None
            self.cached[h] = block.block_id
            self._record_cached(block)
        seq.num_hashed_blocks = n_full
        self._pin_cached(seq)

    def _record_cached(self, block: Block) -> None:
        """KV event: `block` entered the prefix cache."""
        if self.events is not None:
            self.events.stored(block.hash, block.parent_hash, block.token_ids, MEDIUM_GPU,
                               block.salt)

    # --- cache_control pins (backend/cache_pins.py) ----------------------------------------

    def _pin_cached(self, seq: Sequence) -> None:
        """Pin the prefix of each of `seq`'s breakpoints whose blocks are all cached by now."""
        if not self.enable_prefix_caching:
            return
        while seq.num_pins_applied < len(seq.cache_pins):
            num_tokens, ttl = seq.cache_pins[seq.num_pins_applied]
            n = num_tokens // self.block_size
            if n > seq.num_hashed_blocks:
                return
            seq.num_pins_applied += 1
            # up to the first block not cached (a twin's eviction): a later one serves no hit
            hashes = list(itertools.takewhile(self.cached.__contains__, seq.block_hashes[:n]))
            new, ended = self.pins.pin(hashes, self.clock() + ttl)
            for h in new:       # a twin's copy of the prefix may be free already
                bid = self.cached[h]
                if bid in self.free_queue:
                    del self.free_queue[bid]
                    self.pinned_free[bid] = None
            for h in ended:
                self._unpinned(h, expired=False)

    def _expire_pins(self) -> None:
        for h in self.pins.expired(self.clock()):
            self._unpinned(h, expired=True)

    def _unpinned(self, block_hash: int, expired: bool) -> None:
        """A pin ended: its block, if free, joins the LRU queue — at the front when its ttl ran
        out (module doc), at the recent end when the cap ended it: the client's promise still
        holds, so it must not go before blocks nobody promised to reuse."""
        bid = self.cached.get(block_hash)
        if bid is not None and bid in self.pinned_free:
            del self.pinned_free[bid]
            self.free_queue[bid] = None
            if expired:
                self.free_queue.move_to_end(bid, last=False)

    def _unfree(self, bid: int) -> None:
        """Take a free block (a cache hit revives it) out of whichever free list holds it."""
        if bid in self.pinned_free:
            del self.pinned_free[bid]
        else:
            del self.free_queue[bid]

    def pin_stats(self) -> dict:
        """Pinned blocks and their expiries in seconds from now (for /metrics; read-only)."""
        span = self.pins.span()
        now = self.clock()
        return {"cache_pinned_blocks": len(self.pins),
                "cache_pin_soonest_expiry_s": max(0.0, span[0] - now) if span else 0.0,
                "cache_pin_latest_expiry_s": max(0.0, span[1] - now) if span else 0.0,
                "cache_pin_dropped_blocks": self.pins.dropped}

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks past the first `num_tokens` tokens (a rejected draft's):
        never computed in full, so never cached, they go to the front of the free queue."""
        keep = self.blocks_needed(num_tokens)
        self._expire_pins()
        freed: list[Block] = []
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop(), freed)
        self._offload(freed)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (tail first, so its head stays cached longest)."""
        self._expire_pins()
        freed: list[Block] = []
        for bid in reversed(seq.block_table):
            self._release(bid, freed)
        self._offload(freed)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _release(self, bid: int, freed: list[Block]) -> None:
        """Drop one reference; a block that becomes free and holds a cached prefix joins `freed`."""
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash in self.pins and self.cached.get(block.hash) == bid:
                self.pinned_free[bid] = None
            else:
                self.free_queue[bid] = None
            if block.hash is None:
                self.free_queue.move_to_end(bid, last=False)   # nothing to keep: reuse it first
            else:
                freed.append(block)

    def _offload(self, freed: list[Block]) -> None:
        """Offer freed cached blocks to the second tier (it copies them in the background)."""
        if self.tier is not None and freed:
            self.tier.store(freed)

    def _pop_free(self) -> int:
        if self.free_queue:
            bid, _ = self.free_queue.popitem(last=False)
        else:
            bid = self._pop_pinned()
        if self.tier is not None:
            # its copy into the tier must end before new KV lands
            self.tier.wait_store(bid)
        block = self.blocks[bid]
        if block.hash is not None:               # evict it from the prefix cache
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.removed(block.hash, MEDIUM_GPU)
            block.hash = None
            block.token_ids = ()
            block.salt = None
        block.ref_count = 1
        return bid

    def _pop_pinned(self) -> int:
        """Nothing unpinned is free: the pinned block expiring soonest gives way, offered to the
        second tier first (it copies it, or makes its copy the most recently used)."""
        expiry = self.pins.expiry
        bid = min(self.pinned_free, key=lambda b: expiry.get(self.blocks[b].hash, 0.0))
        del self.pinned_free[bid]
        block = self.blocks[bid]
        self.pins.unpin(block.hash)
        self.pins.dropped += 1
        if self.tier is not None:
            self.tier.store([block])
        return bid

    def _block_key(self, seq: Sequence, i: int) -> tuple[int, int, tuple[int, ...]]:
        """The i-th full block of `seq`: its hash, its parent's hash and its token ids."""
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else seq.root_hash
        return seq.block_hashes[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])

    def _extend_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[-1] if hashes else seq.root_hash
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
