"""Plain-PyTorch reference for paged prefill attention over a cached prefix
(twin of prefill_attention_triton.py).

New token i of sequence s sits at position seq_lens[s] - q_len_s + i and attends to cached
positions <= its own (prefix caching and chunked prefill both produce this shape of batch).
Sequences run one at a time, so padding never multiplies the work: each gathers its own pages
once and makes one fused SDPA call (plain causal without a prefix, an end-aligned causal mask
with one). Single-token sequences (decodes mixed into a prefill step) take the same path unmasked.
"""
from __future__ import annotations

import torch

from .decode_attention_ref import causal_attention, fp8_scales, gather_kv


def prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          k_scale=None, v_scale=None) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    ks, vs = fp8_scales(k_cache, k_scale), fp8_scales(v_cache, v_scale)
    for s, seq_len in enumerate(lens):
        a, b = starts[s], starts[s + 1]
        if b == a:
            continue
        if seq_len <= 0:
            out[a:b] = 0
            continue
        k = gather_kv(k_cache, block_tables[s], seq_len, ks)
        v = gather_kv(v_cache, block_tables[s], seq_len, vs)
        out[a:b] = causal_attention(q[a:b], k, v, scale).to(q.dtype)
    return out
