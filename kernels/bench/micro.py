"""GPU benchmark for the paged-attention kernels: `python -m prefixgate.kernels.bench`.

Measures, with baselines timed in the same run:
  decode   paged decode attention at batch 64, contexts 1k/8k/32k (fp16 and FP8 KV): achieved
           GB/s of KV read vs the H200's ~4.8 TB/s, vs SDPA over contiguous KV and the reference
  prefill  paged prefill over a cached prefix (half the context cached, half new) at 4k and 32k:
           causal TFLOP/s vs torch SDPA (lower-right causal mask, contiguous KV)
  e2e      engine tokens/s and TTFT on a ~0.5B Qwen2-shaped random model, Triton + CUDA graphs vs
           the reference path (see e2e.py)
  spec     prompt-lookup speculative decoding vs plain decoding (the core of
           backend/bench/speculative.py): decode tok/s and TPOT p50 at batch 1 and 16, quoting
           and free workloads (gpu_speculative.py)
Prints medians, saves JSON (--json). `--cpu-smoke` runs tiny shapes through the Triton
interpreter on CPU so the script itself stays tested where no GPU is lent.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

H200_BYTES_PER_S = 4.8e12
DEVICE = "cuda"          # set by main(); "cpu" under --cpu-smoke


def median_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms: CUDA events on the GPU, perf_counter in --cpu-smoke."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def paged_kv(batch, ctx, kv_heads, head_dim, block_size, dtype, device, fp8=False):
    """Caches of `batch` sequences of `ctx` tokens on shuffled blocks, plus contiguous copies."""
    pages = -(-ctx // block_size)
    perm = torch.randperm(batch * pages, device=device)
    tables = perm.view(batch, pages).to(torch.int32)
    k = torch.randn(batch * pages, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    contiguous = [x[tables.long()].reshape(batch, pages * block_size, kv_heads, head_dim)[:, :ctx]
                  .transpose(1, 2) for x in (k, v)]                      # [B, Hkv, L, D]
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    return k, v, tables, contiguous


def sdpa(q, k, v, groups, **kw):
    """SDPA with GQA: the native flag where this torch has it, else expanded KV heads."""
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1, **kw)
    except (TypeError, RuntimeError):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                              v.repeat_interleave(groups, 1), **kw)


def bench_decode(a, device) -> list[dict]:
    rows = []
    for kv_dtype in a.kv_dtypes:
        for ctx in a.contexts:
            rows.append(decode_row(a, device, kv_dtype, ctx))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_row(a, device, kv_dtype: str, ctx: int) -> dict:
    """One decode shape, timed. Its tensors live in this frame only, so they are freed when it
    returns, before the next shape allocates its own."""
    from prefixgate.kernels import paged_decode_attention
    fp8 = kv_dtype == "fp8"
    torch.manual_seed(0)
    k, v, tables, (kc, vc) = paged_kv(a.batch, ctx, a.kv_heads, a.head_dim, a.block_size,
                                      a.dtype, device, fp8)
    q = torch.randn(a.batch, a.heads, a.head_dim, device=device, dtype=a.dtype)
    lens = torch.full((a.batch,), ctx, dtype=torch.int32, device=device)
    scale = a.head_dim ** -0.5

    def run(backend):
        return paged_decode_attention(q, k, v, tables, lens, scale, backend=backend)

    row = {"kv_dtype": kv_dtype, "batch": a.batch, "context": ctx,
           "triton_ms": median_ms(lambda: run("triton"), a.iters)}
    kv_bytes = 2 * a.batch * ctx * a.kv_heads * a.head_dim * k.element_size()
    row["gb_per_s"] = kv_bytes / (row["triton_ms"] * 1e-3) / 1e9
    row["fraction_of_h200_peak"] = row["gb_per_s"] * 1e9 / H200_BYTES_PER_S
    if not fp8:
        q4 = q[:, :, None, :]
        row["sdpa_contiguous_ms"] = median_ms(
            lambda: sdpa(q4, kc, vc, a.heads // a.kv_heads, scale=scale), a.iters)
        row["speedup_vs_sdpa"] = row["sdpa_contiguous_ms"] / row["triton_ms"]
    if ctx <= a.ref_max_context:
        row["reference_ms"] = median_ms(lambda: run("torch"), max(3, a.iters // 4), warmup=1)
        row["speedup_vs_reference"] = row["reference_ms"] / row["triton_ms"]
    return row


def causal_flops(q_len: int, ctx: int, heads: int, head_dim: int) -> float:
    """QK^T and PV over the visible (lower-right causal) keys only."""
    prefix = ctx - q_len
    visible = q_len * prefix + q_len * (q_len + 1) / 2
    return 4.0 * heads * head_dim * visible


def bench_prefill(a, device) -> list[dict]:
    rows = []
    for ctx in a.prefill_contexts:
        rows.append(prefill_row(a, device, ctx))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def prefill_row(a, device, ctx: int) -> dict:
    """One prefill shape, timed; like `decode_row`, its tensors are freed when it returns."""
    from prefixgate.kernels import paged_prefill_attention
    torch.manual_seed(0)
    batch, q_len = max(1, a.prefill_tokens // ctx), ctx // 2
    k, v, tables, (kc, vc) = paged_kv(batch, ctx, a.kv_heads, a.head_dim, a.block_size, a.dtype,
                                      device)
    q = torch.randn(batch * q_len, a.heads, a.head_dim, device=device, dtype=a.dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    scale = a.head_dim ** -0.5

    def run(backend):
        return paged_prefill_attention(q, k, v, tables, lens, qsl, scale, backend=backend)

    row = {"batch": batch, "context": ctx, "cached_prefix": ctx - q_len, "new_tokens": q_len,
           "triton_ms": median_ms(lambda: run("triton"), a.iters)}
    flops = batch * causal_flops(q_len, ctx, a.heads, a.head_dim)
    row["tflop_per_s"] = flops / (row["triton_ms"] * 1e-3) / 1e12
    q4 = q.view(batch, q_len, a.heads, a.head_dim).transpose(1, 2)
    try:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q_len, ctx)
        # the CausalBias path does not take enable_gqa: expand KV heads once, outside the timing
        g = a.heads // a.kv_heads
        ke, ve = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
        row["sdpa_ms"] = median_ms(
            lambda: F.scaled_dot_product_attention(q4, ke, ve, attn_mask=mask, scale=scale),
            a.iters)
        row["sdpa_tflop_per_s"] = flops / (row["sdpa_ms"] * 1e-3) / 1e12
        row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_ms"]
    except Exception as e:   # report, don't die: the kernel figures still stand
        row["sdpa_error"] = repr(e)[:200]
    return row


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m prefixgate.kernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="decode,prefill,e2e,spec",
                   help="comma list of: decode, prefill, e2e, spec")
    p.add_argument("--json", default=None, help="write results + config here")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes under TRITON_INTERPRET=1 on CPU")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--kv-dtypes", default="auto,fp8",
                   help="decode KV cache dtypes: auto (= --dtype), fp8")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--contexts", default="1024,8192,32768", help="decode contexts")
    p.add_argument("--ref-max-context", type=int, default=8192,
                   help="time the reference up to this context")
    p.add_argument("--prefill-contexts", default="4096,32768")
    p.add_argument("--prefill-tokens", type=int, default=32768, help="batch = this // context")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--e2e-requests", type=int, default=256)
    p.add_argument("--e2e-baseline-requests", type=int, default=256,
                   help="requests for the reference-path run (same seed, a prefix of the workload)")
    p.add_argument("--e2e-min-len", type=int, default=100)
    p.add_argument("--e2e-max-len", type=int, default=1024)
    p.add_argument("--spec-model", default="demo",
                   help="spec part: demo, qwen2 (e2e's random 0.5B shape) or a model dir")
    p.add_argument("--spec-batches", default="1,16")
    p.add_argument("--spec-rounds", type=int, default=5)
    a = p.parse_args(argv)
    if a.cpu_smoke:
        a.heads, a.kv_heads, a.head_dim, a.batch, a.iters = 4, 2, 32, 2, 2
        a.contexts, a.prefill_contexts, a.prefill_tokens, a.ref_max_context = "48", "64", 64, 64
        a.e2e_requests = a.e2e_baseline_requests = 3
        a.e2e_min_len, a.e2e_max_len = 4, 12
        a.spec_rounds = 1
        a.dtype = "float32"
    a.dtype = getattr(torch, a.dtype)
    a.kv_dtypes = a.kv_dtypes.split(",")
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.prefill_contexts = [int(x) for x in a.prefill_contexts.split(",")]
    a.only = set(a.only.split(","))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before the first Triton kernel is defined
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke for the interpreter check", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    global DEVICE
    DEVICE = device
    results = {"config": {k: str(v) for k, v in vars(a).items()},
               "device": (torch.cuda.get_device_name() if device == "cuda"
                          else platform.processor() or "cpu"),
               "torch": torch.__version__}
    with torch.inference_mode():
        if "decode" in a.only:
            results["decode"] = bench_decode(a, device)
        if "prefill" in a.only:
            results["prefill"] = bench_prefill(a, device)
    if "e2e" in a.only:
        from prefixgate.kernels.bench.e2e import bench_e2e
        results["e2e"] = bench_e2e(a, device)
    if "spec" in a.only:
        from prefixgate.kernels.bench.gpu_speculative import bench_spec
        if device == "cuda":
            torch.cuda.empty_cache()
        results["spec"] = bench_spec(a, device)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
