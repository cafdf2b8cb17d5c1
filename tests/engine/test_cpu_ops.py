"""The compiled CPU operators (backend/cpu_ops.py, cpu_ops.cpp, cpu_prefill_attention.cpp),
fp32 and bf16: each elementwise step computes what its PyTorch definition does, decode and
(fp32) prefill attention over the paged cache what the gathering references do, the few-rows
products F.linear's, the KV scatter the reference's, a model gives the same logits through
them, and without them (no compiler, or PREFIXGATE_CPU_OPS=0) the engine still serves."""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from prefixgate.backend import cpu_linear, cpu_ops
from prefixgate.backend.attention import AttentionMetadata, paged_attention
from prefixgate.backend.loader import cpu_flags, load_model
from prefixgate.kernels.decode_attention_ref import decode_attention_ref
from prefixgate.kernels.prefill_attention_ref import prefill_attention_ref
from prefixgate.kernels.write_kv_ref import write_kv_ref
from tests.engine.test_cpu_linear import assert_same_bf16_logits, logits_of
from tests.helpers import make_tiny_model

needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                    reason="no C++ compiler to build the operators with")


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load(cpu_flags())
    assert module is not None, "the operators did not build on a machine with a compiler"
    return module


def bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """`got` (bf16) is `exact` (fp32) rounded once: within half a unit of bf16's last place,
    plus the rounding of bf16 inputs the exact value was computed from."""
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_rounds_as_the_pytorch_definition_does(ops, rows):
    x, weight = bf16(rows, 576, scale=3), bf16(576, seed=1)
    with cpu_ops.plain():
        expected = cpu_ops.rms_norm(x, weight, 1e-5)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), expected)       # the same two roundings


@needs_compiler
@pytest.mark.parametrize("width", [576, 70])          # 70: not a multiple of a vector's width
def test_add_rms_norm_adds_in_place_and_normalizes_the_sum(ops, width):
    x, residual, weight = bf16(9, width), bf16(9, width, seed=1), bf16(width, seed=2)
    expected_sum = x + residual
    with cpu_ops.plain():
        expected = cpu_ops.rms_norm(expected_sum, weight, 1e-6)
    got = ops.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(residual, expected_sum) and torch.equal(got, expected)


@needs_compiler
def test_fp32_steps_compute_their_pytorch_definitions(ops):
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(7, 576, generator=g) * 3, torch.randn(7, 576, generator=g)
    weight = torch.randn(576, generator=g)
    with cpu_ops.plain():
        expected_norm = cpu_ops.rms_norm(x, weight, 1e-5)
        expected_sum = residual + x
        expected_added = cpu_ops.rms_norm(expected_sum, weight, 1e-5)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected_norm)
    torch.testing.assert_close(ops.add_rms_norm(x, residual, weight, 1e-5), expected_added)
    assert torch.equal(residual, expected_sum)
    gate_up = torch.randn(5, 3072, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(gate_up), F.silu(gate) * up)
    qkv = torch.randn(3, 8, 64, generator=g)
    angles = torch.arange(3)[:, None] * torch.rand(32, generator=g)[None]
    expected_qkv = qkv.clone()
    with cpu_ops.plain():
        cpu_ops.rope_(expected_qkv, 6, angles.cos(), angles.sin())
    ops.rope_(qkv, 6, angles.cos(), angles.sin())
    torch.testing.assert_close(qkv, expected_qkv)


