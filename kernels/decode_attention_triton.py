"""Triton paged decode attention with split-K (flash-decoding); twin of decode_attention_ref.py.

Grid (sequence, KV head, split): one program loads each K/V tile once for all the query heads
that share its KV head (GQA), walks its share of the context with an online softmax and either
writes the normalised output (one split) or partial (acc, max, sum) rows that a second kernel
merges. Splits are sized from each sequence's own length inside the kernel, so the grid depends
only on static shapes: the launch is safe to capture in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.kernels.triton_utils import (
    attend_tile,
    dot_constants,
    dot_in_fp32,
    num_sms,
    paged_kv_args,
    pow2,
)

MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


@triton.jit
def _decode_kernel(q_ptr, out_ptr, part_ptr, ml_ptr, stride_qs, stride_qh, stride_os, stride_oh,
                   # triton_utils.paged_kv_args
                   k_ptr, v_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, qk_scale,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                   NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, tmask[None, :], k_ptr, v_ptr, bt_row, t,
                                    tmask, kv_head, d, dmask, ks_ptr, vs_ptr, qk_scale,
                                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                    stride_vh, BLOCK_SIZE, IS_FP8, DOT_DTYPE, PRECISION)

    omask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        row = (seq * NUM_HEADS + heads) * NUM_SPLITS + split          # [BLOCK_G]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=omask)
        tl.store(ml_ptr + row * 2, m_i, mask=gmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=gmask)


@triton.jit
def _reduce_kernel(part_ptr, ml_ptr, out_ptr, stride_os, stride_oh,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr):
    """Merge the splits of one (sequence, head): weights 2^(m_i - max) rescale each partial sum."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    smask = sp < NUM_SPLITS
    dmask = d < HEAD_DIM
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + sp
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l_split = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    acc = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l_split * w, 0)
    out = tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


def choose_num_splits(q: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """Enough programs to fill the GPU (about two per SM), never a split under 256 tokens.

    Uses only static shapes (the block-table width bounds the context), so no host sync.
    """
    if not q.is_cuda:
        return 1
    programs = q.shape[0] * num_kv_heads
    want = -(-2 * num_sms(q.device.index or 0) // max(programs, 1))
    return max(1, min(want, -(-max_context // MIN_TOKENS_PER_SPLIT), MAX_SPLITS))


def decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                            k_scale=None, v_scale=None,
                            num_splits: int | None = None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert (q.stride(2) == 1 and k_cache.stride(3) == 1
            and v_cache.stride(3) == 1), "head_dim must be contiguous"
    block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(q, num_kv_heads, block_tables.shape[1] * block_size)
    block_n = 64 if not dot_in_fp32(q) else 32
    if num_splits > 1:
        part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32,
                           device=q.device)
        ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, out, part, ml, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *paged_kv_args(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=pow2(group, 16),
        HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim, 16),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        **dot_constants(q, k_cache), num_warps=4)
    if num_splits > 1:
        _reduce_kernel[(num_seqs, num_heads)](
            part, ml, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim,
            BLOCK_D=pow2(head_dim, 16), NUM_SPLITS=num_splits, BLOCK_SPLITS=pow2(num_splits, 2))
    return out
