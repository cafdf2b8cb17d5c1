"""Kernel test helpers: paged-KV cases (random contiguous K/V per sequence, scattered into
shuffled cache blocks) and a naive contiguous-attention answer from torch SDPA."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prefixgate.kernels.shared import FP8_DTYPE, kv_scales


@dataclass
class PagedCase:
    q: torch.Tensor                 # [T, H, D] new tokens of all sequences, concatenated
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor      # int32 [S, max_blocks]
    seq_lens: torch.Tensor          # int32 [S]
    query_start_loc: torch.Tensor   # int32 [S+1]
    slot_mapping: torch.Tensor      # int64 [sum(seq_lens)] slots of every cached token, in order
    k_rows: torch.Tensor            # [sum(seq_lens), Hkv, D] the K/V that were written
    v_rows: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float


def make_case(seq_lens, q_lens, num_heads=4, num_kv_heads=1, head_dim=16, block_size=16,
              dtype=torch.float32, fp8=False, per_head_scale=False, device="cpu",
              seed=0) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(pages) + 1          # one spare column of garbage, never read
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g)
    slots, used = [], 0
    for s, n in enumerate(seq_lens):
        tables[s, :pages[s]] = perm[used:used + pages[s]]
        used += pages[s]
        slots += [int(tables[s, t // block_size]) * block_size + t % block_size for t in range(n)]
    total = sum(seq_lens)
    k_rows = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v_rows = torch.randn(total, num_kv_heads, head_dim, generator=g)
    cache_dtype = FP8_DTYPE if fp8 else dtype
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*cache_shape, generator=g).to(cache_dtype)
    v_cache = torch.randn(*cache_shape, generator=g).to(cache_dtype)
    k_scale = v_scale = None
    if fp8:
        k_scale = ((torch.rand(num_kv_heads, generator=g) * 0.02 + 0.01) if per_head_scale
                   else torch.tensor(0.015))
        v_scale = ((torch.rand(num_kv_heads, generator=g) * 0.02 + 0.01) if per_head_scale
                   else torch.tensor(0.02))
    slot_t = torch.tensor(slots, dtype=torch.int64)
    for rows, cache, sc in ((k_rows, k_cache, k_scale), (v_rows, v_cache, v_scale)):
        flat = cache.view(-1, num_kv_heads, head_dim)
        if fp8:
            sc = kv_scales(sc, num_kv_heads, "cpu")
            flat[slot_t] = (rows / sc[:, None]).clamp(-448, 448).to(FP8_DTYPE)
        else:
            flat[slot_t] = rows.to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)

    def to(t):
        return None if t is None else t.to(device)

    return PagedCase(q=to(q), k_cache=to(k_cache), v_cache=to(v_cache),
                     block_tables=to(tables.to(torch.int32)),
                     seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
                     query_start_loc=to(qsl), slot_mapping=to(slot_t), k_rows=to(k_rows),
                     v_rows=to(v_rows),
                     k_scale=to(k_scale), v_scale=to(v_scale), scale=head_dim ** -0.5)


def naive_attention(case: PagedCase) -> torch.Tensor:
    """Contiguous attention per sequence with torch SDPA and an explicit causal mask (float32),
    reading K/V back from the cache so FP8 rounding matches what the kernels see."""
    hkv, d = case.k_cache.shape[2], case.k_cache.shape[3]
    flat_k = case.k_cache.view(-1, hkv, d)[case.slot_mapping].float()
    flat_v = case.v_cache.view(-1, hkv, d)[case.slot_mapping].float()
    if case.k_scale is not None:
        flat_k = flat_k * kv_scales(case.k_scale, hkv, flat_k.device)[:, None]
        flat_v = flat_v * kv_scales(case.v_scale, hkv, flat_v.device)[:, None]
    out = torch.empty(case.q.shape, dtype=torch.float32, device=case.q.device)
    qsl, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    start = 0
    h = case.q.shape[1]
    for s, n in enumerate(lens):
        a, b = qsl[s], qsl[s + 1]
        k = flat_k[start:start + n].repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        v = flat_v[start:start + n].repeat_interleave(h // hkv, dim=1).transpose(0, 1)
        start += n
        if b == a:
            continue
        pos = torch.arange(n - (b - a), n, device=k.device)
        mask = torch.arange(n, device=k.device)[None, :] <= pos[:, None]
        q = case.q[a:b].float().transpose(0, 1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale)
        out[a:b] = attended.transpose(0, 1)
    return out
