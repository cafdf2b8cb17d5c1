"""Plain-PyTorch reference for paged decode attention (twin of decode_attention_triton.py).

Vectorised over sequences: gather every sequence's pages up to the longest context, mask the
tail, one batched softmax. fp32 accumulation whatever the cache dtype.
"""
from __future__ import annotations

import torch

from .common import is_fp8, kv_scales


def gather_kv(cache, block_tables, num_tokens: int, scale=None) -> torch.Tensor:
    """Pages of each sequence as contiguous float32 rows: [S, num_tokens, num_kv_heads, head_dim]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    n_pages = max(1, -(-num_tokens // block_size))
    # Unused table entries may hold anything; clamp so the gather stays in bounds (masked later).
    pages = block_tables[:, :n_pages].long().clamp(0, num_blocks - 1)
    rows = cache[pages].reshape(pages.shape[0], n_pages * block_size, num_kv_heads, head_dim)
    rows = rows[:, :num_tokens].float()
    if is_fp8(cache):
        rows = rows * kv_scales(scale, num_kv_heads, cache.device)[:, None]
    return rows


def masked_attention(q, k, v, allowed, scale) -> torch.Tensor:
    """q [S, M, H, D], k/v [S, L, Hkv, D] float32, allowed bool [S, M, L] -> [S, M, H, D] float32.

    Query heads are grouped under their KV head so each group is one batched matmul (GQA without
    copying K/V). Rows with no allowed key (empty sequences) come out as zeros, not NaN.
    """
    s, m, h, d = q.shape
    hkv = k.shape[2]
    g = h // hkv
    qg = q.float().reshape(s, m, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * m, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).view(s, hkv, g, m, -1)
    scores.mul_(scale).masked_fill_(~allowed[:, None, None], float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).min)
    p = scores.sub_(top).exp_()
    p.div_(p.sum(dim=-1, keepdim=True).clamp_min_(1e-30))
    out = torch.matmul(p.view(s, hkv, g * m, -1), v.permute(0, 2, 1, 3))
    return out.view(s, hkv, g, m, d).permute(0, 3, 1, 2, 4).reshape(s, m, h, d)


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                         k_scale=None, v_scale=None) -> torch.Tensor:
    """q [S, H, D]: each sequence's one new token attends to all seq_lens[s] cached tokens."""
    num_seqs = q.shape[0]
    if num_seqs == 0:
        return torch.empty_like(q)
    max_len = int(seq_lens.max())
    k = gather_kv(k_cache, block_tables, max_len, k_scale)
    v = gather_kv(v_cache, block_tables, max_len, v_scale)
    allowed = torch.arange(max_len, device=q.device)[None, :] < seq_lens.to(q.device).long()[:, None]
    out = masked_attention(q[:, None], k, v, allowed[:, None, :], scale)
    return out[:, 0].to(q.dtype)
