"""Plain-PyTorch reference for paged decode attention (twin of decode_attention_triton.py),
and the gather / attention helpers the prefill reference shares.

Sequences of similar length are gathered together into contiguous K/V and go through one call
to torch's fused attention (SDPA), which streams the scores instead of materialising them;
very different lengths go in separate calls, so a long context never pads the short ones.
fp32 accumulation whatever the cache dtype. fp32 and bf16 queries attend in their own dtype
(SDPA's CPU kernel accumulates bf16 in fp32 and, on CPUs with bf16 dot products, runs 2.5x as
fast as on an fp32 copy: 23 vs 58 ms per layer for 2,400 causal tokens of SmolLM2 on one core);
fp16 and FP8 caches are attended in fp32.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from prefixgate.kernels.shared import is_fp8, kv_scales

# enable_gqa arrived in torch 2.5; older versions get K/V heads repeated instead.
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# Padding (in KV rows) that costs about as much as one more SDPA call on CPU; see length_groups.
PAD_ROWS = 256
# Queries per SDPA call of causal_attention (64 measured best of 64, 128, 256 and all at once,
# in fp32). In bf16 on a CPU, with keys cached before the queries, 256: SDPA multiplies bf16
# natively there and a call's fixed costs weigh more (SmolLM2's heads, one core of the Xeon
# with AMX, 512 queries over 1,024 / 2,400 / 4,096 keys: 4.31-4.60 / 11.3-12.2 / 20.7 ms in
# blocks of 64, 3.73-3.93 / 9.3-10.0 / 16.9 ms in blocks of 256); with no prefix, 64 stayed
# best (512 causal queries 1.55-1.87 against 1.73-1.83 ms).
QUERY_BLOCK = 64
QUERY_BLOCK_BF16_PREFIXED = 256
# Causal queries with no cached prefix up to which causal_attention keeps a mask of rows x rows
# (16 MiB in fp32 at 2,048) to go in blocks.
CAUSAL_MASK_ROWS = 2048


def fp8_scales(cache, scale) -> torch.Tensor | None:
    """Per-KV-head float32 scales for an FP8 cache, None otherwise (other dtypes store values as
    is)."""
    return kv_scales(scale, cache.shape[2], cache.device) if is_fp8(cache) else None


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """What SDPA computes in for queries of q's dtype: bf16 and fp32 as they are, else fp32."""
    return q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32


