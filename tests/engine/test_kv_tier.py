"""The second KV tier (backend/kv_tier.py), end to end on real engines.

A tiny random Llama (tests/helpers.py) runs through `LLMEngine` on the CPU with a device
KV cache of 7 blocks of 16 tokens: a 100-token prompt then takes every block, so it evicts the
prefix of the 80-token prompt before it. Every test compares greedy tokens with an engine
without the tier, fed the same requests in the same order (which recomputes what the tier
loads):
- evict -> tier -> hit: the repeated prompt's prefix is loaded, not recomputed; cached tokens
  count it; fp32 and fp8 KV; chunked and whole-prompt prefill;
- a full tier drops its least recently used blocks (a sequence's tail first), and a partial
  hit still gives the same tokens;
- a tier block whose bytes changed fails its checksum: it is recomputed (the prefill chunk
  ends short of the prompt's end that step), counted corrupted, never served;
- the pool is a file mapping in --kv-offloading-path that leaves no file behind, gone at close;
- bad flags fail at start with the flag named (engine and `prefixgate backend`), as do bad
  `bundled:` keys, which otherwise become the engines' flags;
- through the real HTTP server: usage.prompt_tokens_details.cached_tokens and the
  `prefixgate:kv_offload_*` metrics.
"""
from __future__ import annotations

import gc
import itertools
import os
import threading

import aiohttp
import pytest
import torch
from prometheus_client import generate_latest

from prefixgate.backend import cli as backend_cli
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.kv_tier import FILE_PREFIX, GIB
from prefixgate.backend.metrics import EngineMetrics
from prefixgate.backend.model_runner import KV_CACHE_DTYPES, kv_block_bytes
from prefixgate.backend.sampling import SamplingParams
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.proxy.bundled import BundledEngines
from prefixgate.proxy.config import gateway as config_mod
from tests.engine.helpers import complete_ids, metrics, prompt_of
from tests.helpers import ServerThread

BLOCK = 16
DEVICE_BLOCKS = 7


A = prompt_of(80, 1)    # the prompt whose prefix is evicted: 5 full blocks, 4 matchable
B = prompt_of(100, 2)   # the evicting prompt: with its 4 new tokens it fills all 7 blocks


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def block_bytes(engine: LLMEngine, kv_dtype: str = "auto") -> int:
    dtype = KV_CACHE_DTYPES[kv_dtype] or torch.float32
    return kv_block_bytes(engine.model_config, BLOCK, dtype)


@pytest.fixture(scope="module")
def plain(model_dir):
    return make_engine(model_dir)


def make_engine(model_dir, tier_blocks: int = 0, bytes_per_block: int = 0, **kw) -> LLMEngine:
    """An fp32 engine (CPU unless told) with a 7-block KV cache, and a tier of `tier_blocks`
    blocks if given."""
    kw.setdefault("num_kv_blocks", DEVICE_BLOCKS)
    kw.setdefault("device", "cpu")
    if tier_blocks:
        kw["kv_offloading_size"] = tier_blocks * bytes_per_block / GIB
    return LLMEngine(EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK,
                                step_overhead_tokens=0, **kw))


_ids = itertools.count()


def generate(engine: LLMEngine, prompt: list[int], max_tokens: int = 4) -> tuple[list[int], int]:
    """One request run alone to the end: its tokens and its cached prompt tokens."""
    rid = f"r{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(rid, prompt, params)
    tokens, cached = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.cached_tokens
    return tokens, cached


def run_all(engine: LLMEngine, prompts) -> list[tuple[list[int], int]]:
    return [generate(engine, p) for p in prompts]


def chain(prompt: list[int]) -> list[int]:
    """The prefix cache's hashes of the prompt's full blocks (the gateway's chain: the same
    formula)."""
    return block_hash_chain(prompt, BLOCK)


def settle(engine: LLMEngine) -> None:
    """Let the tier's queued stores finish (its one worker runs them in order)."""
    engine.kv_tier._worker.submit(lambda: None).result()


