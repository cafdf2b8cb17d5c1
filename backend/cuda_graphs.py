"""Decode steps replayed from CUDA graphs, one graph per batch size.

API (used by backend/model_runner.py):

    graphs = DecodeGraphRunner(model, kv_caches, block_size=16, max_num_seqs=64,
                               max_blocks_per_seq=W, attention_backend=None, batch_sizes=None)
    if graphs.can_run(meta):                 # decode step, batch and block table fit
        hidden = graphs.run(input_ids, positions, meta)   # [num_seqs, hidden_size]

A decode step launches a few hundred small kernels whose Python launch cost dominates at small
batch; a graph replays them all in one call. Graphs are captured at start-up for `batch_sizes`
(default 1, 2, 4 then every multiple of 8 up to max_num_seqs) over static input buffers; a step
copies its inputs into the buffers, pads the batch up to the next captured size and replays.
Padding rows write no KV (slot -1) and attend to nothing (seq_len 0), so they cost little and
touch no real sequence. The returned hidden states are a view of the graph's output buffer,
valid until the next `run`.

Needs the Triton kernels: their launch grids depend only on static shapes (the decode split
count comes from the block-table width, not from the step's longest context), whereas the
PyTorch reference reads sequence lengths on the host, which capture forbids.
"""
from __future__ import annotations

import torch

from prefixgate.backend.attention import AttentionMetadata


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = ({b for b in (1, 2, 4) if b <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8))
             | {max_num_seqs})
    return sorted(sizes)


class DecodeGraphRunner:
    def __init__(self, model, kv_caches, *, block_size: int, max_num_seqs: int,
                 max_blocks_per_seq: int, attention_backend: str | None = None,
                 batch_sizes: list[int] | None = None):
        if attention_backend == "torch":
            raise ValueError("CUDA graphs need the Triton attention kernels "
                             "(attention_backend torch syncs the host)")
        device = kv_caches[0][0].device
        if device.type != "cuda":
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.batch_sizes = sorted(batch_sizes or default_batch_sizes(max_num_seqs))
        n, w = self.batch_sizes[-1], max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:b],
                                 block_tables=self.block_tables[:b],
                                 seq_lens=self.seq_lens[:b],
                                 query_start_loc=self.query_start_loc[:b + 1],
                                 max_seq_len=self.block_tables.shape[1] * self.block_size,
                                 is_decode=True, attention_backend="triton")

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        # Largest first: smaller graphs then fit inside the memory pool the largest one reserved.
        for b in reversed(self.batch_sizes):
            args = (self.input_ids[:b], self.positions[:b], self._meta(b), self.kv_caches)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # warm-up compiles the Triton kernels outside capture
                self.model(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def can_run(self, meta_or_num_seqs) -> bool:
        if isinstance(meta_or_num_seqs, int):
            return meta_or_num_seqs <= self.batch_sizes[-1]
        meta = meta_or_num_seqs
        return (meta.is_decode and meta.attention_backend != "torch"
                and meta.seq_lens.shape[0] <= self.batch_sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        n = input_ids.shape[0]
        b = next(s for s in self.batch_sizes if s >= n)
        w = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:b].fill_(0)
        # Columns past w keep stale ids: the kernels read only pages below each seq_len.
        self.block_tables[:n, :w].copy_(meta.block_tables)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
