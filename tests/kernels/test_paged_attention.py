"""Kernels vs references vs naive contiguous attention.

Triton runs under the interpreter on CPU (this folder's conftest.py sets TRITON_INTERPRET=1
without CUDA) and natively on CUDA when present.
"""
import os

import pytest
import torch

from prefixgate.kernels import paged_decode_attention, paged_prefill_attention, write_kv
from prefixgate.kernels.decode_attention_ref import CAUSAL_MASK_ROWS, QUERY_BLOCK
from tests.kernels.helpers import make_case, naive_attention

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET,
                                                        reason="needs TRITON_INTERPRET=1")),
           pytest.param("cuda", marks=[pytest.mark.gpu,
                                       pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="no CUDA")])]
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def assert_close(out, ref, dtype, fp8=False):
    tol = 3e-2 if fp8 and dtype == torch.float32 else TOL[dtype] * (2 if fp8 else 1)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# Ragged batches: (cached tokens after the step, new tokens) per sequence. The prefill batch
# covers prefix 0 (whole prompt new), a block-aligned prefix (32 cached + 9 new), an unaligned
# one (21 + 6), a single new token mixed in (a decode inside a prefill step) and a chunk
# ending exactly on a block boundary.
DECODE_LENS = [1, 17, 40, 64]
PREFILL_LENS, PREFILL_Q = [23, 41, 27, 50, 32], [23, 9, 6, 1, 16]


def heads(gqa):
    return {"num_heads": 2 * gqa, "num_kv_heads": 2}


def run_decode(case, backend):
    return paged_decode_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                  case.seq_lens, case.scale, case.k_scale, case.v_scale,
                                  backend=backend)


def run_prefill(case, backend):
    return paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.block_tables,
                                   case.seq_lens, case.query_start_loc, case.scale, case.k_scale,
                                   case.v_scale, backend=backend)


# ---------------------------------------------------------------- references vs naive SDPA

@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_reference_matches_sdpa(gqa, block_size):
    case = make_case(DECODE_LENS, [1] * 4, block_size=block_size, **heads(gqa))
    assert_close(run_decode(case, "torch"), naive_attention(case), torch.float32)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_reference_matches_sdpa(gqa, block_size):
    case = make_case(PREFILL_LENS, PREFILL_Q, block_size=block_size, **heads(gqa))
    assert_close(run_prefill(case, "torch"), naive_attention(case), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,q_lens", [
    ([150, 300, 70], [150, 200, 65]),       # causal, and over prefixes: several query blocks
    ([700, 600], [600, 590]),               # bf16 over a prefix: blocks of 256, the last short
    ([CAUSAL_MASK_ROWS + 5], [CAUSAL_MASK_ROWS + 5]),   # a long prompt alone: SDPA's own causal
])
def test_prefill_reference_in_query_blocks_matches_sdpa(lens, q_lens, dtype):
    """Chunks of more than a block of queries (QUERY_BLOCK, or QUERY_BLOCK_BF16_PREFIXED) go
    through SDPA a block at a time, none of which may see a key past its own position."""
    assert max(q_lens) > QUERY_BLOCK
    case = make_case(lens, q_lens, dtype=dtype, **heads(4))
    assert_close(run_prefill(case, "torch"), naive_attention(case), dtype)


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_references_match_sdpa_on_dequantized_cache(per_head):
    case = make_case(PREFILL_LENS, PREFILL_Q, fp8=True, per_head_scale=per_head, **heads(4))
    assert_close(run_prefill(case, "torch"), naive_attention(case), torch.float32)
    dec = make_case(DECODE_LENS, [1] * 4, fp8=True, per_head_scale=per_head, **heads(4))
    assert_close(run_decode(dec, "torch"), naive_attention(dec), torch.float32)


def test_decode_reference_empty_sequence_gives_zeros():
    case = make_case([0, 5], [1, 1], **heads(1))
    out = run_decode(case, "torch")
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0
    case.seq_lens, case.block_tables, case.q = case.seq_lens[1:], case.block_tables[1:], case.q[1:]
    torch.testing.assert_close(out[1:], run_decode(case, "torch"))


@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_reference_round_trips(fp8):
    case = make_case([19, 7], [1, 1], fp8=fp8, per_head_scale=fp8, **heads(1))
    k_cache, v_cache = torch.zeros_like(case.k_cache), torch.zeros_like(case.v_cache)
    slots = case.slot_mapping.clone()
    slots[3] = -1  # padding row: must not be written
    write_kv(case.k_rows, case.v_rows, k_cache, v_cache, slots, case.k_scale, case.v_scale,
             backend="torch")
    hkv, d = k_cache.shape[2:]
    keep = slots >= 0
    for cache, full in ((k_cache, case.k_cache), (v_cache, case.v_cache)):
        got = cache.view(-1, hkv, d)[slots[keep]].float()
        torch.testing.assert_close(got, full.view(-1, hkv, d)[slots[keep]].float())
        assert cache.view(-1, hkv, d)[case.slot_mapping[3]].float().abs().max() == 0


