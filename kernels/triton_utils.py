"""Small host-side helpers for the Triton kernels (imported only on the Triton path)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from prefixgate.kernels.shared import is_fp8, kv_scales

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def dot_in_fp32(q: torch.Tensor) -> bool:
    """fp32 inputs keep fp32 (IEEE) dots; the interpreter needs fp32 too (numpy has no bf16
    matmul)."""
    return q.dtype == torch.float32 or interpreting()


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def scale_args(cache: torch.Tensor, scale, device):
    """Per-KV-head float32 scales for FP8 caches, a dummy pointer otherwise."""
    if is_fp8(cache):
        return kv_scales(scale, cache.shape[2], device)
    return torch.ones(1, dtype=torch.float32, device=device)


def pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(int(n)))


def paged_kv_args(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale) -> tuple:
    """The arguments every paged attention kernel takes after its own, in this order: the K
    and V caches, the block tables, the sequence lengths, the K and V scales (`scale_args`),
    the softmax scale in the log2 domain, the caches' [block, token, head] strides and the
    block tables' row stride (block tables and lengths contiguous)."""
    return (k_cache, v_cache, block_tables, seq_lens,
            scale_args(k_cache, k_scale, q.device), scale_args(v_cache, v_scale, q.device),
            float(scale) * LOG2E, *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_tables.stride(0))


def dot_constants(q: torch.Tensor, k_cache: torch.Tensor) -> dict:
    """The constexprs `attend_tile` needs: FP8 cache or not, the dots' dtype and precision."""
    return {"IS_FP8": is_fp8(k_cache), "DOT_DTYPE": dot_dtype(q),
            "PRECISION": "ieee" if dot_in_fp32(q) else "tf32"}


@triton.jit
def load_kv_tile(cache_ptr, bt_row_ptr, t, tmask, kv_head, d, dmask, scale_ptr,
                 stride_b, stride_t, stride_h,
                 BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Rows t (token positions of one sequence) of the paged cache for one KV head:
    [len(t), BLOCK_D].

    Each token finds its page through the block table, so a tile may span several pages and the
    page size need not match the tile size. FP8 rows are dequantized with the head's scale
    (`scale_ptr`: float32 per KV head).
    """
    page = tl.load(bt_row_ptr + t // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    rows = page * stride_b + (t % BLOCK_SIZE).to(tl.int64) * stride_t + kv_head * stride_h
    x = tl.load(cache_ptr + rows[:, None] + d[None, :], mask=tmask[:, None] & dmask[None, :],
                other=0.0)
    if IS_FP8:
        x = x.to(tl.float32) * tl.load(scale_ptr + kv_head)
    return x.to(DOT_DTYPE)


@triton.jit
def attend_tile(q, m_i, l_i, acc, visible, k_ptr, v_ptr, bt_row_ptr, t, tmask, kv_head, d, dmask,
                ks_ptr, vs_ptr, qk_scale,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
                PRECISION: tl.constexpr):
    """One online-softmax step (log2 domain: `qk_scale` includes log2 e) of the query rows `q`
    over the keys and values at positions t, of which each row sees those `visible` marks:
    the running row maxima, sums and output accumulator, updated.
    """
    k = load_kv_tile(k_ptr, bt_row_ptr, t, tmask, kv_head, d, dmask, ks_ptr,
                     stride_kb, stride_kt, stride_kh, BLOCK_SIZE, IS_FP8, DOT_DTYPE)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row that sees no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(v_ptr, bt_row_ptr, t, tmask, kv_head, d, dmask, vs_ptr,
                     stride_vb, stride_vt, stride_vh, BLOCK_SIZE, IS_FP8, DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
    return m_new, l_i, acc


def dot_dtype(q: torch.Tensor):
    if dot_in_fp32(q):
        return tl.float32
    return tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16
