"""The decoder's elementwise steps — RMSNorm, the residual add with the next norm, rotary
embedding, SwiGLU's silu-and-multiply — fused on a CPU (fp32 and bf16), decode attention and
fp32 prefill attention (cpu_prefill_attention.cpp) reading the paged KV cache in place, and
products of a decode step's few rows (fp32, and bf16 on AVX-512); PyTorch operators elsewhere.

Between its matrix products a layer runs a dozen elementwise operators; in PyTorch each is a
pass over the activations with its own bf16 <-> fp32 conversions and dispatch. cpu_ops.cpp does
each step in one pass (fp32 inside, one rounding to the activations' dtype). Measured on one
core (Xeon with AMX, SmolLM2's 576-wide rows, bf16): RMSNorm of 512 rows 312 -> 83 us, of one
row 18 -> 1.5 us. Decode attention without the gathered copy of every cached row: see
paged_decode_attention below.

The extension is compiled the first time a model is prepared for a CPU (torch's C++ extension
builder with ninja and the system's C++ compiler, ~30 s) and kept under the cache directory
(`$PREFIXGATE_CACHE`, default ~/.cache/prefixgate) for later starts. Without a compiler, where
the build fails, or with PREFIXGATE_CPU_OPS=0, the functions below run as PyTorch operators,
with one warning; GPUs always do.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
import xxhash

from prefixgate.common.cache_root import cache_root

log = logging.getLogger("prefixgate.engine")

# compiled together into one extension: the module, its prefill attention, its decode loop
SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("cpu_ops.cpp", "cpu_prefill_attention.cpp", "cpu_decode_layers.cpp"))
# at::vec's instruction sets, best first: the flags /proc/cpuinfo must show and the compiler's
AVX512 = ("AVX512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
          ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"])
AVX2 = ("AVX2", {"avx2", "fma", "f16c"}, ["-mavx2", "-mfma", "-mf16c"])
# at::parallel_for runs its loop on torch's OpenMP threads only in code compiled with OpenMP;
# without, every kernel here ran on one thread whatever torch's count (decode at two threads
# no faster than at one). At run time the extension shares torch's own libgomp (same soname).
OPENMP = ["-fopenmp"]

_ops = None                 # the compiled module once loaded; False: unavailable (tried once)
# what plain() can turn off: the elementwise steps, decode and prefill attention in place, the
# KV cache's scatter, the few-rows products, a decode step's layers in one call
# (cpu_decode_layers.py)
PARTS = ("elementwise", "decode_attention", "prefill_attention", "write_kv", "few_rows",
         "decode_layers")
_off: frozenset[str] = frozenset()      # inside plain(): these parts run as PyTorch's operators


def load(cpu_flags: frozenset[str]):
    """The compiled operators (built for a CPU with these /proc/cpuinfo flags if not yet), or
    None where they cannot be had; tried once per process."""
    global _ops
    if _ops is None:
        _ops = _build(cpu_flags) or False
    return _ops or None


def available() -> bool:
    """Whether the compiled operators are loaded (prepare_for_inference loads them)."""
    return bool(_ops)


DTYPES = (torch.float32, torch.bfloat16)


def uses_fused(x: torch.Tensor, part: str = "elementwise") -> bool:
    """Whether `x`'s steps of `part` go through the compiled operators: fp32 or bf16 on a CPU,
    once loaded (prepare_for_inference loads them; until then, and after a failed build, never)
    and unless plain() turned the part off."""
    return bool(_ops) and part not in _off and x.dtype in DTYPES and x.device.type == "cpu"


@contextlib.contextmanager
def plain(*parts: str):
    """PyTorch's operators inside for `parts` (of PARTS; none named: all), loaded or not: the
    baseline of benchmarks and tests."""
    global _off
    check_parts(parts)
    before, _off = _off, _off | frozenset(parts or PARTS)
    try:
        yield
    finally:
        _off = before


def check_parts(parts) -> None:
    """Raises ValueError naming each of `parts` that is not one of PARTS."""
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}: choose from {', '.join(PARTS)}")


def _build(cpu_flags: frozenset[str]):
    if os.environ.get("PREFIXGATE_CPU_OPS", "1") == "0":
        log.info("fused CPU operators off (PREFIXGATE_CPU_OPS=0)")
        return None
    from torch.utils import cpp_extension

    capability, isa_flags = _instruction_set(cpu_flags)
    cflags = ["-O3", f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}",
              *isa_flags, *OPENMP]
    _put_ninja_on_path()
    try:
        sources = _sources_in_build_dir(capability, cflags)
        return cpp_extension.load(
            f"prefixgate_cpu_ops_{capability.lower()}", [str(s) for s in sources], verbose=False,
            build_directory=str(sources[0].parent), extra_cflags=cflags, extra_ldflags=OPENMP)
    except Exception as e:      # no compiler, no ninja, no headers: plain PyTorch still serves
        log.warning("fused CPU operators unavailable, using PyTorch's (slower): %s",
                    str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__)
        return None


def _sources_in_build_dir(capability: str, cflags: list[str]) -> list[Path]:
    """Copies of the sources in the build folder of their content, compiler flags, torch
    install and instruction set. The builder rebuilds whenever a source's path or its headers'
    path changes; compiled from the copies, every install of the same sources (a checkout, a
    wheel, a test's clone) over one torch shares one build, and changed sources, other flags or
    another environment's torch get a folder of their own instead of rebuilding another's."""
    texts = [source.read_bytes() for source in SOURCES]
    version = torch.__version__.replace("+", "_").replace(".", "_")
    key = xxhash.xxh64_hexdigest(b"".join(texts) + " ".join(cflags).encode()
                                 + os.path.dirname(torch.__file__).encode())[:12]
    build_dir = cache_root() / "cpu_ops" / f"torch_{version}_{capability.lower()}_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for source, text in zip(SOURCES, texts):
        copy = build_dir / source.name
        if not copy.is_file() or copy.read_bytes() != text:
            staged = build_dir / f".{source.name}.{os.getpid()}"
            staged.write_bytes(text)
            staged.replace(copy)        # atomic: a concurrent build never reads half a file
        copies.append(copy)
    return copies


def _instruction_set(flags: frozenset[str]) -> tuple[str, list[str]]:
    """The widest of at::vec's instruction sets this CPU has, with its compiler flags."""
    for name, needed, cflags in (AVX512, AVX2):
        if needed <= flags:
            return name, cflags
    return "DEFAULT", []


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` by name: the one pip installed beside this Python counts
    even when the virtual environment is not activated."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "")
    if scripts not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([scripts, path])


# --- the steps -----------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: weight * (x / rms(x)), normalized in fp32."""
    if uses_fused(x):
        return _ops.rms_norm(x, weight, eps)
    # The sum of squares comes from vector_norm, which accumulates in fp32 without an fp32 copy
    # of x: on one CPU core 2.3x faster than pow().mean() at 2,400 tokens.
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inverse_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    return weight * (x.float() * inverse_rms).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """`residual += x` in place (the residual stream), then rms_norm of the sum."""
    if uses_fused(x):
        return _ops.add_rms_norm(x, residual, weight, eps)
    residual.add_(x)
    return rms_norm(residual, weight, eps)


def rope_(qkv: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on the first `heads` heads of qkv [T, all heads, head_dim]
    (Hugging Face's rotate_half layout); cos/sin: fp32 [T, head_dim / 2]."""
    if uses_fused(qkv):
        _ops.rope_(qkv, heads, cos, sin)
        return
    x1, x2 = qkv[:, :heads].chunk(2, dim=-1)
    c, s = cos[:, None].to(qkv.dtype), sin[:, None].to(qkv.dtype)
    rotated_1, rotated_2 = x1 * c - x2 * s, x2 * c + x1 * s
    x1.copy_(rotated_1)
    x2.copy_(rotated_2)


def writes_kv(k: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether write_kv_ stores these rows: a CPU cache of k's dtype (FP8 caches, which need
    scales, keep the reference)."""
    return uses_fused(k, "write_kv") and k_cache.dtype == k.dtype


def write_kv_(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [T, Hkv, D] stored at their flat slots of the paged caches (negative slots skipped),
    as kernels.write_kv does, one row copy each (writes_kv must hold)."""
    _ops.write_kv_(k, v, k_cache, v_cache, slot_mapping)


def decodes_in_place(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention takes these queries over this cache: a CPU cache of q's
    dtype (no FP8 scales), a head_dim it reads (fits_heads)."""
    return (uses_fused(q, "decode_attention") and k_cache.dtype == q.dtype
            and fits_heads(q.shape[-1]))


def fits_heads(head_dim: int) -> bool:
    """Whether the attention kernels read heads of head_dim: a multiple of the vector step (64
    and 128 are). False until the operators are loaded."""
    return bool(_ops) and head_dim % _ops.VECTOR_STEP == 0


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """q [S, H, D]: each sequence's one new token over its seq_lens[s] cached tokens, read
    where they lie in the paged cache [blocks, block_size, Hkv, D] (decodes_in_place must hold).
    The reference gathers every cached row into a new tensor first and hands it to SDPA: at
    batch 32 and 1,024 tokens (SmolLM2, fp32, one core) that copy and SDPA's one-query path took
    most of the step."""
    return _ops.paged_decode_attention(q, k_cache, v_cache, block_tables.int(), seq_lens.int(),
                                       scale)


def prefills_in_place(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether paged_prefill_attention takes these queries over this cache: fp32 queries and
    cache on a CPU, head_dim a multiple of the vector step. (bf16 stays with SDPA, whose CPU
    kernel multiplies bf16 natively where the CPU can.)"""
    return (uses_fused(q, "prefill_attention") and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and fits_heads(q.shape[-1]))


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            scale) -> torch.Tensor:
    """kernels.paged_prefill_attention's contract (prefills_in_place must hold), reading the
    paged cache where it lies: the reference copies each sequence's cached rows out for every
    chunk and layer and gives SDPA 64 queries at a time under a mask (cpu_prefill_attention.cpp
    says what this does instead, and what it measured)."""
    return _ops.paged_prefill_attention(q, k_cache, v_cache, block_tables.int().contiguous(),
                                        seq_lens.int().contiguous(),
                                        query_start_loc.int().contiguous(), scale)


# rows for which few_rows_linear beats MKL's fp32 sgemm and oneDNN's product on a prepacked
# weight (SmolLM2's products, 30 layers, one Zen 3 core, ms, kernel / MKL / oneDNN): 1 row 15.8 /
# 28.6 / 29.4, 8 rows 33.7 / 61.2 / 47.7, 24 rows 76 / 105 / 97, 48 rows 142 / 156 / 149, 56
# rows 173 / 180 / 176; at 64 rows all three within 2% (195 / 191 / 195)
FEW_ROWS = range(1, 57)
# rows for which few_rows_linear_bf16 beats oneDNN's prepacked bf16 product: SmolLM2's products
# and head, one core, Xeon with AMX, ms kernel / oneDNN: 1 row 22.0 / 36.0, 4 rows 26.8 / 36.2,
# 5 rows 31.9 / 35.5, 6 rows 34.2 / 36.0, 8 rows 40.2 / 35.5 (past 6 rows the kernel is bound by
# its FMAs, not by memory); whole decode steps of 5 and 6 sequences 57.0 -> 53.5 and 59.8 -> 58.0
# ms when their rows were taken too
FEW_ROWS_BF16 = range(1, 7)


def multiplies_bf16_rows() -> bool:
    """Whether the compiled operators carry the bf16 few-rows product (built for AVX-512), so
    that a packed layer keeps its plain weight for it."""
    return hasattr(_ops, "few_rows_linear_bf16")


def few_rows_of(dtype: torch.dtype) -> range:
    """The row counts a few-rows kernel multiplies in `dtype` (empty: none)."""
    if dtype == torch.float32:
        return FEW_ROWS
    return FEW_ROWS_BF16 if dtype == torch.bfloat16 and multiplies_bf16_rows() else range(0)


def multiplies_weight(weight: torch.Tensor) -> bool:
    """Whether the few-rows kernel of the weight's dtype takes this weight's shape."""
    if not weight.is_contiguous():
        return False
    return weight.shape[0] >= 4 if weight.dtype == torch.float32 else weight.shape[0] % 8 == 0


def takes_few_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes through a few-rows kernel rather than F.linear."""
    return (uses_fused(x, "few_rows") and x.dim() == 2 and x.shape[0] in few_rows_of(x.dtype)
            and multiplies_weight(weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with the product of a decode step's few rows (fp32, or bf16 on AVX-512)
    through the compiled kernels: the weight read from memory once for all
    rows."""
    if not takes_few_rows(x, weight):
        return F.linear(x, weight, bias)
    return few_rows_linear(x, weight, bias)


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) through the few-rows kernel of x's dtype (takes_few_rows holds)."""
    if x.dtype == torch.float32:
        return _ops.few_rows_linear(x.contiguous(), weight, bias)
    return _ops.few_rows_linear_bf16(x.contiguous(), weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: x [T, 2I] holds gate and up side by side -> silu(gate) * up [T, I]."""
    if uses_fused(x):
        return _ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def decode_layers(*weights_and_shape):
    """cpu_decode_layers.cpp's DecodeLayers (the operators must be loaded): the layers' input
    norm and post-attention norm weights, then their products' (q/k/v, output, gate/up, down of
    each layer in turn) plain weights, packed weights (or None) and biases (or None), then
    heads, KV heads, head_dim, the few-rows kernel's most rows, eps and scale."""
    return _ops.DecodeLayers(*weights_and_shape)
