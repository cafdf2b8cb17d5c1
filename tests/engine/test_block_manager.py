"""Paged KV blocks and the prefix cache: hits, reference counts, LRU reuse, collisions."""
from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.sequence import Sequence
from prefixgate.common.block_hash import ROOT_HASH, hash_block

BS = 4


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence whose whole prompt was computed (as after its prefill step)."""
    seq = Sequence(tokens)
    assert bm.allocate(seq, len(seq), bm.match_prefix(seq))
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return seq


def test_allocate_and_free_track_usage():
    bm = BlockManager(8, BS)
    seq = Sequence(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.usage() == 3 / 8
    assert bm.allocate(seq, 13)          # growing by one token crosses into a 4th block
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert seq.block_table == [] and bm.usage() == 0.0


def test_allocate_fails_without_changing_anything():
    bm = BlockManager(3, BS)
    seq = Sequence(list(range(20)))
    assert not bm.allocate(seq, 20)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.prefix_queries == 0


def test_chained_hash_depends_on_the_whole_prefix():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(ROOT_HASH, [5, 6, 7, 8])


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(10)))             # blocks [0..3] [4..7] full, [8, 9] partial
    b = Sequence(list(range(8)) + [50, 51, 52])
    hits = bm.match_prefix(b)
    assert hits.block_ids == a.block_table[:2]    # full blocks only
    assert hits.num_tokens == 8
    assert bm.allocate(b, len(b), hits)
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)


def test_prefix_miss_when_an_earlier_block_differs():
    bm = BlockManager(16, BS)
    computed(bm, list(range(12)))
    other = Sequence([99] + list(range(1, 12)))   # same second block, different first block
    assert bm.match_prefix(other).block_ids == []


def test_a_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(16, BS)
    a = computed(bm, list(range(8)))
    same = Sequence(list(range(8)))
    # the step must still produce logits
    assert bm.match_prefix(same).block_ids == a.block_table[:1]


def test_hash_collision_is_not_served():
    bm = BlockManager(16, BS)
    a = computed(bm, [1, 2, 3, 4, 5])
    b = Sequence([7, 7, 7, 7, 7])
    bm.match_prefix(b)                                   # computes b's block hashes
    bm.cached[b.block_hashes[0]] = a.block_table[0]      # pretend xxh64 collided
    assert bm.match_prefix(b).block_ids == []


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = computed(bm, list(range(9)))                     # 3 blocks, 2 full and cached
    head = a.block_table[:2]
    bm.free(a)
    assert bm.usage() == 0.0
    b = Sequence(list(range(8)) + [42])
    hits = bm.match_prefix(b)
    assert hits.block_ids == head
    assert bm.allocate(b, len(b), hits) and b.num_cached_tokens == 8


def test_lru_reuse_order():
    bm = BlockManager(6, BS)
    a = computed(bm, list(range(100, 109)))              # 2 cached blocks + 1 partial
    b = computed(bm, list(range(200, 209)))
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # Partial (uncached) blocks go out first, then a's (freed earlier) tail, then a's head.
    c = Sequence(list(range(300, 312)))
    assert bm.allocate(c, 12)
    assert set(c.block_table) == {a_blocks[2], b_blocks[2], a_blocks[1]}
    assert bm.match_prefix(Sequence(list(range(100, 109)))).num_blocks == 1   # a's head survives
    assert bm.match_prefix(Sequence(list(range(200, 209)))).num_blocks == 2   # b untouched
    d = Sequence(list(range(400, 404)))
    assert bm.allocate(d, 4) and d.block_table == [a_blocks[0]]


def test_shared_block_survives_until_last_owner_frees():
    bm = BlockManager(8, BS)
    a = computed(bm, list(range(8)) + [1])
    b = Sequence(list(range(8)) + [2])
    assert bm.allocate(b, len(b), bm.match_prefix(b))
    bm.free(a)
    shared = b.block_table[0]
    assert bm.blocks[shared].ref_count == 1 and shared not in bm.free_queue
    bm.free(b)
    assert bm.blocks[shared].ref_count == 0 and bm.usage() == 0.0


def test_prefix_caching_off():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    computed(bm, list(range(9)))
    assert bm.match_prefix(Sequence(list(range(9)))).num_tokens == 0
    assert bm.cached == {}