# --- evict -> tier -> hit -----------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype,chunked", [("auto", True), ("fp8", True), ("auto", False)])
def test_an_evicted_prefix_comes_back_from_the_tier(model_dir, tmp_path, plain, kv_dtype, chunked):
    kw = dict(kv_cache_dtype=kv_dtype, enable_chunked_prefill=chunked)
    ref = run_all(make_engine(model_dir, **kw), [A, B, A])
    engine = make_engine(model_dir, 16, block_bytes(plain, kv_dtype),
                         kv_offloading_path=str(tmp_path), **kw)
    got = run_all(engine, [A, B, A])
    assert [t for t, _ in got] == [t for t, _ in ref]              # token-exact
    assert ref[2][1] == 0                                          # without the tier: recomputed
    assert got[2][1] == 64                                         # with it: 4 blocks loaded
    stats = engine.stats()
    assert stats["kv_offload_loaded_blocks"] == 4 and stats["kv_offload_hit_tokens"] == 64
    assert stats["prefix_hits"] == 64 and stats["kv_offload_corrupted_blocks"] == 0
    settle(engine)
    # A's 5 full blocks, then B's 6; A's rerun finds all its blocks held already
    assert engine.stats()["kv_offload_stored_blocks"] == 11
    assert engine.stats()["kv_offload_usage"] == 11 / 16
    assert engine.block_manager.num_free_blocks == DEVICE_BLOCKS
    engine.close()


def test_loaded_blocks_are_device_hits_again(model_dir, plain):
    engine = make_engine(model_dir, 16, block_bytes(plain))
    run_all(engine, [A, B, A])
    tokens, cached = generate(engine, A)            # A's blocks are on the device now
    assert cached == 64 and engine.stats()["kv_offload_loaded_blocks"] == 4   # no second load
    engine.close()


def test_a_block_is_not_reused_before_its_copy_to_the_tier_is_done(model_dir, plain):
    ref = run_all(make_engine(model_dir), [A, B, A])
    engine = make_engine(model_dir, 16, block_bytes(plain))
    busy = threading.Event()
    engine.kv_tier._worker.submit(busy.wait)     # the tier's worker is busy: A's copy waits behind
    got = [generate(engine, A)]
    threading.Timer(0.3, busy.set).start()
    # B needs A's blocks: taking them must wait for their copy, or the tier would keep B's KV
    # under A's hashes (with a checksum over those wrong bytes) and serve it to A's rerun
    got += run_all(engine, [B, A])
    assert [t for t, _ in got] == [t for t, _ in ref] and got[2][1] == 64
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_tier_is_pinned_host_memory_and_exact(model_dir, plain):
    kw = dict(device="cuda", max_num_seqs=4)
    ref = run_all(make_engine(model_dir, **kw), [A, B, A])
    engine = make_engine(model_dir, 16, block_bytes(plain), **kw)
    assert engine.kv_tier.pool.is_pinned() and engine.kv_tier.stream is not None
    got = run_all(engine, [A, B, A])
    assert [t for t, _ in got] == [t for t, _ in ref] and got[2][1] == 64
    engine.close()


# --- a full tier ----------------------------------------------------------------------------

def test_a_full_tier_drops_the_least_recently_used_blocks(model_dir, plain):
    ref = run_all(make_engine(model_dir), [A, B, A])
    # 8 slots: A's 5 blocks, then B's 6 take the 3 free slots and A's 3 oldest (its tail, freed
    # first); A's head (2 blocks) survives
    engine = make_engine(model_dir, 8, block_bytes(plain))
    got = run_all(engine, [A, B])
    settle(engine)
    a, b = chain(A), chain(B)
    assert set(engine.kv_tier.index) == set(a[:2]) | set(b[:6])
    assert engine.stats()["kv_offload_usage"] == 1.0
    got.append(generate(engine, A))
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert got[2][1] == 32 and engine.stats()["kv_offload_loaded_blocks"] == 2
    engine.close()


def test_more_freed_blocks_than_slots_keeps_the_head(model_dir, plain):
    engine = make_engine(model_dir, 4, block_bytes(plain))
    run_all(engine, [B])                # 6 full blocks freed into 4 slots
    settle(engine)
    assert list(engine.kv_tier.index) == chain(B)[3::-1]           # head-most, most recent last
    engine.close()