def paged(lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype, block: int = 16):
    """A paged cache holding sequences of `lens` tokens in shuffled blocks (as a busy engine
    leaves them), their block tables, and one query per sequence, a view into a qkv row as the
    model passes it."""
    g = torch.Generator().manual_seed(len(lens))
    pages = max(-(-n // block) for n in lens) + 1
    blocks = len(lens) * pages + 3
    k_cache = torch.randn(blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[:len(lens) * pages].view(len(lens), pages)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    return (qkv[:, :heads], k_cache, v_cache, tables.int().contiguous(),
            torch.tensor(lens, dtype=torch.int32))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block", [
    ([1024], 9, 3, 64, 16),                 # SmolLM2's heads, one long sequence
    ([37, 1, 0, 16, 17, 300], 8, 2, 64, 16),  # ragged: a partial block, one token, nothing cached
    ([5, 70], 4, 4, 128, 16),               # no grouping, a wider head
    ([100, 3, 41], 14, 2, 64, 16),          # 7 query heads a KV head: summed 3 + 3 + 1 at a time
    ([45, 9], 6, 3, 64, 8),                 # blocks narrower than an AVX-512 vector of scores
    ([70, 33], 6, 2, 64, 32),               # blocks of several vectors of scores
    ([600, 5], 9, 3, 64, 16),               # 4 threads: 6 KV heads' tasks split in two ranges
])                                          # each, the short sequence's first range empty
@pytest.mark.parametrize("threads", [1, 4])   # 4: more threads than sequences, a task per KV head
def test_decode_attention_reads_the_paged_cache_in_place_as_the_reference_does(
        ops, dtype, lens, heads, kv_heads, head_dim, block, threads):
    q, k_cache, v_cache, tables, seq_lens = paged(lens, heads, kv_heads, head_dim, dtype, block)
    expected = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens,
                                             head_dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == dtype and got.shape == q.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    else:                   # both accumulate in fp32 and round once: one bf16 step apart at most
        torch.testing.assert_close(got.float(), expected.float(), atol=2 ** -8, rtol=2 ** -7)
    assert not got[torch.tensor(lens) == 0].any()       # nothing cached: zeros, not NaN


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [
    [(300, 1), (40, 40), (77, 1), (900, 128), (5, 1)],  # decodes around a cold and a cached chunk
    [(64, 1), (65, 1), (700, 512)],         # vLLM's order: the decodes, then the prompt's chunk
    [(129, 1), (33, 3)],                    # a decode beside one with 2 draft tokens
    [(50, 50), (80, 16)],                   # no decodes: the prefill kernel alone
])
def test_a_mixed_steps_decodes_read_the_cache_in_place_and_agree_with_the_reference(
        ops, dtype, steps):
    """`steps`: (tokens cached after the step, of which new) per sequence."""
    lens = [n for n, _ in steps]
    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    _, k_cache, v_cache, tables, seq_lens = paged(lens, heads, kv_heads, head_dim, dtype, block)
    g = torch.Generator().manual_seed(7)
    rows = sum(new for _, new in steps)
    q, k, v = (torch.randn(rows, h, head_dim, generator=g).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    slots = [tables[s, p // block].item() * block + p % block
             for s, (n, new) in enumerate(steps) for p in range(n - new, n)]
    starts = [0, *itertools.accumulate(new for _, new in steps)]

    def attend(backend):
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=tables, seq_lens=seq_lens,
            query_start_loc=torch.tensor(starts, dtype=torch.int32), max_seq_len=max(lens),
            is_decode=False, attention_backend=backend)
        caches = (k_cache.clone(), v_cache.clone())
        return paged_attention(q, k, v, caches, meta, head_dim ** -0.5), meta

    got, meta = attend(None)
    expected, _ = attend("torch")
    assert (meta.decodes_apart is None) == all(new > 1 for _, new in steps)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected.float(), atol=2 ** -8, rtol=2 ** -7)


@needs_compiler
def test_decode_attention_refuses_what_it_cannot_read(ops):
    q, k_cache, v_cache, tables, seq_lens = paged([20], 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens + 10_000, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_decode_attention(q, k_cache, v_cache, tables.long(), seq_lens, 0.125)
    with pytest.raises(RuntimeError, match="q's dtype"):
        ops.paged_decode_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), tables, seq_lens,
                                   0.125)
    odd = torch.zeros(1, 4, 20)
    assert not cpu_ops.decodes_in_place(odd, torch.zeros(2, 16, 2, 20))   # the reference takes it
    with pytest.raises(RuntimeError, match="multiple"):
        ops.paged_decode_attention(odd, torch.zeros(2, 16, 2, 20), torch.zeros(2, 16, 2, 20),
                                   tables, seq_lens, 0.125)


