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
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from prefixgate.backend.sequence import Sequence

ROOT_HASH = 0   # the parent hash of a sequence's first block


def hash_block(parent_hash: int, token_ids) -> int:
    """The chained hash of one full block: xxh64 over the parent hash and the block's ids."""
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None           # set while the block is in the prefix cache
    parent_hash: int = ROOT_HASH
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front: next out
        self.cached: dict[int, int] = {}       # block hash -> block id
        self.prefix_queries = 0                # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0                   # of which were served from it

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks held by sequences (0..1); freed cached blocks count as free."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest cached prefix of a sequence that has no blocks.

        At least one token is left out so the step that follows still produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq)
        bs = self.block_size
        hits: list[int] = []
        parent = ROOT_HASH
        for i in range((len(seq) - 1) // bs):
            h = seq.block_hashes[i]
            bid = self.cached.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.parent_hash != parent or block.token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break   # a hash collision: never serve KV computed for other tokens
            hits.append(bid)
            parent = h
        return hits

    def allocate(self, seq: Sequence, num_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make `seq`'s block table cover its first `num_tokens` tokens.

        `cached_blocks` (from `match_prefix`, only for a sequence without blocks) are taken
        first and mark their tokens computed. Returns False, changing nothing, when too few
        blocks are free.
        """
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
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached_blocks) * self.block_size
            seq.num_hashed_blocks = len(cached_blocks)
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens
        return True

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
        seq.num_hashed_blocks = n_full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks past the first `num_tokens` tokens (a rejected draft's):
        never computed in full, so never cached, they go to the front of the free queue."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            bid = seq.block_table.pop()
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None:
                    self.free_queue.move_to_end(bid, last=False)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (tail first, so its head stays cached longest)."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None:
                    self.free_queue.move_to_end(bid, last=False)   # nothing to keep: reuse it first
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:               # evict it from the prefix cache
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return bid

    def _extend_hashes(self, seq: Sequence) -> None:
        bs = self.block_size
        hashes = seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // bs):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))
