"""Paged-KV attention kernels for the bundled engine, each beside a plain-PyTorch reference.

Public API (docs/engine.md: kernels):
  KV cache per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  (float32/float16/bfloat16, or torch.float8_e4m3fn with k_scale/v_scale per tensor or per KV head).

backend=None (or "auto") runs Triton on CUDA tensors and the reference otherwise; "torch" or
"triton" forces one. Triton is imported only when the Triton path runs, so CPU users never pay
for it and tests can set TRITON_INTERPRET=1 first.
"""
from __future__ import annotations

import torch

from prefixgate.kernels.decode_attention_ref import decode_attention_ref
from prefixgate.kernels.prefill_attention_ref import prefill_attention_ref
from prefixgate.kernels.shared import pick_backend
from prefixgate.kernels.write_kv_ref import write_kv_ref

__all__ = ["paged_decode_attention", "paged_prefill_attention", "write_kv"]


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                           k_scale=None, v_scale=None, *, backend=None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim]; one new token per sequence attends to all
    seq_lens[s] cached tokens. Returns [num_seqs, num_heads, head_dim] in q's dtype."""
    if pick_backend(backend, q) == "torch":
        return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                    k_scale, v_scale)
    from prefixgate.kernels.decode_attention_triton import decode_attention_triton
    return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                   k_scale, v_scale)


def paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                            k_scale=None, v_scale=None, *, backend=None) -> torch.Tensor:
    """q [total_new_tokens, num_heads, head_dim]; sequence s owns rows
    query_start_loc[s]:query_start_loc[s+1] and its new token i (position seq_lens[s]-q_len+i)
    attends causally to cached positions <= its own."""
    if pick_backend(backend, q) == "torch":
        return prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                     scale, k_scale, v_scale)
    from prefixgate.kernels.prefill_attention_triton import prefill_attention_triton
    return prefill_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                    scale, k_scale, v_scale)


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *,
             backend=None) -> None:
    """Scatter k/v [T, num_kv_heads, head_dim] into flat slots (block * block_size + offset);
    FP8 caches quantize with k_scale/v_scale. Negative slots are skipped (padding)."""
    if pick_backend(backend, k) == "torch":
        return write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    from prefixgate.kernels.write_kv_triton import write_kv_triton
    return write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
