"""Plain-PyTorch reference for the KV-cache scatter (twin of write_kv_triton.py)."""
from __future__ import annotations

from prefixgate.kernels.shared import is_fp8, kv_scales, quantize_fp8


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Store k/v [T, num_kv_heads, head_dim] at flat slots (block * block_size + offset).

    Negative slots are skipped: padded rows (e.g. CUDA-graph padding) write nothing.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        if is_fp8(cache):
            x = quantize_fp8(x, kv_scales(scale, num_kv_heads, x.device))
        flat[slots] = x.to(cache.dtype)
