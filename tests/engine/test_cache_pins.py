"""cache_control pins and cache_salt in the block manager, with an explicit clock: a pinned
prefix outlives a flood that evicts the same prefix unpinned; pins give way only when nothing
else is free, the soonest-expiring first; a later mark extends a pin; expiry ends it; the cap
ends the soonest pins, a prefix's tail first; equal salts share blocks, other salts (or none)
do not; salted blocks are published as vLLM publishes them (parent None, extra_keys [salt]).
With a real engine and a second KV tier: pinned blocks dropped for room are copied to the tier
first, so the prefix comes back from it."""
from __future__ import annotations

import itertools

import msgpack
import pytest

from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventSink, encode_batch
from prefixgate.backend.kv_tier import GIB
from prefixgate.backend.model_runner import kv_block_bytes
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.sequence import Sequence
from prefixgate.common.block_hash import ROOT_HASH, block_hash_chain, salted_root
from tests.engine.helpers import prompt_of

BS = 4
TTL = 300.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(num_blocks: int = 8, **kw) -> tuple[BlockManager, Clock]:
    clock = Clock()
    return BlockManager(num_blocks, BS, clock=clock, **kw), clock


def run(bm: BlockManager, tokens: list[int], pins=(), salt=None) -> Sequence:
    """A sequence admitted with its cached prefix, computed whole and freed; returns it."""
    seq = Sequence(tokens, cache_salt=salt, cache_pins=pins)
    assert bm.allocate(seq, len(seq), bm.match_prefix(seq))
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    bm.free(seq)
    return seq


def hit_tokens(bm: BlockManager, tokens: list[int], salt=None) -> int:
    return bm.match_prefix(Sequence(tokens, cache_salt=salt)).num_tokens


_fresh = itertools.count(100)


def flood(bm: BlockManager, prompts: int, blocks: int = 4) -> None:
    """Other prompts, each `blocks` full blocks plus one token, run one after another."""
    for _ in range(prompts):
        start = next(_fresh) * 1000
        run(bm, list(range(start, start + blocks * BS + 1)))


A = list(range(1, 10))      # 2 full blocks and one token
B = list(range(11, 20))


# --- pins against LRU -------------------------------------------------------------------------

def test_a_pinned_prefix_survives_a_flood_that_evicts_the_same_prefix_unpinned():
    bm, _ = manager()
    run(bm, A, pins=[(8, TTL)])
    run(bm, B)
    assert hit_tokens(bm, A) == hit_tokens(bm, B) == 8
    flood(bm, 4)            # 4 x 5 blocks through the 6 unpinned ones
    assert hit_tokens(bm, A) == 8 and hit_tokens(bm, B) == 0
    assert bm.pin_stats()["cache_pinned_blocks"] == 2 and len(bm.pinned_free) == 2
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0      # pinned blocks count free


def test_expiry_makes_pinned_blocks_ordinary_lru_blocks_again():
    bm, clock = manager()
    run(bm, A, pins=[(8, TTL)])
    stats = bm.pin_stats()
    assert stats["cache_pin_soonest_expiry_s"] == stats["cache_pin_latest_expiry_s"] == TTL
    clock.now += TTL - 1
    flood(bm, 2)
    assert hit_tokens(bm, A) == 8                 # one second left: still pinned
    clock.now += 1
    assert bm.pin_stats()["cache_pin_soonest_expiry_s"] == 0.0
    flood(bm, 2)
    assert hit_tokens(bm, A) == 0
    assert bm.pin_stats()["cache_pinned_blocks"] == 0 and not bm.pinned_free
    assert bm.pin_stats()["cache_pin_dropped_blocks"] == 0    # it expired, nothing gave way


def test_a_later_mark_extends_the_pin_and_an_unmarked_hit_does_not():
    bm, clock = manager()
    run(bm, A, pins=[(8, TTL)])
    clock.now += 200
    run(bm, A)                                    # a hit without a mark: the pin stays as it was
    assert bm.pin_stats()["cache_pin_latest_expiry_s"] == TTL - 200
    run(bm, A, pins=[(8, TTL)])                   # marked again: 300 s from now
    assert bm.pin_stats()["cache_pin_latest_expiry_s"] == TTL
    clock.now += 250                              # 450 s after the first mark
    flood(bm, 3)
    assert hit_tokens(bm, A) == 8


