"""This machine's limits, and the floors they put under the engine:
`python -m prefixgate.backend.bench.limits` (run it under `taskset -c CORE` to measure one core).

Measured, with torch at `--threads` threads (1 by default) on the cores this process may use,
timed in this thread's CPU seconds at one thread (a busy machine's other processes taking turns
on the core do not count against it; `clock()`), in wall seconds at more:
  GEMM peak   per dtype (float32, bfloat16), GFLOP/s of the two calls a CPU engine makes for a
              linear layer: torch.nn.functional.linear, and oneDNN's linear on a weight
              prepacked once (torch.ops.mkldnn._reorder_linear_weight, then _linear_pointwise);
              shapes like the model's: M a prefill chunk (128, 512 tokens), K x N from SmolLM2's
              576/1536/192 and a larger 2048 x 2048. Per shape and call the median of repeats,
              each long enough to be timed (~40 ms); the peak is the best median (the best
              sustained rate, not the luckiest sample). Nothing is assumed from the CPU's flags:
              a CPU without bf16 dot products shows it as a slow bf16 peak.
  bandwidth   GB/s read from memory: a buffer far bigger than the last-level cache (4 x L3, at
              least 1 GiB) summed, multiplied by a vector (a GEMV: decode's access pattern; MKL's,
              and cpu_ops' few-rows kernel, which reads 4 long streams at once: on a Zen 3 core
              27-30 GB/s where one sequential stream gave 18-22) and copied half onto half (read
              + write counted); the median of repeats, the best kernel's.
Then, for `--model` (its shape read as the engine's loader reads it, weights not loaded; FLOPs
from bench/flops.py's PrefillFlops, attention included), the floors, in each dtype:
  prefill of N tokens   FLOPs(N) / GEMM peak
  decode step, batch B  the larger of bytes / bandwidth, bytes = every weight read once (the
                        tied lm_head included) + each sequence's K and V at context C
                        (`--context`), and B x FLOPs(1 token after C) / GEMM peak
A measured time's fraction of its floor is floor / measured: 1.0 is the machine's limit, 0.5
twice as slow as it. Other benchmarks measure the limits in the same run (`measure_limits`)
and report against them (`Floors.prefill_fraction`, `Floors.decode_fraction`).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from prefixgate.backend import cpu_ops
from prefixgate.backend.bench.flops import PrefillFlops
from prefixgate.backend.bench.script import int_list, run_report_save
from prefixgate.backend.loader import cpu_flags

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
         "amx_bf16", "amx_int8")
GEMM_M = (128, 512)                       # prefill chunks (512: both engines' step budget)
GEMM_KN = ((576, 1536), (1536, 576), (576, 576), (576, 192), (2048, 2048))
GIB = 2 ** 30


@dataclass(frozen=True)
class Effort:
    """How hard the probe looks: the default (~15 s of measuring) or `--quick` (~1 s)."""

    gemm_m: tuple[int, ...] = GEMM_M
    gemm_kn: tuple[tuple[int, int], ...] = GEMM_KN
    sample_s: float = 0.04          # one timed sample: enough calls to last this long
    repeats: int = 5
    buffer_bytes: int | None = None  # None: 4 x L3, at least 1 GiB, at most 1/4 of free memory

    @classmethod
    def quick(cls) -> Effort:
        return cls(gemm_m=(256,), gemm_kn=((576, 1536),), sample_s=0.01, repeats=3,
                   buffer_bytes=256 * 2 ** 20)


@dataclass
class Limits:
    """What was measured (module doc): each dtype's GEMM peak, the memory read bandwidth, every
    sample behind them, and where (CPU, torch, threads, cores)."""

    gemm_gflops: dict[str, float]           # dtype -> the best shape's median
    bandwidth_gbs: float                    # the best kernel's median
    gemm: list[dict] = field(default_factory=list)          # per dtype, call and shape
    bandwidth: dict = field(default_factory=dict)           # per kernel, and the buffer
    threads: int = 1
    clock: str = "thread_cpu"               # what the samples were timed with (`clock()`)
    cores: list[int] = field(default_factory=list)
    torch: str = torch.__version__
    cpu: dict = field(default_factory=dict)                 # cpu_info()
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Limits:
        return cls(**d)


# --- the machine ---------------------------------------------------------------------------

def _size_bytes(text: str) -> int | None:
    """`480 MiB (1 instance)` or `32768K` -> bytes."""
    m = re.match(r"\s*([\d.]+)\s*([KMG]?)i?B?", text)
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": GIB}[m.group(2)])


def cpu_info() -> dict:
    """The CPU as `lscpu` names it: model, the flags that decide GEMM speed (present or not),
    the last-level cache, and lscpu's whole output (/proc/cpuinfo's model and flags where
    there is no lscpu)."""
    raw = ""
    if shutil.which("lscpu"):
        raw = subprocess.run(["lscpu"], capture_output=True, text=True,
                             env={**os.environ, "LC_ALL": "C"}).stdout
    fields = {k.strip(): v.strip() for k, _, v in
              (line.partition(":") for line in raw.splitlines()) if v}
    if "Flags" not in fields:                         # no lscpu: the first CPU's entry
        names = {"model name": "Model name", "flags": "Flags"}
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in names:
                    fields.setdefault(names[key.strip()], value.strip())
    flags = set(fields.get("Flags", "").split())
    l3 = fields.get("L3 cache")
    if l3 is None:
        with_l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
        l3 = with_l3.read_text().strip() if with_l3.is_file() else None
    return {"model_name": fields.get("Model name"), "flags": {f: f in flags for f in FLAGS},
            "l3": l3, "l3_bytes": _size_bytes(l3) if l3 else None,
            "cpus": os.cpu_count(), "lscpu": raw}


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 4 * GIB


# --- measuring -----------------------------------------------------------------------------

def clock() -> tuple[str, object]:
    """What the probe times with: at one torch thread (which computes on the calling thread)
    this thread's CPU time, so that the slices a busy machine's scheduler gives to other
    processes on the core do not count against the core; at more threads, wall time."""
    if torch.get_num_threads() == 1:
        return "thread_cpu", time.thread_time
    return "wall", time.perf_counter


def _median_call_s(fn, effort: Effort) -> float:
    """The median over `effort.repeats` samples of one call's seconds (`clock()`), each sample
    as many calls as last `effort.sample_s` (after one warm-up call, which also times one)."""
    now = clock()[1]
    t0 = now()
    fn()
    calls = max(1, round(effort.sample_s / max(now() - t0, 1e-6)))
    samples = []
    for _ in range(effort.repeats):
        t0 = now()
        for _ in range(calls):
            fn()
        samples.append((now() - t0) / calls)
    return statistics.median(samples)


def _linear_calls(x: torch.Tensor, w: torch.Tensor) -> dict:
    """The calls a linear layer can be made with: {name: fn, or the error that rules it out}."""
    calls = {"linear": lambda: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        calls["mkldnn_prepacked"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError) as e:      # no oneDNN, or not for this dtype here
        calls["mkldnn_prepacked"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return calls


def measure_gemm(dtype: str, effort: Effort) -> list[dict]:
    """GFLOP/s per shape and call in `dtype` (module doc)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for m in effort.gemm_m:
        for k, n in effort.gemm_kn:
            x = torch.randn(m, k, generator=gen).to(DTYPES[dtype])
            w = torch.randn(n, k, generator=gen).to(DTYPES[dtype])
            for call, fn in _linear_calls(x, w).items():
                row = {"dtype": dtype, "call": call, "m": m, "k": k, "n": n}
                if isinstance(fn, str):
                    rows.append({**row, "error": fn})
                    continue
                seconds = _median_call_s(fn, effort)
                rows.append({**row, "gflops": 2 * m * n * k / seconds / 1e9})
    return rows