def prompt_rows(steps: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                block: int):
    """A shuffled paged fp32 cache for sequences of steps (cached tokens after the step, of
    which new), their tables, lengths and query starts, and the new rows' queries (a view into
    qkv rows, as the model passes them)."""
    _, k_cache, v_cache, tables, seq_lens = paged([max(n, 1) for n, _ in steps], heads,
                                                  kv_heads, head_dim, torch.float32, block)
    seq_lens = torch.tensor([n for n, _ in steps], dtype=torch.int32)
    starts = torch.tensor([0, *itertools.accumulate(new for _, new in steps)], dtype=torch.int32)
    g = torch.Generator().manual_seed(int(starts[-1]))
    qkv = torch.randn(int(starts[-1]), heads + 2 * kv_heads, head_dim, generator=g)
    return qkv[:, :heads], k_cache, v_cache, tables, seq_lens, starts


@needs_compiler
@pytest.mark.parametrize("steps,heads,kv_heads,head_dim,block", [
    ([(2048, 512)], 9, 3, 64, 16),          # SmolLM2: a chunk over a cached prefix
    ([(300, 300)], 9, 3, 64, 16),           # a cold prompt: the causal triangle alone
    ([(37, 5), (90, 1), (64, 64), (200, 17)], 8, 2, 64, 16),  # ragged, a decode among them
    ([(45, 45), (9, 2)], 6, 3, 64, 8),      # blocks narrower than a group of keys
    ([(130, 70), (33, 33)], 7, 1, 128, 32),  # 7 heads on one KV head, a wider head, wide blocks
    ([(20, 33), (0, 0), (5, 5)], 4, 4, 64, 16),  # more new rows than cached (zeros), an empty one
    ([(1000, 3), (517, 4), (64, 2)], 9, 3, 64, 16),  # a few rows over long caches (drafts)
])
@pytest.mark.parametrize("threads", [1, 3])
def test_prefill_attention_reads_the_paged_cache_in_place_as_the_reference_does(
        ops, steps, heads, kv_heads, head_dim, block, threads):
    q, k_cache, v_cache, tables, seq_lens, starts = prompt_rows(steps, heads, kv_heads,
                                                                head_dim, block)
    expected = prefill_attention_ref(q, k_cache, v_cache, tables, seq_lens, starts,
                                     head_dim ** -0.5)
    assert cpu_ops.prefills_in_place(q, k_cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts,
                                              head_dim ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    assert got.isfinite().all()


@needs_compiler
def test_prefill_attention_refuses_what_it_cannot_read(ops):
    q, k_cache, v_cache, tables, seq_lens, starts = prompt_rows([(40, 8)], 6, 2, 64, 16)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens + 10_000, starts, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables.long(), seq_lens, starts, 0.125)
    with pytest.raises(RuntimeError, match="from 0 to T"):
        ops.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts + 1, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        ops.paged_prefill_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables,
                                    seq_lens, starts, 0.125)
    assert not cpu_ops.prefills_in_place(q.bfloat16(), k_cache.bfloat16())   # SDPA's, in bf16
    odd = torch.zeros(8, 4, 20)
    assert not cpu_ops.prefills_in_place(odd, torch.zeros(2, 16, 2, 20))   # the reference's
    with pytest.raises(RuntimeError, match="multiple"):
        ops.paged_prefill_attention(odd, torch.zeros(2, 16, 2, 20), torch.zeros(2, 16, 2, 20),
                                    tables, seq_lens, starts, 0.125)
    with cpu_ops.plain("prefill_attention"):
        assert not cpu_ops.prefills_in_place(q, k_cache)
        assert cpu_ops.decodes_in_place(q, k_cache)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 56])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (70, 13), (1536, 4)])