def test_pins_give_way_only_when_nothing_else_is_free_soonest_expiring_first():
    bm, _ = manager()
    run(bm, A, pins=[(4, TTL)])                   # A's first block, 5 minutes
    run(bm, B, pins=[(4, 3600.0)])                # B's first block, an hour
    hog = Sequence(list(range(500, 500 + 6 * BS)))
    assert bm.allocate(hog, len(hog))             # the 6 unpinned blocks: no pin touched
    assert hit_tokens(bm, A) == hit_tokens(bm, B) == 4
    more = Sequence(list(range(600, 600 + BS)))
    assert bm.allocate(more, BS)                  # nothing unpinned left: A's (soonest) goes
    assert hit_tokens(bm, A) == 0 and hit_tokens(bm, B) == 4
    assert bm.pin_stats()["cache_pin_dropped_blocks"] == 1
    last = Sequence(list(range(700, 700 + BS)))
    assert bm.allocate(last, BS) and hit_tokens(bm, B) == 0     # a pin never refuses a block
    assert not bm.allocate(Sequence([1]), 1)


def test_a_hit_on_a_pinned_free_block_takes_it_and_its_release_pins_it_again():
    bm, _ = manager()
    run(bm, A, pins=[(8, TTL)])
    pinned = set(bm.pinned_free)
    seq = Sequence(A + [50])
    assert bm.allocate(seq, len(seq), bm.match_prefix(seq))
    assert set(seq.block_table[:2]) == pinned
    assert not bm.pinned_free and bm.num_free_blocks == 5
    bm.free(seq)
    assert set(bm.pinned_free) == pinned


def test_the_cap_ends_the_soonest_pins_a_prefixs_tail_first():
    bm, _ = manager(pin_fraction=0.25)            # 2 of 8 blocks
    a, b = block_hash_chain(A, BS), block_hash_chain(B, BS)
    run(bm, A, pins=[(8, TTL)])
    assert set(bm.pins.expiry) == set(a)
    run(bm, B, pins=[(4, 3600.0)])                # one more: A's tail block gives way
    assert set(bm.pins.expiry) == {a[0], b[0]}
    assert len(bm.pinned_free) == 2               # A's tail is an LRU block again
    long = list(range(30, 30 + 3 * BS + 1))
    run(bm, long, pins=[(12, 7200.0)])            # more than the cap: its head only
    assert set(bm.pins.expiry) == set(block_hash_chain(long, BS)[:2])


def test_a_pin_the_cap_ends_is_evicted_after_older_unmarked_blocks_and_an_expired_one_first():
    """The cap ends A's tail pin: A's promise still holds, so that block rejoins the LRU at its
    recent end and outlives C's older unmarked blocks; once A's ttl runs out, its blocks are
    the first out."""
    bm, clock = manager(num_blocks=10, pin_fraction=0.2)   # 2 of 10 blocks
    C = list(range(40, 49))
    run(bm, C)                                    # older, unmarked
    run(bm, A, pins=[(8, TTL)])
    run(bm, B, pins=[(4, 3600.0)])                # the cap ends A's tail pin
    a_tail = block_hash_chain(A, BS)[1]
    assert a_tail not in bm.pins.expiry
    flood(bm, 1, blocks=5)                        # wants 6 blocks: 4 never hashed, then 2 more
    assert hit_tokens(bm, C) == 0                 # C's two went
    assert hit_tokens(bm, A) == 2 * BS            # A's tail stayed
    clock.now += TTL + 1                          # A's head pin runs out: it goes first now
    flood(bm, 1, blocks=1)
    assert hit_tokens(bm, A) == 0


def test_pins_off_with_a_zero_fraction_and_without_prefix_caching():
    for kw in ({"pin_fraction": 0.0}, {"enable_prefix_caching": False}):
        bm, _ = manager(**kw)
        run(bm, A, pins=[(8, TTL)])
        assert bm.pin_stats()["cache_pinned_blocks"] == 0 and not bm.pinned_free
    with pytest.raises(ValueError, match="pin_fraction"):
        BlockManager(8, BS, pin_fraction=1.5)


# --- cache_salt ---------------------------------------------------------------------------------

def test_equal_salts_share_blocks_and_other_salts_or_none_do_not():
    bm, _ = manager(16)
    run(bm, A, salt="tenant-a")
    assert hit_tokens(bm, A, salt="tenant-a") == 8
    assert hit_tokens(bm, A, salt="tenant-b") == 0
    assert hit_tokens(bm, A) == 0
    run(bm, A)
    assert hit_tokens(bm, A) == 8 and hit_tokens(bm, A, salt="tenant-b") == 0


