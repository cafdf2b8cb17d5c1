"""Triton paged prefill attention over a cached prefix; twin of prefill_attention_ref.py.

Grid (query tile, query head) over the ragged batch: each sequence gets cdiv(q_len, BLOCK_M)
tiles, numbered consecutively; a program finds its sequence by binary search over the tiles' prefix
sums (computed on the device, so no host sync and a grid sized from shapes alone). Sequence s
owns q rows query_start_loc[s]:[s+1]; its new token i sits at position seq_lens[s] - q_len + i.
Each program streams the K/V pages its tile can see (up to the tile's last position) with a
FlashAttention-style online softmax in fp32 and a causal mask on positions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixgate.kernels.triton_utils import (
    attend_tile,
    dot_constants,
    dot_in_fp32,
    paged_kv_args,
    pow2,
)


@triton.jit
def _find_sequence(tile_starts_ptr, pid, NUM_SEQS: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Largest s with tile_starts[s] <= pid (tile_starts: NUM_SEQS + 1 non-decreasing entries)."""
    lo = 0
    hi = NUM_SEQS
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi + 1) // 2
        below = tl.load(tile_starts_ptr + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid - 1)
    return lo


@triton.jit
def _prefill_kernel(q_ptr, out_ptr, qsl_ptr, tile_starts_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    # triton_utils.paged_kv_args
                    k_ptr, v_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, qk_scale,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
                    NUM_SEQS: tl.constexpr, SEARCH_STEPS: tl.constexpr, GROUP: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    IS_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_sequence(tile_starts_ptr, pid, NUM_SEQS, SEARCH_STEPS)
    if seq >= NUM_SEQS:        # the grid is an upper bound on the number of tiles
        return
    tile = pid - tl.load(tile_starts_ptr + seq)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(lens_ptr + seq)
    kv_head = head // GROUP

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < q_len
    pos = seq_len - q_len + m
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    q_rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq * stride_bt
    # one past the last position this tile can see
    kv_end = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < kv_end
        causal = tmask[None, :] & (t[None, :] <= pos[:, None])   # padded rows see no key at all
        m_i, l_i, acc = attend_tile(q, m_i, l_i, acc, causal, k_ptr, v_ptr, bt_row, t,
                                    tmask, kv_head, d, dmask, ks_ptr, vs_ptr, qk_scale,
                                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                    stride_vh, BLOCK_SIZE, IS_FP8, DOT_DTYPE, PRECISION)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def prefill_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                             k_scale=None, v_scale=None) -> torch.Tensor:
    total, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if total == 0 or num_seqs == 0:
        return out
    assert (q.stride(2) == 1 and k_cache.stride(3) == 1
            and v_cache.stride(3) == 1), "head_dim must be contiguous"
    fp32 = dot_in_fp32(q)
    block_m, block_n = (32, 32) if fp32 else (64, 64)
    block_tables = block_tables.contiguous()
    query_start_loc = query_start_loc.contiguous()
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    tile_starts = torch.zeros(num_seqs + 1, dtype=torch.int32, device=q.device)
    torch.cumsum((q_lens + block_m - 1) // block_m, 0, out=tile_starts[1:])
    # sum of cdiv(q_len, BLOCK_M) <= cdiv(total, BLOCK_M) + num_seqs: a bound with no host sync
    grid = (triton.cdiv(total, block_m) + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, out, query_start_loc, tile_starts, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1),
        *paged_kv_args(q, k_cache, v_cache, block_tables, seq_lens.contiguous(), scale, k_scale,
                       v_scale),
        NUM_SEQS=num_seqs, SEARCH_STEPS=max(1, num_seqs.bit_length()),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=pow2(head_dim, 16), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, **dot_constants(q, k_cache),
        num_warps=4 if fp32 else 8, num_stages=2)
    return out
