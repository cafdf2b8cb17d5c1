"""Plain-PyTorch reference for paged decode attention (twin of decode_attention_triton.py).

One sequence at a time: gather exactly its own pages into contiguous K/V, then one call to
torch's fused CPU attention (SDPA). Padding every sequence to the longest context and masking
costs more than the short Python loop, and SDPA streams the scores instead of materialising
them. fp32 accumulation whatever the cache dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import is_fp8, kv_scales

# enable_gqa arrived in torch 2.5; older versions get K/V heads repeated instead.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def fp8_scales(cache, scale) -> torch.Tensor | None:
    """Per-KV-head float32 scales for an FP8 cache, None otherwise (other dtypes store values as is)."""
    return kv_scales(scale, cache.shape[2], cache.device) if is_fp8(cache) else None


def gather_kv(cache, table_row, num_tokens: int, scales=None) -> torch.Tensor:
    """One sequence's first num_tokens cached rows as float32 [num_tokens, num_kv_heads, head_dim].

    table_row: that sequence's block table; scales: from fp8_scales (None: no dequantization).
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    n_pages = -(-num_tokens // block_size)
    rows = cache.index_select(0, table_row[:n_pages].long()).view(-1, num_kv_heads, head_dim)
    rows = rows[:num_tokens].float()
    if scales is not None:
        rows = rows * scales[:, None]
    return rows


def causal_attention(q, k, v, scale) -> torch.Tensor:
    """q [M, H, D], k/v [L, Hkv, D] float32 -> [M, H, D] float32, causal aligned to the end:
    query i sits at position L - M + i and sees keys at positions <= its own.

    Queries with no visible key (M > L, only in malformed batches) come out as zeros, not NaN.
    """
    m, h, d = q.shape
    length, hkv = k.shape[0], k.shape[1]
    out = torch.zeros(m, h, d, dtype=torch.float32, device=q.device)
    skip = max(0, m - length)
    if length == 0 or skip == m:
        return out
    q4 = q[skip:].float().transpose(0, 1)[None]          # [1, H, M', D]; 4-D selects the fused kernel
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    kw = {"enable_gqa": True} if _SDPA_GQA else {}
    if not _SDPA_GQA and hkv != h:
        k4, v4 = k4.repeat_interleave(h // hkv, dim=1), v4.repeat_interleave(h // hkv, dim=1)
    rows = m - skip
    if rows == length:          # no cached prefix: plain causal, which lets SDPA skip masked tiles
        kw["is_causal"] = True
    elif rows > 1:              # a single query is the last position and sees every key: no mask
        pos = torch.arange(length - rows, length, device=q.device)
        kw["attn_mask"] = torch.arange(length, device=q.device)[None, :] <= pos[:, None]
    out[skip:] = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, **kw)[0].transpose(0, 1)
    return out


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                         k_scale=None, v_scale=None) -> torch.Tensor:
    """q [S, H, D]: each sequence's one new token attends to all seq_lens[s] cached tokens.
    Sequences with nothing cached (seq_lens 0) give zeros."""
    out = torch.zeros_like(q)
    ks, vs = fp8_scales(k_cache, k_scale), fp8_scales(v_cache, v_scale)
    for s, n in enumerate(seq_lens.tolist()):
        if n <= 0:
            continue
        k = gather_kv(k_cache, block_tables[s], n, ks)
        v = gather_kv(v_cache, block_tables[s], n, vs)
        out[s] = causal_attention(q[s:s + 1], k, v, scale)[0].to(q.dtype)
    return out