def test_the_salt_goes_into_the_first_blocks_hash_only_through_its_parent():
    bm, _ = manager(16)
    seq = run(bm, A, salt="s")
    assert seq.block_hashes == block_hash_chain(A, BS, parent=salted_root("s"))
    assert seq.block_hashes != block_hash_chain(A, BS)
    first = bm.blocks[bm.cached[seq.block_hashes[0]]]
    assert (first.parent_hash, first.salt) == (salted_root("s"), "s")
    second = bm.blocks[bm.cached[seq.block_hashes[1]]]
    assert (second.parent_hash, second.salt) == (seq.block_hashes[0], None)
    assert Sequence(A, cache_salt="").root_hash == ROOT_HASH     # empty: unsalted, as vLLM


def test_salted_blocks_are_published_as_vllm_publishes_them():
    bm, _ = manager(16)
    bm.events = KVEventSink(BS, ROOT_HASH)
    salted = run(bm, A + [0] * 4, salt="tenant-a")      # 3 full blocks
    plain = run(bm, B)
    _, events, _ = msgpack.unpackb(encode_batch(bm.events.take(), 0.0))
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored"]
    s, p = events
    assert s["block_hashes"] == salted.block_hashes and s["parent_block_hash"] is None
    assert s["extra_keys"] == [["tenant-a"], None, None]
    assert p["block_hashes"] == plain.block_hashes and p["parent_block_hash"] is None
    assert p["extra_keys"] == [None, None]


# --- a real engine with a second KV tier ----------------------------------------------------------

BLOCK = 16
DEVICE_BLOCKS = 7
P = prompt_of(50, 7)            # 3 full blocks, all pinned (the cap: 3 of 7 blocks)
FLOOD = [prompt_of(50, 100 + i) for i in range(4)]
BIG = prompt_of(100, 8)         # with its 4 new tokens it needs all 7 blocks


def tier_engine(model_dir) -> LLMEngine:
    probe = LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK,
                                 num_kv_blocks=1, device="cpu"))
    slot = kv_block_bytes(probe.model_config, BLOCK, probe.runner.kv_caches[0][0].dtype)
    return LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK,
                                num_kv_blocks=DEVICE_BLOCKS, device="cpu", step_overhead_tokens=0,
                                kv_offloading_size=12 * slot / GIB))


def generate(engine: LLMEngine, prompt: list[int], pins=(), salt=None) -> int:
    """One request run to its end; its cached prompt tokens."""
    engine.add_request(f"r{next(_fresh)}", prompt,
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       cache_salt=salt, cache_pins=pins)
    cached = None
    while engine.has_work():
        for out in engine.step():
            cached = out.cached_tokens
    return cached


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("pinned", [True, False])
def test_pinned_blocks_dropped_for_room_are_copied_to_the_tier_first(model_dir, pinned):
    engine = tier_engine(model_dir)
    tier = engine.kv_tier
    head = block_hash_chain(P, BLOCK)
    generate(engine, P, pins=[(48, TTL)] if pinned else ())
    for prompt in FLOOD:            # their copies push P's (made at its release) out of the tier
        generate(engine, prompt)
    tier._worker.submit(lambda: None).result()
    assert not set(head) & set(tier.index)
    assert (engine.block_manager.match_prefix(Sequence(P)).num_tokens == 48) == pinned
    generate(engine, BIG)           # needs every block, the pinned ones too
    tier._worker.submit(lambda: None).result()
    assert set(head) <= set(tier.index) if pinned else not set(head) & set(tier.index)
    assert engine.stats()["cache_pin_dropped_blocks"] == (3 if pinned else 0)
    assert generate(engine, P) == (48 if pinned else 0)     # back from the tier
    engine.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_salted_prompt_is_published_and_offloaded_under_its_salt(model_dir):
    engine = tier_engine(model_dir)
    sink = engine.block_manager.events = engine.kv_tier.events = KVEventSink(BLOCK, ROOT_HASH)
    generate(engine, P, salt="tenant-a")
    engine.kv_tier._worker.submit(lambda: None).result()
    salted = block_hash_chain(P, BLOCK, parent=salted_root("tenant-a"))
    stored = {e.medium: e for e in sink.take() if type(e).__name__ == "BlockStored"}
    for medium in (MEDIUM_GPU, MEDIUM_CPU):
        e = stored[medium]
        assert e.block_hashes == salted and e.parent_block_hash is None
        assert e.extra_keys == [["tenant-a"], None, None]
    assert set(salted) <= set(engine.kv_tier.index)
    for prompt in FLOOD[:2]:        # P leaves the device cache; the tier holds it
        generate(engine, prompt)
    assert engine.block_manager.match_prefix(Sequence(P, cache_salt="tenant-a")).block_ids == []
    assert generate(engine, P, salt="tenant-a") == 48          # loaded from the tier
    assert generate(engine, P, salt="tenant-b") == 0 and generate(engine, P) == 0
    engine.close()
