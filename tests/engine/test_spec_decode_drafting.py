"""Prompt-lookup speculative decoding, the drafting side on its own: `propose` (longest match,
then latest; loops; its incremental n-gram index), `parse_speculative_config`'s defaults and
errors, and `BlockManager.truncate` giving back a rejected draft's blocks."""
from __future__ import annotations

import random

import pytest

from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.config import parse_speculative_config
from prefixgate.backend.sequence import Sequence
from prefixgate.backend.spec_decode import NgramIndex, propose
from prefixgate.common.schema import ConfigError


def draft_of(tokens, lo, hi, k):
    return propose(tokens, NgramIndex(lo), hi, k)


def test_propose_longest_match_wins_then_latest():
    # the suffix (3, 4) occurred twice; only the first occurrence also matches the 1, 2 before it
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4]
    assert draft_of(tokens, 2, 4, 2) == [50, 9]
    # with prompt_lookup_max=2 both occurrences match 2 tokens: the latest wins the tie
    assert draft_of(tokens, 2, 2, 2) == [60, 1]
    # with max 3 the first occurrence matches 3 tokens (2, 3, 4), the later one 2 (9 before it)
    assert draft_of(tokens, 2, 3, 3) == [50, 9, 3]
    # equal-length matches: the latest occurrence
    assert draft_of([7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8], 2, 5, 1) == [3]


def test_propose_continues_a_loop_and_stops_when_nothing_matches():
    # period 3: the copy runs into the suffix and goes on from what it already proposed
    assert draft_of([5, 6, 7, 5, 6, 7, 5, 6], 2, 4, 5) == [7, 5, 6, 7, 5]
    assert draft_of([4, 4, 4], 2, 2, 4) == [4, 4, 4, 4]        # period 1
    assert draft_of([9, 1, 2, 1, 2], 2, 3, 6) == [1, 2, 1, 2, 1, 2]
    assert draft_of([1, 2, 3, 4], 2, 4, 3) == []                # the suffix never occurred
    assert draft_of([3], 1, 1, 3) == []                          # shorter than the n-gram
    assert draft_of([1, 2, 9, 3, 2], 2, 4, 3) == []              # 2 occurred, (3, 2) did not
    assert draft_of([1, 2, 9, 3, 2], 1, 4, 3) == [9, 3, 2]      # ... 1-grams allowed: it did
    assert draft_of([1, 2, 3, 1, 2], 3, 3, 2) == []              # (3, 1, 2) never occurred


def test_propose_incremental_index_agrees_with_a_fresh_one():
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(8)]
    index = NgramIndex(2)
    proposed = 0
    for _ in range(150):
        got = propose(tokens, index, 4, 5)
        assert got == draft_of(tokens, 2, 4, 5)
        assert len(got) in (0, 5)
        proposed += bool(got)
        tokens.append(got[0] if got and rng.random() < 0.7 else rng.randrange(6))
    assert proposed > 50


def test_parse_speculative_config_defaults_and_values():
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    c = parse_speculative_config({"num_speculative_tokens": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 5, 5)
    assert c.method == "ngram"
    assert c.disable_by_batch_size is None and c.min_acceptance_rate == 0.1     # no cap by default
    c = parse_speculative_config('{"num_speculative_tokens": 4, "prompt_lookup_max": 7}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    c = parse_speculative_config({"num_speculative_tokens": 4, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                  "disable_by_batch_size": 8, "min_acceptance_rate": 1})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (1, 3, 8)
    assert c.min_acceptance_rate == 1.0 and isinstance(c.min_acceptance_rate, float)
    c = parse_speculative_config({"num_speculative_tokens": 1, "min_acceptance_rate": 0})
    assert c.min_acceptance_rate == 0.0


@pytest.mark.parametrize("raw, key", [
    ({}, "num_speculative_tokens"),
    ({"prompt_lookup_max": 3}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "5"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": False}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),   # given alone
    ({"num_speculative_tokens": 2, "prompt_lookup_min": -1}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 2.5}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 0},
     "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": True}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": -0.1}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": True}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": "0.5"}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
    ("{not json", ""),
    ("[1, 2]", ""),
    ('"ngram"', ""),
    ([("num_speculative_tokens", 2)], ""),
])
def test_parse_speculative_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        parse_speculative_config(raw)
    assert err.value.key == key
    assert isinstance(err.value, ValueError)
    if key:
        assert str(err.value).startswith(f"{key}: ")


def test_block_manager_truncate_returns_the_rejected_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(9)))
    assert bm.allocate(seq, 9)                      # 3 blocks
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)                       # its 2 full blocks are in the prefix cache
    head = list(seq.block_table)
    assert bm.allocate(seq, 9 + 7)                  # a draft of 7 tokens: 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    tail = seq.block_table[3]
    bm.truncate(seq, 9 + 1)                         # one draft token accepted: 3 blocks
    assert seq.block_table == head[:3] and bm.num_free_blocks == 5
    assert bm.blocks[tail].ref_count == 0
    # the given-back block holds nothing worth keeping: it is the next one handed out
    other = Sequence([100] * 3)
    assert bm.allocate(other, 3) and other.block_table == [tail]
    bm.truncate(seq, 12)                            # covered already: nothing to give back
    assert seq.block_table == head[:3]
    bm.truncate(seq, 1)                             # down to the first block
    assert seq.block_table == head[:1] and bm.num_free_blocks == 6
    # a freed cached block stays in the prefix cache (only its reference is dropped)
    assert bm.cached[seq.block_hashes[1]] == head[1]
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