# --- corruption ----------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [True, False])
def test_a_corrupted_block_is_recomputed_never_served(model_dir, plain, chunked):
    ref = run_all(make_engine(model_dir, enable_chunked_prefill=chunked), [A, B, A])
    engine = make_engine(model_dir, 16, block_bytes(plain), enable_chunked_prefill=chunked)
    got = run_all(engine, [A, B])
    settle(engine)
    tier = engine.kv_tier
    slot = tier.index[chain(A)[1]].slot                 # A's second block
    tier.pool[slot].view(-1)[100:108].bitwise_not_()    # flip bytes in the mapped file
    engine.add_request("again", A, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    # block 0 loads, block 1 fails: the chunk the scheduler sized for 64 cached tokens now
    # starts at 16 and ends short of the prompt's end, so this step samples nothing
    assert engine.step() == []
    seq = engine.requests["again"].seq
    assert seq.num_cached_tokens == 16 and seq.num_computed_tokens == 32
    tokens, cached = [], None
    while engine.has_work():
        for out in engine.step():
            tokens += out.token_ids
            cached = out.cached_tokens
    assert tokens == ref[2][0] and [t for t, _ in got] == [t for t, _ in ref[:2]]
    assert cached == 16
    stats = engine.stats()
    assert stats["kv_offload_corrupted_blocks"] == 1 and stats["kv_offload_loaded_blocks"] == 1
    assert chain(A)[1] in tier.index            # stored afresh from the recomputed block
    settle(engine)
    assert tier._verified_slot(chain(A)[1], chain(A)[0], tuple(A[16:32])) is not None
    engine.close()


# --- the pool's file --------------------------------------------------------------------------

def _mapped(directory) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if f"{directory}/{FILE_PREFIX}" in line]


def test_the_pool_is_a_file_mapping_that_leaves_no_file(model_dir, tmp_path, plain):
    engine = make_engine(model_dir, 4, block_bytes(plain), kv_offloading_path=str(tmp_path))
    assert os.listdir(tmp_path) == []                   # unlinked as soon as it was mapped
    maps = _mapped(tmp_path)
    assert maps and all("(deleted)" in line for line in maps)
    engine.close()
    gc.collect()
    assert _mapped(tmp_path) == []
    tokens, _ = generate(engine, A)                     # closed: the engine goes on without it
    assert tokens == generate(plain, A)[0] and "kv_offload_usage" not in engine.stats()


# --- bad flags and keys -------------------------------------------------------------------------

def _unwritable_dir(tmp_path) -> str:
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    if not os.access(d, os.W_OK):
        return str(d)
    return "/sys"       # root writes anywhere chmod forbids; sysfs refuses new files even to root


@pytest.mark.parametrize("flags,message", [
    ({"kv_offloading_size": 1, "kv_offloading_path": "/no/such/dir"},
     "--kv-offloading-path: /no/such/dir: no such directory"),
    ({"kv_offloading_size": -1}, "--kv-offloading-size: must be > 0"),
    ({"kv_offloading_size": float("nan")}, "--kv-offloading-size: must be > 0"),
    ({"kv_offloading_size": 1e-9},
     "--kv-offloading-size: 1e-09 GiB is less than one KV block (8192 bytes)"),
    ({"kv_offloading_path": "/tmp"}, "--kv-offloading-path: needs --kv-offloading-size"),
    ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "drop --no-prefix-caching"),
])
def test_bad_offloading_args_fail_the_engine_at_start(model_dir, flags, message):
    with pytest.raises(ValueError) as e:
        make_engine(model_dir, **flags)
    assert message in str(e.value)


def test_an_unwritable_path_fails_the_engine_at_start(model_dir, tmp_path):
    path = _unwritable_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        make_engine(model_dir, kv_offloading_size=0.001, kv_offloading_path=path)
    assert str(e.value).startswith(f"--kv-offloading-path: {path}: not writable")


