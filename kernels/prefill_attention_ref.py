"""Plain-PyTorch reference for paged prefill attention over a cached prefix
(twin of prefill_attention_triton.py).

New token i of sequence s sits at position seq_lens[s] - q_len_s + i and attends to cached
positions <= its own (prefix caching and chunked prefill both produce this shape of batch).
Single-token sequences (decodes mixed into a prefill step) go through the vectorised decode
reference in one batch; longer ones run one at a time so padding never multiplies the work.
"""
from __future__ import annotations

import torch

from .decode_attention_ref import decode_attention_ref, gather_kv, masked_attention


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
        out[rows] = decode_attention_ref(q[rows], k_cache, v_cache, block_tables[idx],
                                         seq_lens.to(q.device)[idx], scale, k_scale, v_scale)
    for s, n in enumerate(q_lens):
        if n <= 1:
            continue
        seq_len = lens[s]
        k = gather_kv(k_cache, block_tables[s:s + 1], seq_len, k_scale)
        v = gather_kv(v_cache, block_tables[s:s + 1], seq_len, v_scale)
        pos = torch.arange(seq_len - n, seq_len, device=q.device)
        allowed = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
        a, b = starts[s], starts[s + 1]
        out[a:b] = masked_attention(q[None, a:b], k, v, allowed[None], scale)[0].to(q.dtype)
    return out