def measure_bandwidth(effort: Effort, l3_bytes: int | None) -> dict:
    """GB/s of each read kernel over one buffer far bigger than the last-level cache."""
    size = effort.buffer_bytes or min(max(GIB, 4 * (l3_bytes or 0)), _available_bytes() // 4)
    cols = 4096
    rows = size // 4 // cols // 2 * 2
    buf = torch.empty(rows, cols)
    buf.normal_()                                         # touched: its pages are real
    half = rows // 2
    vec = torch.randn(1, cols)
    nbytes = buf.numel() * 4
    kernels = {"sum": (lambda: buf.sum(), nbytes),
               "gemv": (lambda: F.linear(vec, buf), nbytes),
               "copy": (lambda: buf[:half].copy_(buf[half:]), nbytes)}   # half read, half written
    if cpu_ops.load(cpu_flags()):          # a GEMV reading 4 long streams at once
        # 4 rows fewer: the 1 GiB buffer's quarters lie 256 MB apart, a distance that put the
        # streams on the same DRAM banks on a Zen 3 (18.6 GB/s; 4 rows fewer, 26.8)
        uneven = buf[:rows - 4]
        kernels["gemv_streams"] = (lambda: cpu_ops.few_rows_linear(vec, uneven),
                                   uneven.numel() * 4)
    effort = Effort(repeats=effort.repeats, sample_s=0)   # one pass per sample: seconds long
    out = {name: nbytes_ / _median_call_s(fn, effort) / 1e9
           for name, (fn, nbytes_) in kernels.items()}
    return {"gbs": out, "buffer_bytes": nbytes, "l3_bytes": l3_bytes}


def measure_limits(threads: int = 1, effort: Effort | None = None) -> Limits:
    """This machine's limits at `threads` torch threads, on the cores this process may use
    (torch's thread count is put back afterwards)."""
    effort = effort or Effort()
    t0 = time.monotonic()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu = cpu_info()
        with torch.inference_mode():
            gemm = [row for dtype in DTYPES for row in measure_gemm(dtype, effort)]
            bandwidth = measure_bandwidth(effort, cpu["l3_bytes"])
        threads, timed_with = torch.get_num_threads(), clock()[0]
    finally:
        torch.set_num_threads(before)
    peaks = {dtype: max(r["gflops"] for r in gemm if r["dtype"] == dtype and "gflops" in r)
             for dtype in DTYPES}
    return Limits(gemm_gflops=peaks, bandwidth_gbs=max(bandwidth["gbs"].values()), gemm=gemm,
                  bandwidth=bandwidth, threads=threads, clock=timed_with,
                  cores=sorted(os.sched_getaffinity(0)),
                  cpu=cpu, seconds=time.monotonic() - t0)


# --- the floors ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelCost:
    """What one model's prefill and decode cost: its FLOPs (PrefillFlops) and the sizes its
    bytes read per decode step follow from."""

    flops: PrefillFlops
    kv_heads: int

    @classmethod
    def of(cls, config) -> ModelCost:
        """From a model's config (PrefillFlops.of's weights: a checkpoint's, not a packed
        model's parameters())."""
        flops = PrefillFlops.of(config)
        return cls(flops, config.num_key_value_heads)

    def weight_bytes(self, dtype: str) -> int:
        """Every weight read once: the layers and the (tied) lm_head; the embedding rows a
        step gathers and the norms are left out (a few KB)."""
        return (self.flops.layer_params + self.flops.head_params) * DTYPES[dtype].itemsize

    def kv_bytes(self, context: int, dtype: str) -> int:
        """One sequence's K and V over `context` tokens, every layer."""
        f = self.flops
        return 2 * f.layers * self.kv_heads * f.head_dim * context * DTYPES[dtype].itemsize

    def to_dict(self) -> dict:
        return {**asdict(self.flops), "kv_heads": self.kv_heads}

    @classmethod
    def from_dict(cls, d: dict) -> ModelCost:
        d = dict(d)
        return cls(PrefillFlops(**{k: d.pop(k) for k in ("layer_params", "head_params",
                                                          "layers", "heads", "head_dim")}),
                   d["kv_heads"])


@dataclass
class Floors:
    """The limits of this machine applied to one model (module doc)."""

    limits: Limits
    cost: ModelCost

    def prefill_s(self, tokens: int, dtype: str, cached: int = 0) -> float:
        """The least time a prefill of `tokens` new tokens after `cached` can take."""
        return self.cost.flops(tokens, cached) / (self.limits.gemm_gflops[dtype] * 1e9)

    def decode_step(self, batch: int, dtype: str, context: int) -> dict:
        """The least time one decode step of `batch` sequences at `context` tokens can take,
        and what bounds it (bandwidth or compute)."""
        nbytes = self.cost.weight_bytes(dtype) + batch * self.cost.kv_bytes(context, dtype)
        flops = batch * self.cost.flops(1, context)
        memory_s = nbytes / (self.limits.bandwidth_gbs * 1e9)
        compute_s = flops / (self.limits.gemm_gflops[dtype] * 1e9)
        return {"s": max(memory_s, compute_s), "bytes": nbytes, "memory_s": memory_s,
                "flops": flops, "compute_s": compute_s,
                "bound": "bandwidth" if memory_s >= compute_s else "compute"}

    def prefill_fraction(self, tokens: int, measured_s: float, dtype: str,
                         cached: int = 0) -> float:
        """floor / measured for a prefill (1.0: at the limit)."""
        return self.prefill_s(tokens, dtype, cached) / measured_s

    def decode_fraction(self, batch: int, measured_s: float, dtype: str, context: int) -> float:
        """floor / measured for one decode step of `batch` (1.0: at the limit)."""
        return self.decode_step(batch, dtype, context)["s"] / measured_s

    def table(self, prefill_tokens, batches, context: int) -> dict:
        return {"context": context,
                "weight_bytes": {d: self.cost.weight_bytes(d) for d in DTYPES},
                "prefill_s": {d: {str(n): self.prefill_s(n, d) for n in prefill_tokens}
                              for d in DTYPES},
                "decode_step": {d: {str(b): self.decode_step(b, d, context) for b in batches}
                                for d in DTYPES}}

    def to_dict(self) -> dict:
        return {"limits": self.limits.to_dict(), "cost": self.cost.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Floors:
        """From `to_dict`'s output, or the JSON `--out` saves (which holds it)."""
        return cls(Limits.from_dict(d["limits"]), ModelCost.from_dict(d["cost"]))


def floors(limits: Limits, config, *, prefill_tokens=(512, 2400, 8000), batches=(1, 8, 32),
           context: int = 1024) -> dict:
    """The floors (module doc) of a model (its LlamaConfig) on a machine's `limits`."""
    return Floors(limits, ModelCost.of(config)).table(prefill_tokens, batches, context)


def model_config(model: str):
    """`--model`'s LlamaConfig, read as the engine's loader reads it (a GGUF's metadata, a
    directory's config.json), without loading a weight."""
    from prefixgate.backend import gguf_weights
    from prefixgate.backend.config import resolve_model
    from prefixgate.backend.models import LlamaConfig
    from prefixgate.common.gguf_file import open_gguf

    path = resolve_model(model)
    if gguf_weights.is_gguf(path):
        return gguf_weights.config_from_gguf(open_gguf(path))
    return LlamaConfig.from_dir(path)


# --- the command ---------------------------------------------------------------------------

def run(args) -> dict:
    config = model_config(args.model)
    limits = measure_limits(args.threads, Effort.quick() if args.quick else Effort())
    result = Floors(limits, ModelCost.of(config)).to_dict()
    result["config"] = dict(vars(args))
    result["floors"] = floors(limits, config, prefill_tokens=args.prefill_tokens,
                              batches=args.batches, context=args.context)
    return result


def _best(limits: dict, dtype: str) -> str:
    row = max((r for r in limits["gemm"] if r["dtype"] == dtype and "gflops" in r),
              key=lambda r: r["gflops"])
    return f"{row['call']}, M={row['m']} K={row['k']} N={row['n']}"


def report(result: dict) -> None:
    lim, fl, cfg = result["limits"], result["floors"], result["config"]
    cpu = lim["cpu"]
    flags = " ".join(f for f, on in cpu["flags"].items() if on)
    cores = ",".join(map(str, lim["cores"]))
    print(f"limits of this machine: {cpu['model_name']} ({flags}); torch {lim['torch']}, "
          f"{lim['threads']} thread(s) on core(s) {cores}; measured in {lim['seconds']:.1f} s")
    for dtype, peak in lim["gemm_gflops"].items():
        print(f"  GEMM peak {dtype:9} {peak:8,.0f} GFLOP/s  ({_best(lim, dtype)})")
    bw = lim["bandwidth"]
    kernels = ", ".join(f"{k} {v:.1f}" for k, v in bw["gbs"].items())
    print(f"  memory read {lim['bandwidth_gbs']:8.1f} GB/s  (best of {kernels}; over "
          f"{bw['buffer_bytes'] / GIB:.2f} GiB, L3 {cpu['l3']})")
    tokens = list(fl["prefill_s"]["float32"])
    batches = list(fl["decode_step"]["float32"])
    print(f"floors for {cfg['model']} (weights read per decode step: "
          + ", ".join(f"{d} {b / 1e6:,.0f} MB" for d, b in fl["weight_bytes"].items()) + ")")
    print(f"  {'prefill of N tokens, s':34}" + "".join(f"{'N=' + f'{int(t):,}':>12}"
                                                        for t in tokens))
    for dtype, row in fl["prefill_s"].items():
        print(f"    {dtype:32}" + "".join(f"{row[t]:>12.2f}" for t in tokens))
    print(f"  {'decode step at ' + format(fl['context'], ',') + ' tokens, ms':34}"
          + "".join(f"{'batch ' + b:>12}" for b in batches))
    for dtype, row in fl["decode_step"].items():
        print(f"    {dtype:32}" + "".join(f"{row[b]['s'] * 1e3:>10.1f} {row[b]['bound'][0]}"
                                         for b in batches))
    print("  (decode: b = bandwidth-bound, c = compute-bound; a measured time's fraction of "
          "its floor = floor / measured)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.limits",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), demo, a .gguf file or a Hugging Face directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--prefill-tokens", type=int_list, default=[512, 2400, 8000])
    p.add_argument("--batches", type=int_list, default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024,
                   help="decode: tokens each sequence's KV cache holds (default 1024)")
    p.add_argument("--quick", action="store_true",
                   help="one GEMM shape, a 256 MiB buffer, 3 repeats: to see that it works")
    p.add_argument("--out", default=None, help="save the results as JSON here")
    return run_report_save(run, report, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
