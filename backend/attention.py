"""Paged attention as the model layers see it: one metadata object per step, one call per layer.

The model never knows how the KV cache is laid out beyond "write these slots, then attend over
these block tables"; the kernels (Triton on CUDA, plain PyTorch on CPU) live in
`prefixgate.kernels` and are chosen by `AttentionMetadata.attention_backend`. On a CPU with the
compiled operators loaded, the default backend writes the cache, decodes and (fp32) attends a
prompt's rows through backend/cpu_ops.py, which reads the paged cache in place ("torch" still
forces the reference).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch

from prefixgate import kernels
from prefixgate.backend import cpu_ops


@dataclass
class AttentionMetadata:
    """Describes one forward step over a flattened batch of T new tokens from S sequences."""

    slot_mapping: torch.Tensor  # [T] flat KV slot (block * block_size + offset) of each new token
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [S] int32: tokens in cache after this step, new ones included
    query_start_loc: torch.Tensor  # [S + 1] int32: offsets of each sequence's new tokens
    max_seq_len: int
    is_decode: bool  # every sequence has exactly one new token
    attention_backend: str | None = None  # "triton", "torch", or None = auto by device
    # a fault injector for the quality gate's tests (`--debug-kv-mantissa-bits`), None = off
    kv_mantissa_bits: int | None = None

    @cached_property
    def decodes_apart(self) -> DecodesApart | None:
        """This prefill step's one-token sequences (decodes riding along with a prompt's chunk)
        apart from the others; None when it has none. Worked out once per step, not per layer."""
        starts = self.query_start_loc.tolist()
        single = [s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] == 1]
        if not single:
            return None
        rest = [s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > 1]
        return DecodesApart(self, single, rest, starts)


class DecodesApart:
    """Rows, block tables and lengths of a mixed step's one-token sequences (`decode_*`) and of
    the rest (`prefill_*`, None without any)."""

    def __init__(self, meta: AttentionMetadata, single: list[int], rest: list[int],
                 starts: list[int]):
        device = meta.seq_lens.device
        self.decode_rows = _rows([starts[s] for s in single], device)
        index = torch.tensor(single, device=device)
        self.decode_tables = meta.block_tables.index_select(0, index)
        self.decode_lens = meta.seq_lens.index_select(0, index)
        self.prefill_rows = None
        if rest:
            rows = [r for s in rest for r in range(starts[s], starts[s + 1])]
            self.prefill_rows = _rows(rows, device)
            index = torch.tensor(rest, device=device)
            self.prefill_tables = meta.block_tables.index_select(0, index)
            self.prefill_lens = meta.seq_lens.index_select(0, index)
            lens = [starts[s + 1] - starts[s] for s in rest]
            self.prefill_starts = torch.tensor([0, *itertools.accumulate(lens)],
                                               dtype=torch.int32, device=device)


def _rows(rows: list[int], device) -> slice | torch.Tensor:
    """Row indices as a slice where they are consecutive (a view, no copy), else a tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [num_blocks, block_size, kv_heads, dim]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store the new keys/values in the paged cache, then attend over everything cached."""
    k_cache, v_cache = kv_cache
    backend = meta.attention_backend
    if meta.kv_mantissa_bits is not None:
        k, v = round_mantissa(k, meta.kv_mantissa_bits), round_mantissa(v, meta.kv_mantissa_bits)
    if backend in (None, "auto") and cpu_ops.writes_kv(k, k_cache):
        cpu_ops.write_kv_(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        kernels.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=backend)
    if meta.is_decode:
        if backend in (None, "auto") and cpu_ops.decodes_in_place(q, k_cache):
            return cpu_ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                  meta.seq_lens, scale)
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, backend=backend
        )
    if backend in (None, "auto") and cpu_ops.decodes_in_place(q, k_cache) and meta.decodes_apart:
        return _mixed_on_cpu(q, k_cache, v_cache, meta.decodes_apart, scale)
    return _prefill(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                    scale, backend)


def _prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
             backend: str | None) -> torch.Tensor:
    """Prompt rows' attention: on a CPU with the compiled operators (fp32) read in place from
    the paged cache (cpu_ops), else the kernels' reference or Triton."""
    if backend in (None, "auto") and cpu_ops.prefills_in_place(q, k_cache):
        return cpu_ops.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                               query_start_loc, scale)
    return kernels.paged_prefill_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                           query_start_loc, scale, backend=backend)


def _mixed_on_cpu(q, k_cache, v_cache, apart: DecodesApart, scale: float) -> torch.Tensor:
    """A mixed step on a CPU: its decodes read the paged cache in place (cpu_ops), as a decode
    step's do, instead of riding in the prefill reference, which gathers each one's whole
    cache into a new tensor for SDPA's one-query path (10% of an engine's time under vLLM's
    `random` load, 1,024-token prompts in 512-token chunks); the prompts' rows go to the
    prefill kernel as before."""
    out = torch.empty_like(q)
    out[apart.decode_rows] = cpu_ops.paged_decode_attention(
        q[apart.decode_rows], k_cache, v_cache, apart.decode_tables, apart.decode_lens, scale)
    if apart.prefill_rows is not None:
        out[apart.prefill_rows] = _prefill(
            q[apart.prefill_rows], k_cache, v_cache, apart.prefill_tables, apart.prefill_lens,
            apart.prefill_starts, scale, None)
    return out


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """`x` rounded to `bits` explicit mantissa bits (exponent kept): a deliberate loss of
    precision, below FP8 e4m3's 3 bits when `bits` < 3. Test-only: the planted numeric fault
    that `prefixgate bench --scenario quality` must catch (never on unless asked for)."""
    mantissa, exponent = torch.frexp(x.float())        # mantissa in [0.5, 1)
    steps = float(2 ** (bits + 1))
    return torch.ldexp(torch.round(mantissa * steps) / steps, exponent).to(x.dtype)
