"""Warm-up before ready: every shape the engine serves runs once, and leaves no trace.

Otherwise the first requests after start-up pay for what happens only once: weight pages
faulting in (`--load-format mmap`), the allocator growing to its working set, libraries
starting their thread pools, and on CUDA the Triton kernels compiling (the prefill kernel
takes the number of sequences as a compile-time constant, so each batch size is a kernel of
its own) and the first replay of each CUDA graph. `warm_up(engine)` runs on the engine's
thread before its step loop takes requests (the server answers 503 until then):

  * at each batch size, a prefill of that many short prompts, then one decode step of them
    all (on CUDA that step replays the graph captured for the size); the last row samples
    with temperature, top-p and top-k from its own seeded generator, so the random-sampling
    kernels run too and the global RNG is left alone;
  * one full `max_num_batched_tokens` chunk over a prefix already in the paged KV cache
    (PREFIX_BLOCKS blocks): the attention a prefix-cache hit or a long prompt's next chunk takes.

Batch sizes: with CUDA graphs, the captured sizes; on CUDA without them, the same list
(`default_batch_sizes`: 1, 2, 4, then every multiple of 8 up to max_num_seqs). On CPU only
the smallest and the largest: CPU kernels are neither compiled nor captured per shape, so
what wants warming (weight pages, thread pools, the allocator's largest buffers) is warm
after those two. With the demo model on two cores the whole list takes 1.4 s against 0.45 s,
and a second run of it takes as long as the first: the other sizes are plain compute, with
nothing to warm.

No trace: the model runner is driven directly, not through the scheduler, so no preemption
is counted, no step-cost sample reaches the speculator and no output reaches the metrics;
the blocks are freed without ever entering the prefix cache (no hash, so no prefix hit and
no KV event can come of them), and the block manager's prefix counters are put back.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prefixgate.backend.cuda_graphs import default_batch_sizes
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.scheduler import ScheduledBatch
from prefixgate.backend.sequence import Sequence

log = logging.getLogger("prefixgate.engine")

PROMPT_TOKENS = 8            # per warm-up prompt at each batch size (fewer if the budget is small)
PREFIX_BLOCKS = 4            # the cached prefix under the full chunk (see _chunk_over_prefix)
FIRST_TOKEN_ID = 16          # warm-up prompts skip the lowest ids, where special tokens live
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
RANDOM = SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, top_k=8, seed=0)


class WarmupError(RuntimeError):
    """The warm-up failed: the engine could not serve the shapes it is configured for."""


@dataclass
class WarmupReport:
    seconds: float
    batch_sizes: list[int]      # those that ran (a size whose blocks do not fit is skipped)
    chunk_tokens: int
    prefix_tokens: int

    def __str__(self) -> str:
        return (f"warm-up took {self.seconds:.2f} s: prefill and decode at batch sizes "
                f"{', '.join(map(str, self.batch_sizes))}; a {self.chunk_tokens}-token chunk "
                f"over a {self.prefix_tokens}-token cached prefix")


def warm_up(engine) -> WarmupReport:
    """Run the warm-up on `engine` (an idle LLMEngine, on its own thread) and log one line."""
    started = time.perf_counter()
    bm = engine.block_manager
    counters = bm.prefix_queries, bm.prefix_hits
    try:
        sizes = [b for b in warmup_batch_sizes(engine) if _prefill_and_decode(engine, b)]
        chunk, prefix = _chunk_over_prefix(engine)
    finally:
        bm.prefix_queries, bm.prefix_hits = counters
    report = WarmupReport(time.perf_counter() - started, sizes, chunk, prefix)
    log.info("%s", report)
    return report


def warmup_batch_sizes(engine) -> list[int]:
    """The batch sizes to warm (see the module doc)."""
    if engine.runner.graphs is not None:
        return list(engine.runner.graphs.batch_sizes)
    sizes = default_batch_sizes(engine.scheduler.config.max_num_seqs)
    return sizes if engine.device.type == "cuda" else sorted({sizes[0], sizes[-1]})


def _prefill_and_decode(engine, b: int) -> bool:
    """A prefill of `b` short prompts, then a decode of all `b`; False if the blocks are short."""
    bm = engine.block_manager
    budget = engine.scheduler.config.max_num_batched_tokens
    n = max(2, min(PROMPT_TOKENS, budget // b))     # 2: a 1-token prefill would be a decode
    seqs = [Sequence(_prompt(engine, i * n, n), RANDOM if i == b - 1 else GREEDY) for i in range(b)]
    try:
        # blocks for the decode's token too; a KV cache too small for them all skips the size
        if n + 1 > engine.max_model_len or not all(bm.allocate(seq, n + 1) for seq in seqs):
            log.debug("warm-up: batch size %d skipped (too few KV blocks)", b)
            return False
        sampled = _run(engine, seqs, [n] * b)
        for seq, tokens in zip(seqs, sampled):
            seq.num_computed_tokens = n
            seq.append_token(tokens[0])
        _run(engine, seqs, [1] * b)
    finally:
        for seq in seqs:
            bm.free(seq)
    return True


def _chunk_over_prefix(engine) -> tuple[int, int]:
    """A full-budget chunk whose attention reads a prefix from the paged cache; (chunk, prefix).
    A few blocks of prefix take the chunk down the paged path; a longer one would only add
    compute (on CPU, seconds with a large budget), the kernels being the same."""
    bm = engine.block_manager
    room = min(engine.max_model_len - 1, bm.num_free_blocks * bm.block_size)
    prefix = min(PREFIX_BLOCKS * bm.block_size, room // 2) // bm.block_size * bm.block_size
    chunk = min(engine.scheduler.config.max_num_batched_tokens, room - prefix)
    if chunk < 2:
        return 0, 0
    seq = Sequence(_prompt(engine, 0, prefix + chunk), GREEDY)
    try:
        if not bm.allocate(seq, prefix + chunk):    # `room` counted free blocks: it fits
            raise WarmupError(f"no KV blocks for {prefix + chunk} tokens")
        if prefix:
            _run(engine, [seq], [prefix])   # falls short of the end: computes KV, samples nothing
            seq.num_computed_tokens = prefix
        _run(engine, [seq], [chunk])
    finally:
        bm.free(seq)
    return chunk, prefix


def _prompt(engine, start: int, n: int) -> list[int]:
    span = engine.model_config.vocab_size - FIRST_TOKEN_ID
    return [FIRST_TOKEN_ID + (start + i) % span for i in range(n)]


def _run(engine, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
    return engine.runner.run(ScheduledBatch(seqs, num_tokens, [[] for _ in seqs]))
