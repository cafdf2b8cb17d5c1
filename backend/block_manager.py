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
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
                 tier: KVTier | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
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

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1); freed cached blocks count as free."""
        return 1.0 - len(self.free_queue) / self.num_blocks

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
        cached_blocks = match.block_ids if match is not None else []
        new = self.blocks_needed(num_tokens) - len(seq.block_table) - len(cached_blocks)
        revived = sum(1 for bid in cached_blocks if self.blocks[bid].ref_count == 0)
        if max(new, 0) + revived > len(self.free_queue):
            return False
        admitted = not seq.block_table
        for bid in cached_blocks:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
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
            block.parent_hash = seq.block_hashes[i - 1] if i else ROOT_HASH
            block.token_ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            self.cached[h] = block.block_id
            self._record_cached(block)
        seq.num_hashed_blocks = n_full

    def _record_cached(self, block: Block) -> None:
        """KV event: `block` entered the prefix cache."""
        if self.events is not None:
            self.events.stored(block.hash, block.parent_hash, block.token_ids, MEDIUM_GPU)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks past the first `num_tokens` tokens (a rejected draft's):
        never computed in full, so never cached, they go to the front of the free queue."""
        keep = self.blocks_needed(num_tokens)
        freed: list[Block] = []
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop(), freed)
        self._offload(freed)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (tail first, so its head stays cached longest)."""
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
        bid, _ = self.free_queue.popitem(last=False)
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
        block.ref_count = 1
        return bid

    def _block_key(self, seq: Sequence, i: int) -> tuple[int, int, tuple[int, ...]]:
        """The i-th full block of `seq`: its hash, its parent's hash and its token ids."""
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else ROOT_HASH
        return seq.block_hashes[i], parent, tuple(seq.token_ids[i * bs:(i + 1) * bs])

    def _extend_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