def test_backend_choice_and_lazy_triton_import():
    import subprocess
    import sys
    code = ("import sys, torch, prefixgate.kernels as k\n"
            "from prefixgate.kernels.shared import pick_backend\n"
            "assert pick_backend(None, torch.zeros(1)) == 'torch' "
            "and pick_backend('auto', torch.zeros(1)) == 'torch'\n"
            "assert 'triton' not in sys.modules, 'importing prefixgate.kernels pulled in triton'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(ValueError, match="unknown attention backend"):
        paged_decode_attention(torch.zeros(1, 1, 16), None, None, None, None, 1.0, backend="cuda")


# ---------------------------------------------------------------- Triton vs references

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_triton(device, dtype, gqa, block_size):
    case = make_case(DECODE_LENS, [1] * 4, block_size=block_size, dtype=dtype, device=device,
                     **heads(gqa))
    out = run_decode(case, "triton")
    assert out.dtype == dtype
    assert_close(out, run_decode(case, "torch"), dtype)
    assert_close(out, naive_attention(case), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_decode_triton_split_k_long_and_empty_contexts(device, num_splits):
    from prefixgate.kernels.decode_attention_triton import decode_attention_triton
    # 300 tokens over 5 splits leaves later splits of the short sequences empty; seq_len 0 must
    # give zeros.
    case = make_case([300, 33, 0, 1], [1] * 4, device=device, **heads(4))
    out = decode_attention_triton(case.q, case.k_cache, case.v_cache, case.block_tables,
                                  case.seq_lens, case.scale, num_splits=num_splits)
    ref = run_decode(case, "torch")
    assert ref[2].abs().max() == 0
    assert_close(out, ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_triton(device, dtype, gqa, block_size):
    case = make_case(PREFILL_LENS, PREFILL_Q, block_size=block_size, dtype=dtype, device=device,
                     **heads(gqa))
    out = run_prefill(case, "triton")
    assert out.dtype == dtype
    assert_close(out, run_prefill(case, "torch"), dtype)
    assert_close(out, naive_attention(case), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_triton(device):
    kw = dict(dtype=torch.bfloat16, device=device, **heads(4))
    case = make_case(PREFILL_LENS, PREFILL_Q, **kw)
    assert_close(run_prefill(case, "triton"), naive_attention(case), torch.bfloat16)
    dec = make_case(DECODE_LENS, [1] * 4, **kw)
    assert_close(run_decode(dec, "triton"), naive_attention(dec), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_triton_multi_tile_with_empty_sequence(device):
    # 70 new tokens span several query tiles; a sequence with no new tokens owns no rows.
    case = make_case([90, 12, 30], [70, 0, 30], device=device, **heads(1))
    assert_close(run_prefill(case, "triton"), run_prefill(case, "torch"), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_kv_triton(device, dtype, per_head):
    kw = dict(fp8=True, per_head_scale=per_head, dtype=dtype, device=device, **heads(4))
    case = make_case(PREFILL_LENS, PREFILL_Q, **kw)
    assert_close(run_prefill(case, "triton"), run_prefill(case, "torch"), dtype, fp8=True)
    dec = make_case(DECODE_LENS, [1] * 4, **kw)
    assert_close(run_decode(dec, "triton"), run_decode(dec, "torch"), dtype, fp8=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_triton_matches_reference_bit_for_bit(device, dtype, fp8):
    case = make_case([19, 40], [1, 1], fp8=fp8, per_head_scale=fp8, device=device, **heads(1))
    # push some values past e4m3's 448 to test saturation
    k = case.k_rows.to(dtype) * (40 if fp8 else 1)
    v = case.v_rows.to(dtype)
    slots = case.slot_mapping.clone()
    slots[5] = -1
    caches = {}
    for backend in ("torch", "triton"):
        kc, vc = torch.zeros_like(case.k_cache), torch.zeros_like(case.v_cache)
        write_kv(k, v, kc, vc, slots, case.k_scale, case.v_scale, backend=backend)
        caches[backend] = (kc, vc)
    for got, want in zip(caches["triton"], caches["torch"]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if fp8:
        assert caches["torch"][0].float().abs().max() == 448   # saturated, not NaN


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rounding_matches_torch_on_every_code_point(device):
    # Every e4m3 value, every midpoint (ties to even), subnormals, -0 and out-of-range values.
    points = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    points = points[torch.isfinite(points)].sort().values
    midpoints = (points[:-1] + points[1:]) / 2
    x = torch.cat([points, midpoints, torch.tensor([500.0, -1000.0, -0.0, 1e-5])])
    x = torch.cat([x, torch.zeros(-x.numel() % 8)]).view(-1, 1, 8).to(device)
    caches = {}
    for backend in ("torch", "triton"):
        kc = torch.zeros(x.shape[0], 1, 1, 8, dtype=torch.float8_e4m3fn, device=device)
        slots = torch.arange(x.shape[0], device=device)
        write_kv(x, x, kc, torch.zeros_like(kc), slots, 1.0, 1.0, backend=backend)
        caches[backend] = kc.view(torch.uint8)
    assert torch.equal(caches["triton"], caches["torch"])


def test_gpu_benchmark_script_runs_its_cpu_smoke(tmp_path):
    """The GPU benchmark must not be dead code where no GPU is lent: its tiny interpreter run
    exercises every section (decode, prefill, engine end to end, speculative decoding) and
    writes the JSON."""
    import json
    import subprocess
    import sys
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, "-m", "prefixgate.kernels.bench", "--cpu-smoke",
                    "--json", str(out)], check=True, timeout=120, capture_output=True)
    res = json.loads(out.read_text())
    assert {r["kv_dtype"] for r in res["decode"]} == {"auto", "fp8"}
    assert all(r["gb_per_s"] > 0 and "speedup_vs_reference" in r for r in res["decode"])
    assert res["prefill"][0]["tflop_per_s"] > 0 and "speedup_vs_sdpa" in res["prefill"][0]
    e2e = res["e2e"]
    assert (e2e["kernels_cuda_graphs"]["output_tokens"]
            == e2e["reference_eager"]["output_tokens"] > 0)
    assert e2e["throughput_ratio"] > 0
    spec = res["spec"]
    assert ({(c["workload"], c["batch"]) for c in spec["cells"]}
            == {(w, b) for w in ("quoting", "free") for b in (1, 16)})
    assert all(c["ratio"] > 0 and c["spec"]["decode_tok_per_s"] > 0 for c in spec["cells"])