@pytest.mark.parametrize("flags,message", [
    (["--kv-offloading-size", "1", "--kv-offloading-path", "/no/such/dir"],
     "prefixgate backend: --kv-offloading-path: /no/such/dir: no such directory"),
    (["--kv-offloading-size", "1e-9"],
     "prefixgate backend: --kv-offloading-size: 1e-09 GiB is less than one KV block"),
    (["--kv-offloading-size", "-2"], "prefixgate backend: --kv-offloading-size: must be > 0"),
])
def test_bad_offloading_flags_exit_the_backend_with_the_message(model_dir, flags, message, capsys):
    assert backend_cli.main(["--model", model_dir, "--dtype", "float32", "--port", "0",
                                "--num-kv-blocks", "8", *flags]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(message), err


def test_the_flags_reach_the_engine_args(tmp_path):
    ns = backend_cli.build_parser().parse_args(["--kv-offloading-size", "2.5",
                                                   "--kv-offloading-path", str(tmp_path)])
    args = backend_cli.engine_args(ns)
    assert (args.kv_offloading_size, args.kv_offloading_path) == (2.5, str(tmp_path))
    ns = backend_cli.build_parser().parse_args(["--kv-offloading-size", "0"])
    off = backend_cli.engine_args(ns)
    assert off.kv_offloading_size is None


@pytest.mark.parametrize("bundled,message", [
    ({"kv_offloading_size": -1}, "bundled.kv_offloading_size: must be > 0"),
    ({"kv_offloading_size": "1GiB"}, "bundled.kv_offloading_size: must be a number"),
    ({"kv_offloading_size": True}, "bundled.kv_offloading_size: must be a number"),
    ({"kv_offloading_size": 1, "kv_offloading_path": "/no/such/dir"},
     "bundled.kv_offloading_path: /no/such/dir: no such directory"),
    ({"kv_offloading_path": "/tmp"},
     "bundled.kv_offloading_path: needs bundled.kv_offloading_size"),
])
def test_bad_bundled_offloading_keys_name_the_key(bundled, message):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.validate({"bundled": bundled})
    assert str(e.value).startswith(message)


def test_an_unwritable_bundled_path_names_the_key(tmp_path):
    path = _unwritable_dir(tmp_path)
    if path == "/sys":
        pytest.skip("as root only creating a file shows it: the engine does (tested above)")
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.validate({"bundled": {"kv_offloading_size": 1, "kv_offloading_path": path}})
    assert str(e.value) == f"bundled.kv_offloading_path: {path}: not writable"


def test_bundled_offloading_keys_become_the_engines_flags(tmp_path):
    cfg = config_mod.validate({"bundled": {"args": ["--max-num-seqs", 8], "kv_offloading_size": 1.5,
                                           "kv_offloading_path": str(tmp_path)}})
    args = BundledEngines(cfg["bundled"]).engine_args()
    assert args == ["--max-num-seqs", "8", "--kv-offloading-size", "1.5",
                    "--kv-offloading-path", str(tmp_path)]
    ea = backend_cli.engine_args(backend_cli.build_parser().parse_args(args))
    assert (ea.kv_offloading_size, ea.kv_offloading_path) == (1.5, str(tmp_path))
    own = config_mod.validate({"bundled": {"args": ["--kv-offloading-size", "3"],
                                           "kv_offloading_size": 1}})
    assert BundledEngines(own["bundled"]).engine_args() == ["--kv-offloading-size", "3"]
    for off in ({}, {"kv_offloading_size": 0}):
        assert BundledEngines(config_mod.validate({"bundled": off})["bundled"]).engine_args() == []


# --- through the server ------------------------------------------------------------------------

async def test_the_server_counts_tier_hits_and_exposes_the_metrics(model_dir, tmp_path, plain):
    ref = run_all(make_engine(model_dir), [A, B, A])
    size = 16 * block_bytes(plain) / GIB
    with ServerThread(["--model", model_dir, "--dtype", "float32", "--block-size", str(BLOCK),
                       "--num-kv-blocks", str(DEVICE_BLOCKS), "--step-overhead-tokens", "0",
                       "--kv-offloading-size", repr(size),
                       "--kv-offloading-path", str(tmp_path)]) as st:
        core = st.server.engine.engine
        async with aiohttp.ClientSession() as s:
            got = [await complete_ids(s, st.url, p, 4) for p in (A, B)]
            got.append(await complete_ids(s, st.url, A, 4, stream=True))
            m = await metrics(s, st.url)
        assert [g["token_ids"] for g in got] == [t for t, _ in ref]
        assert [g["usage"]["prompt_tokens_details"]["cached_tokens"] for g in got] == [0, 0, 64]
        assert m["prefixgate:kv_offload_loaded_blocks_total"] == 4
        assert m["prefixgate:kv_offload_hit_tokens_total"] == 64
        assert m["prefixgate:kv_offload_stored_blocks_total"] == 11
        assert m["prefixgate:kv_offload_corrupted_blocks_total"] == 0
        assert m["prefixgate:kv_offload_usage_perc"] == 11 / 16
        assert m["prefixgate:prefix_cache_hits_total"] == 64
        assert _mapped(tmp_path)
    assert core.kv_tier is None and _mapped(tmp_path) == []        # closed with the server
    # an engine without the tier exposes none of them
    assert b"kv_offload" not in generate_latest(EngineMetrics(plain).registry)
    assert not any(k.startswith("kv_offload") for k in plain.stats())