def gather_kv(cache, block_tables, num_tokens: int, scales=None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The first num_tokens cached rows of each sequence as `dtype`
    [S, num_tokens, num_kv_heads, head_dim].

    block_tables [S, max_blocks]; scales: from fp8_scales (None: no dequantization).
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    n_pages = -(-num_tokens // block_size)
    pages = block_tables[:, :n_pages].reshape(-1).long()
    # index_select copies whole pages: ~6x faster than advanced indexing (cache[pages]) on CPU
    rows = cache.index_select(0, pages).view(-1, n_pages * block_size, num_kv_heads, head_dim)
    rows = rows[:, :num_tokens]
    if scales is not None:
        return (rows.float() * scales[:, None]).to(dtype)
    return rows.to(dtype)


def sdpa(q, k, v, scale, **kw) -> torch.Tensor:
    """q [B, H, M, D], k/v [B, Hkv, L, D] of k's dtype -> [B, H, M, D] of that dtype. Always
    4-D: 3-D inputs make CPU SDPA fall back to its unfused (materialising) path."""
    if _SDPA_GQA:
        kw["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    return F.scaled_dot_product_attention(q.to(k.dtype), k, v, scale=scale, **kw)


def causal_attention(q, k, v, scale) -> torch.Tensor:
    """q [M, H, D], k/v [L, Hkv, D] -> [M, H, D] of k's dtype, causal aligned to the end:
    query i sits at position L - M + i and sees keys at positions <= its own.

    Queries with no visible key (M > L, only in malformed batches) come out as zeros, not NaN.
    Many queries go in blocks of QUERY_BLOCK, each over the keys its last query sees: SDPA's
    CPU kernel otherwise spends much of its time on the masked triangle (one core, fp32,
    SmolLM2's heads: 512 causal queries 9.1 -> 6.5 ms, 512 over a 512-token prefix 19.2 ->
    16.7 ms).
    """
    m, length = q.shape[0], k.shape[0]
    out = torch.zeros(q.shape, dtype=k.dtype, device=q.device)
    skip = max(0, m - length)
    rows = m - skip
    if rows == 0:
        return out
    q4, k4, v4 = q[None, skip:].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2)
    if rows == 1 or rows == length > CAUSAL_MASK_ROWS:
        # one query (the last position) sees every key; a long causal prompt alone (a step
        # budget above the defaults) lets SDPA skip masked tiles rather than cache a mask of
        # rows x rows
        out[skip:] = sdpa(q4, k4, v4, scale, is_causal=rows > 1)[0].transpose(0, 1)
        return out
    mask = end_aligned_causal_mask(rows, length, q.device, k.dtype)
    block = query_block(q, rows, length)
    for start in range(0, rows, block):
        end = min(rows, start + block)
        keys = length - rows + end          # what the block's last query sees
        o = sdpa(q4[:, :, start:end], k4[:, :, :keys], v4[:, :, :keys], scale,
                 attn_mask=mask[start:end, :keys])
        out[skip + start:skip + end] = o[0].transpose(0, 1)
    return out


def query_block(q: torch.Tensor, rows: int, length: int) -> int:
    """Queries per SDPA call of causal_attention (see QUERY_BLOCK)."""
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and length > rows:
        return QUERY_BLOCK_BF16_PREFIXED
    return QUERY_BLOCK


@functools.lru_cache(maxsize=8)
def end_aligned_causal_mask(rows: int, length: int, device: torch.device,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive mask [rows, length] of the queries' dtype: row i (position length - rows + i)
    sees keys <= it.

    Cached because every layer of a step asks for the same shapes: building it (and SDPA
    converting a bool mask) cost ~1 ms per layer of a 512-token chunk over a 2k-token prefix.
    """
    pos = torch.arange(length - rows, length, device=device)
    visible = torch.arange(length, device=device)[None, :] <= pos[:, None]
    return torch.zeros(rows, length, device=device, dtype=dtype).masked_fill_(~visible,
                                                                             float("-inf"))


def length_groups(lens: list[int], pad_rows: int = PAD_ROWS) -> list[list[int]]:
    """Indices of the non-empty sequences, longest first, cut into groups whose members are at
    most pad_rows shorter than the group's longest: one padded call per group beats one call
    per sequence while the padding costs less than a call's fixed overhead."""
    order = sorted((s for s, n in enumerate(lens) if n > 0), key=lambda s: -lens[s])
    groups: list[list[int]] = []
    for s in order:
        if groups and lens[groups[-1][0]] - lens[s] <= pad_rows:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale,
                         k_scale=None, v_scale=None) -> torch.Tensor:
    """q [S, H, D]: each sequence's one new token attends to all seq_lens[s] cached tokens.
    Sequences with nothing cached (seq_lens 0) give zeros."""
    ks, vs = fp8_scales(k_cache, k_scale), fp8_scales(v_cache, v_scale)
    lens = seq_lens.tolist()
    dtype = attention_dtype(q)
    groups = length_groups(lens)
    if len(groups) == 1 and len(groups[0]) == len(lens):     # the usual decode batch: one call
        return _attend(q, k_cache, v_cache, block_tables, lens, ks, vs, scale, dtype)
    out = torch.zeros_like(q)           # sequences with nothing cached stay zeros
    for group in groups:
        group.sort()
        idx = torch.tensor(group, device=q.device)
        tables = block_tables.index_select(0, idx.to(block_tables.device))
        out[idx] = _attend(q[idx], k_cache, v_cache, tables, [lens[s] for s in group], ks, vs,
                           scale, dtype)
    return out


def _attend(q, k_cache, v_cache, tables, lens: list[int], ks, vs, scale, dtype) -> torch.Tensor:
    """One padded SDPA call for sequences of similar lengths `lens` (their block tables,
    their queries q [G, H, D]); a ragged group hides each sequence's padding with a mask."""
    longest = max(lens)
    k = gather_kv(k_cache, tables, longest, ks, dtype).transpose(1, 2)     # [G, Hkv, L, D]
    v = gather_kv(v_cache, tables, longest, vs, dtype).transpose(1, 2)
    kw = {}
    if min(lens) != longest:
        n = torch.tensor(lens, device=q.device)
        visible = torch.arange(longest, device=q.device)[None, :] < n[:, None]
        kw["attn_mask"] = visible[:, None, None]
    return sdpa(q[:, :, None], k, v, scale, **kw)[:, :, 0].to(q.dtype)
