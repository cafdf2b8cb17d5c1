"""The exact prefix index (plugins/prefix_route/kv_index.py): engine events in vLLM's two
msgpack layouts, keyed by their token ids through the gateway's own block-hash chain."""
import msgpack
import pytest

from prefixgate.common.block_hash import block_hash_chain
from prefixgate.plugins.prefix_route.kv_index import EventFormatError, KVEventIndex, decode_batch

BS = 4


def stored(hashes, parent, tokens, medium="GPU", lora_id=None, block_size=BS):
    return ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]


def batch(*events, layout="array"):
    if layout == "array":
        return msgpack.packb([1.0, list(events), 0])
    names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                             "lora_id", "medium"), "BlockRemoved": ("block_hashes", "medium")}
    maps = [{"type": e[0], **dict(zip(names.get(e[0], ()), e[1:]))} for e in events]
    return msgpack.packb({"ts": 1.0, "events": maps, "data_parallel_rank": 0})


def index_with(name, *events, layout="array"):
    idx = KVEventIndex(BS, capacity=1000)
    idx.apply(name, decode_batch(batch(*events, layout=layout)))
    return idx


TOKENS = list(range(100, 112))          # 3 blocks
CHAIN = block_hash_chain(TOKENS, BS)


@pytest.mark.parametrize("layout", ["array", "map"])
def test_stored_blocks_match_the_gateways_chain_whatever_the_engines_hashes(layout):
    # the engine's own hashes (here: sha256-like bytes) differ from the gateway's keys
    idx = index_with("a", stored([b"h1", b"h2"], None, TOKENS[:8]),
                     stored([b"h3"], b"h2", TOKENS[8:]), layout=layout)
    assert idx.match(CHAIN) == {"a": 3}
    assert idx.match(block_hash_chain([1] + TOKENS[1:], BS)) == {}   # another first block


def test_removed_blocks_cut_the_match_and_media_count_apart():
    idx = index_with("a", stored([1, 2, 3], None, TOKENS), stored([3], 2, TOKENS[8:], medium="CPU"))
    idx.apply("a", decode_batch(batch(["BlockRemoved", [3], "GPU"])))
    assert idx.match(CHAIN) == {"a": 3}                 # still in the second tier
    idx.apply("a", decode_batch(batch(["BlockRemoved", [3], "CPU"], ["BlockRemoved", [2], "GPU"])))
    assert idx.match(CHAIN) == {"a": 1} and idx.size("a") == 1


def test_each_engine_matches_its_own_length_and_clear_forgets_one():
    idx = index_with("a", stored([1, 2, 3], None, TOKENS))
    idx.apply("b", decode_batch(batch(stored([7], None, TOKENS[:4]))))
    assert idx.match(CHAIN) == {"a": 3, "b": 1}
    idx.apply("a", decode_batch(batch(["AllBlocksCleared"])))
    assert idx.match(CHAIN) == {"b": 1} and idx.size("a") == 0
    idx.remove("b")
    assert idx.match(CHAIN) == {} and "b" not in idx.engines


def test_runs_that_cannot_be_keyed_are_ignored_and_counted():
    idx = index_with("a", stored([5], 99, TOKENS[4:8]),                 # parent never seen
                     stored([6], None, TOKENS[:8], block_size=8),       # another block size
                     stored([7], None, TOKENS[:4], lora_id=3))          # a LoRA adapter's
    assert idx.match(CHAIN) == {} and idx.engines["a"].ignored == 3


def test_capacity_keeps_the_most_recent_blocks():
    idx = KVEventIndex(BS, capacity=2)
    idx.apply("a", decode_batch(batch(stored([1, 2, 3], None, TOKENS))))
    assert idx.size("a") == 2 and idx.match(CHAIN) == {"a": 2}   # the tail went first
    assert len(idx.engines["a"].key_of) == 2


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb(7), msgpack.packb([1.0, 5])])
def test_a_payload_that_is_no_batch_is_an_error(payload):
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_blocks_stored_after_a_clear_in_the_same_batch_are_kept():
    idx = index_with("a", stored([1], None, TOKENS[:4]), ["AllBlocksCleared"],
                     stored([2, 3], None, TOKENS[:8]))
    assert idx.match(CHAIN) == {"a": 2} and idx.size("a") == 2
