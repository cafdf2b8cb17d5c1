"""Triton KV-cache scatter; twin of write_kv_ref.py.

One program per new token writes all its KV heads into its flat slot; FP8 caches quantize with
the per-head scale (saturating at +-448, like the reference). Negative slots (padding) are skipped.
"""
from __future__ import annotations

import triton
import triton.language as tl

from prefixgate.kernels.shared import FP8_MAX, is_fp8
from prefixgate.kernels.triton_utils import pow2, scale_args


@triton.jit
def _round_to_e4m3(x):
    """Round float32 (already within +-448) to the nearest e4m3 value, ties to even, in fp32.

    The cast that follows is then exact. Hardware casts round correctly by themselves, but the
    Triton interpreter's fp8 cast truncates without carrying into the exponent; doing the
    rounding here gives one code path whose results match torch's `.to(float8_e4m3fn)` everywhere.
    """
    bits = x.to(tl.int32, bitcast=True)
    keep_lsb = (bits >> 20) & 1                      # e4m3 keeps 3 of fp32's 23 mantissa bits
    normal = ((bits + 0x7FFFF + keep_lsb) & -0x100000).to(tl.float32, bitcast=True)
    # 1.5 * 2**23: adding it rounds to an integer (RNE)
    magic = 12582912.0
    ax = tl.abs(x)
    subnormal = ((ax * 512.0 + magic) - magic) * 0.001953125  # e4m3 subnormals: multiples of 2**-9
    # keep the sign bit, even of -0, like torch
    subnormal = tl.where(bits < 0, -subnormal, subnormal)
    return tl.where(ax < 0.015625, subnormal, normal)


@triton.jit
def _write_one(x_ptr, cache_ptr, scale_ptr, token, slot, h, hmask, d, mask, stride_xt, stride_xh,
               stride_cb, stride_ct, stride_ch, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
               FP8_LIMIT: tl.constexpr):
    x = tl.load(x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask,
                other=0.0)
    if IS_FP8:
        scale = tl.load(scale_ptr + h, mask=hmask, other=1.0)
        # IEEE division (div_rn), as torch does: GPU `/` may be approximate and flip a rounding tie.
        scaled = tl.math.div_rn(x.to(tl.float32), scale[:, None])
        x = _round_to_e4m3(tl.clamp(scaled, -FP8_LIMIT, FP8_LIMIT))
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    tl.store(cache_ptr + dst + h[:, None] * stride_ch + d[None, :],
             x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_FP8: tl.constexpr,
                     FP8_LIMIT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = h < NUM_KV_HEADS
    mask = hmask[:, None] & (d[None, :] < HEAD_DIM)
    _write_one(k_ptr, kc_ptr, ks_ptr, token, slot, h, hmask, d, mask, stride_kt, stride_kh,
               stride_kcb, stride_kct, stride_kch, BLOCK_SIZE, IS_FP8, FP8_LIMIT)
    _write_one(v_ptr, vc_ptr, vs_ptr, token, slot, h, hmask, d, mask, stride_vt, stride_vh,
               stride_vcb, stride_vct, stride_vch, BLOCK_SIZE, IS_FP8, FP8_LIMIT)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert (k.stride(2) == 1 and v.stride(2) == 1
            and k_cache.stride(3) == 1), "head_dim must be contiguous"
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping.contiguous(),
        scale_args(k_cache, k_scale, k.device), scale_args(v_cache, v_scale, k.device),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=pow2(num_kv_heads),
        HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim),
        BLOCK_SIZE=block_size, IS_FP8=is_fp8(k_cache), FP8_LIMIT=FP8_MAX)
