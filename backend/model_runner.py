"""Runs one scheduled batch through the model: batch tensors in, sampled tokens out.

Owns the paged KV cache: per layer a (k_cache, v_cache) pair shaped
[num_blocks, block_size, num_kv_heads, head_dim]. The batch is flattened (every new token of
every sequence, no padding); logits are computed only for the last token of the sequences
whose chunk reaches their end, and for each draft token of a drafted decode (its verification,
`sampling.verify`). On CUDA, decode steps can replay captured CUDA graphs
(`prefixgate.backend.cuda_graphs`) instead of launching every kernel from Python.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import re

import torch

from prefixgate.backend.attention import AttentionMetadata
from prefixgate.backend.config import KV_CACHE_TORCH_DTYPES
from prefixgate.backend.sampling import sample, verify
from prefixgate.backend.scheduler import ScheduledBatch

log = logging.getLogger("prefixgate.engine")

# --kv-cache-dtype's names (backend/config.py) as torch dtypes; None (auto): the model's
KV_CACHE_DTYPES = {name: None if attr is None else getattr(torch, attr)
                   for name, attr in KV_CACHE_TORCH_DTYPES.items()}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '512MB', '1e9'-free plain integers -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (examples: 2GiB, 512MB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_host_memory() -> bool:
    """Make glibc keep the memory a CPU step frees for the next step instead of handing it back.

    A prefill step allocates and frees tens of MB of activations; by default glibc returns
    freed memory at the top of its heaps to the OS (and serves large blocks with fresh mmaps),
    so the next step page-faults it all in again: measured 20-35k faults, ~15% of a 512-token
    step of the demo model. Large trim and mmap thresholds keep it resident (at most ~1 GiB more
    held; the KV cache is allocated once and unaffected). No-op without glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))


def kv_block_bytes(model_config, block_size: int, kv_dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return (2 * model_config.num_hidden_layers * block_size * model_config.num_key_value_heads
            * model_config.head_dim * elem)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config, *, block_size: int, num_blocks: int,
                 kv_cache_dtype: torch.dtype, attention_backend: str | None = None,
                 use_cuda_graphs: bool = True, max_num_seqs: int = 64,
                 max_model_len: int | None = None, kv_mantissa_bits: int | None = None):
        self.model = model
        self.config = model_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self.attention_backend = None if attention_backend in (None, "auto") else attention_backend
        # test-only fault injector (--debug-kv-mantissa-bits): stored K/V lose precision
        self.kv_mantissa_bits = kv_mantissa_bits
        shape = (num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=kv_cache_dtype, device=self.device),
                           torch.zeros(shape, dtype=kv_cache_dtype, device=self.device))
                          for _ in range(model_config.num_hidden_layers)]
        self.graphs = None
        if use_cuda_graphs and self.device.type == "cuda" and kv_mantissa_bits is None:
            max_blocks = -(-(max_model_len or num_blocks * block_size) // block_size)
            self.graphs = _load_graph_runner(self, max_num_seqs, min(max_blocks, num_blocks))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[list[int]]:
        """Compute the batch; per sequence the tokens it samples: none while its prompt's chunk
        falls short of the end, else one (a drafted decode: its accepted draft and one more)."""
        input_ids, positions, meta, last_rows = self.prepare(batch)
        if self.graphs is not None and meta.is_decode and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        sampling = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        out: list[list[int]] = [[] for _ in batch.seqs]
        if not sampling:
            return out
        # a drafted sequence needs the rows of its last token and of each draft token
        rows = [r for i in sampling
                for r in range(last_rows[i] - len(batch.drafts[i]), last_rows[i] + 1)]
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        seqs = [batch.seqs[i] for i in sampling]
        for s in seqs:
            if s.params.seed is not None and s.generator is None:
                s.generator = s.params.make_generator(self.device)
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        drafts = [batch.drafts[i] for i in sampling]
        if any(drafts):
            tokens = verify(logits, drafts, params, generators)
        else:
            tokens = [[t] for t in sample(logits, params, generators)]
        for i, toks in zip(sampling, tokens):
            out[i] = toks
        return out

    def prepare(self, batch: ScheduledBatch):
        """Flattened input ids and positions, the attention metadata, and each sequence's
        last row in the flattened batch."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        starts = [0]
        for seq, n, draft in zip(batch.seqs, batch.num_new_tokens, batch.drafts):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            ids.extend(draft)
            pos.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            starts.append(starts[-1] + n)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_seq_len=max(seq_lens),
            is_decode=batch.is_decode,
            attention_backend=self.attention_backend,
            kv_mantissa_bits=self.kv_mantissa_bits,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, meta, [e - 1 for e in starts[1:]]


def _load_graph_runner(runner: ModelRunner, max_num_seqs: int, max_blocks_per_seq: int):
    """The kernels helper's CUDA-graph decode runner, when that module is installed."""
    try:
        from prefixgate.backend import cuda_graphs
    except ImportError:
        return None
    try:
        return cuda_graphs.DecodeGraphRunner(runner.model, runner.kv_caches,
                                             block_size=runner.block_size,
                                             max_num_seqs=max_num_seqs,
                                             max_blocks_per_seq=max_blocks_per_seq,
                                             attention_backend=runner.attention_backend)
    except Exception as e:  # graphs are an optimisation: run eagerly rather than not at all
        log.warning("CUDA graphs disabled: %s", e)
        return None
