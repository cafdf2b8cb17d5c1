"""Plain-PyTorch reference for paged prefill attention over a cached prefix
(twin of prefill_attention_triton.py).

New token i of sequence s sits at position seq_lens[s] - q_len_s + i and attends to cached
positions <= its own (prefix caching and chunked prefill both produce this shape of batch).
Single-token sequences (decodes mixed into a prefill step) go through the decode reference
together; longer ones run one at a time, so padding never multiplies the work: each gathers its
own pages once and goes through fused SDPA in blocks of queries under an end-aligned causal
mask (decode_attention_ref.causal_attention).
"""
from __future__ import annotations

import torch

from prefixgate.kernels.decode_attention_ref import (
    attention_dtype,
    causal_attention,
    decode_attention_ref,
    fp8_scales,
    gather_kv,
)


def prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          k_scale=None, v_scale=None) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    singles = [s for s, n in enumerate(q_lens) if n == 1]
    if singles:
        idx = torch.tensor(singles, device=q.device)
        rows = torch.tensor([starts[s] for s in singles], device=q.device)
        out[rows] = decode_attention_ref(q[rows], k_cache, v_cache,
                                         block_tables[idx.to(block_tables.device)],
                                         seq_lens[idx.to(seq_lens.device)], scale, k_scale, v_scale)
    ks, vs = fp8_scales(k_cache, k_scale), fp8_scales(v_cache, v_scale)
    dtype = attention_dtype(q)
    for s, n in enumerate(q_lens):
        if n <= 1:
            continue
        a, seq_len = starts[s], lens[s]
        k = gather_kv(k_cache, block_tables[s:s + 1], seq_len, ks, dtype)[0]
        v = gather_kv(v_cache, block_tables[s:s + 1], seq_len, vs, dtype)[0]
        out[a:a + n] = causal_attention(q[a:a + n], k, v, scale).to(q.dtype)
    return out