def test_few_rows_linear_is_f_linear(ops, rows, in_features, out_features):
    # 70 and 13: a vector's and a tile's tails (13: quarters of 3 rows, one left over); 4: one
    # tile; rows: passes of 3 (AVX2) or 4 (AVX-512) x rows and their tails
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    weight = torch.randn(out_features, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    torch.testing.assert_close(ops.few_rows_linear(x, weight, bias), F.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu_ops.linear(x, weight), F.linear(x, weight), atol=1e-4, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_loops_run_on_torchs_threads_and_give_one_threads_result(ops, threads, dtype):
    # a build without OpenMP ran every loop on one thread whatever torch's count
    multiply = ops.few_rows_linear if dtype == torch.float32 else bf16_rows_kernel(ops)
    g = torch.Generator().manual_seed(threads)
    x, weight = torch.randn(8, 576, generator=g), torch.randn(960, 576, generator=g)
    x, weight = x.to(dtype), weight.to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = multiply(x, weight)
        torch.set_num_threads(threads)
        used = ops.parallel_threads(64)
        shared = multiply(x, weight)
    finally:
        torch.set_num_threads(before)
    assert used == threads
    assert torch.equal(shared, alone)           # each output computed whole by one thread


@needs_compiler
def test_few_rows_linear_refuses_what_it_cannot_multiply(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.few_rows_linear(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="at least 4 rows"):
        ops.few_rows_linear(torch.zeros(2, 8), torch.zeros(3, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.few_rows_linear(torch.zeros(8, 2).t(), torch.zeros(4, 8))
    x, narrow = torch.randn(3, 8), torch.randn(3, 8)            # F.linear takes the narrow one
    torch.testing.assert_close(cpu_ops.linear(x, narrow), F.linear(x, narrow))


def bf16_rows_kernel(ops):
    if not hasattr(ops, "few_rows_linear_bf16"):
        pytest.skip("the bf16 few-rows product is built for AVX-512 only")
    return ops.few_rows_linear_bf16


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (70, 24), (1536, 8), (33, 16)])
def test_bf16_few_rows_linear_rounds_the_exact_product_once(ops, rows, in_features, out_features):
    # 70 and 33: a step's tail (32 bf16 per step, 16 per half); 8: one tile, nothing beyond it
    multiply = bf16_rows_kernel(ops)
    x, weight = bf16(rows, in_features, seed=rows), bf16(out_features, in_features, seed=1)
    bias = bf16(out_features, seed=2)
    exact = F.linear(x.float(), weight.float(), bias.float())
    # rounded once to bf16 (plus fp32's order of summation near zero)
    torch.testing.assert_close(multiply(x, weight, bias).float(), exact, rtol=2 ** -7, atol=1e-4)
    torch.testing.assert_close(cpu_ops.linear(x, weight).float(), exact - bias.float(),
                               rtol=2 ** -7, atol=1e-4)
    assert cpu_ops.takes_few_rows(x, weight) == (rows in cpu_ops.FEW_ROWS_BF16)


@needs_compiler
def test_bf16_few_rows_linear_refuses_what_it_cannot_multiply(ops):
    multiply = bf16_rows_kernel(ops)
    with pytest.raises(RuntimeError, match="bfloat16"):
        multiply(torch.zeros(2, 8), torch.zeros(4, 8))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        multiply(bf16(2, 8), bf16(12, 8))
    with pytest.raises(RuntimeError, match="contiguous"):
        multiply(bf16(8, 2).t(), bf16(8, 8))
    with pytest.raises(RuntimeError, match="bias"):
        multiply(bf16(2, 8), bf16(8, 8), bf16(3))
    x, odd = bf16(3, 8), bf16(12, 8)                # F.linear takes 12 weight rows
    assert not cpu_ops.takes_few_rows(x, odd)
    torch.testing.assert_close(cpu_ops.linear(x, odd), F.linear(x, odd))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_kv_stores_rows_where_the_reference_does(ops, dtype, slot_dtype):
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)     # k and v: views
    k, v = qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    slots = torch.tensor([3, 17, -1, 40, 0, 63], dtype=slot_dtype)          # -1: a padded row
    caches = [torch.randn(4, 16, kv_heads, head_dim).to(dtype) for _ in range(2)]
    expected = [cache.clone() for cache in caches]
    write_kv_ref(k, v, *expected, slots)
    assert cpu_ops.writes_kv(k, caches[0])
    cpu_ops.write_kv_(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(RuntimeError, match="past the cache"):     # refused before any write
        ops.write_kv_(k, v, *caches, torch.tensor([5, 6, 7, 8, 9, 64], dtype=slot_dtype))
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    with pytest.raises(RuntimeError, match="one slot per token"):
        ops.write_kv_(k, v, *caches, slots[:3])
    with pytest.raises(RuntimeError, match="cache's dtype"):
        ops.write_kv_(k.half(), v.half(), *caches, slots)


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 20])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(ops, head_dim):
    rows, heads, kv_heads = 5, 4, 2
    qkv = bf16(rows, heads + 2 * kv_heads, head_dim)
    angles = torch.arange(rows)[:, None] * torch.rand(head_dim // 2)[None]
    cos, sin = angles.cos(), angles.sin()
    before = qkv.clone()
    ops.rope_(qkv, heads + kv_heads, cos, sin)
    x1, x2 = before[:, :heads + kv_heads].float().chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    one_rounding(qkv[:, :heads + kv_heads], exact)
    assert torch.equal(qkv[:, heads + kv_heads:], before[:, heads + kv_heads:])


@needs_compiler
@pytest.mark.parametrize("width", [3072, 40])
def test_silu_and_mul_is_swiglu(ops, width):
    x = bf16(6, width, scale=4)
    gate, up = x.float().chunk(2, dim=-1)
    one_rounding(ops.silu_and_mul(x), F.silu(gate) * up)


@needs_compiler
def test_bad_input_is_an_error_not_a_crash(ops):
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rms_norm(torch.zeros(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="x's dtype"):
        ops.rms_norm(bf16(2, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.silu_and_mul(bf16(4, 8).t())


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_model_gives_the_same_logits_through_the_compiled_operators(ops, tmp_path, arch, dtype):
    # head_dim 64: decode attention runs in place too
    model_dir = make_tiny_model(tmp_path, arch, hidden_size=256, num_attention_heads=4)
    model, config = load_model(model_dir, dtype=dtype)
    assert config.head_dim % ops.VECTOR_STEP == 0
    cpu_linear.prepare_for_inference(model)
    with cpu_ops.plain():
        expected = logits_of(model, config, dtype)
    for a, b in zip(expected, logits_of(model, config, dtype), strict=True):
        if dtype == torch.bfloat16:
            assert_same_bf16_logits(a, b)
        else:
            torch.testing.assert_close(b, a, atol=2e-5, rtol=0)


SERVE_ONE = """
import logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend import cpu_ops
engine = LLMEngine(EngineArgs(model=sys.argv[1], dtype="bfloat16", kv_cache_memory="64MiB"))
engine.add_request("r", [5, 17, 99, 3], SamplingParams(max_tokens=4, temperature=0))
tokens = []
while engine.has_work():
    tokens += [t for out in engine.step() for t in out.token_ids]
print("fused" if cpu_ops.available() else "plain", len(tokens))
"""


@pytest.mark.parametrize("env", [{"PREFIXGATE_CPU_OPS": "0"}, {"CXX": "/nonexistent/c++"}],
                         ids=["switched-off", "no-compiler"])
def test_without_the_operators_the_engine_still_serves(tmp_path, env):
    model_dir = make_tiny_model(tmp_path / "model", "llama")
    run = subprocess.run(
        [sys.executable, "-c", SERVE_ONE, str(model_dir)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PREFIXGATE_CACHE": str(tmp_path / "cache"), **env})
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "plain 4"
    if "CXX" in env:        # a failed build says so once, and why
        assert "fused CPU operators unavailable" in run.stdout


@needs_compiler
def test_plain_turns_off_the_parts_it_names_and_only_those(ops):
    x, cache = bf16(2, 576), torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    k = bf16(3, 2, 64)
    assert cpu_ops.uses_fused(x) and cpu_ops.writes_kv(k, cache)
    with cpu_ops.plain("write_kv"):
        assert cpu_ops.uses_fused(x) and not cpu_ops.writes_kv(k, cache)
        with cpu_ops.plain("elementwise"):
            assert not cpu_ops.uses_fused(x) and not cpu_ops.writes_kv(k, cache)
        assert cpu_ops.uses_fused(x)
    with cpu_ops.plain():
        assert not any(cpu_ops.uses_fused(x, part) for part in cpu_ops.PARTS)
    assert cpu_ops.writes_kv(k, cache)
    with pytest.raises(ValueError, match="unknown part"):
        with cpu_ops.plain("warp_drive"):
            pass
