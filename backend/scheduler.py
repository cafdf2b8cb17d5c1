"""Continuous batching: which tokens of which sequences the next model step computes.

Each step is built in three passes under a token budget (`max_num_batched_tokens`):
1. decodes: every running sequence with one token to compute. When blocks run out, the
   newest running sequence is preempted: its blocks are freed and it goes back to the front
   of the queue to be recomputed later (the prefix cache usually makes that cheap).
2. prefills, in arrival order (partly prefilled running sequences, then the queue): with
   chunked prefill each gets at most `long_prefill_token_threshold` tokens in this pass, so
   one long prompt cannot hold up the short prompts queued behind it; without it, prompts
   are taken whole (one that exceeds the budget runs as the only prefill of its step).
3. leftover budget tops up the chunks from pass 2, so a lone long prompt still gets the
   whole budget.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.sampling import stop_token_reason
from prefixgate.backend.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0      # 0: a quarter of max_num_batched_tokens

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.long_prefill_token_threshold <= 0:
            self.long_prefill_token_threshold = max(1, self.max_num_batched_tokens // 4)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token, so the step samples a new one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()):
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        chunks: dict[Sequence, int] = {}
        budget = self._schedule_decodes(chunks, budget)
        budget = self._schedule_prefills(chunks, budget)
        if self.config.enable_chunked_prefill:
            self._top_up(chunks, budget)
        if not chunks:
            return None
        now = time.monotonic()
        for seq in chunks:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return ScheduledBatch(list(chunks), list(chunks.values()))

    def _schedule_decodes(self, chunks: dict[Sequence, int], budget: int) -> int:
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1:
                continue        # preempted a moment ago, or still prefilling
            while not self.bm.allocate(seq, seq.num_computed_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks[seq] = 1
                budget -= 1
        return budget

    def _schedule_prefills(self, chunks: dict[Sequence, int], budget: int) -> int:
        cfg = self.config
        cap = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else None
        for seq in self.running:
            if budget <= 0:
                return budget
            if seq in chunks:
                continue
            n = min(seq.num_uncomputed_tokens, budget, cap or budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                return budget
            chunks[seq] = n
            budget -= n
        num_prefills = len(chunks)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            cached = self.bm.match_prefix(seq)
            remaining = len(seq) - len(cached) * self.bm.block_size
            if cap is not None:
                n = min(remaining, budget, cap)
            elif remaining > budget and len(chunks) > num_prefills:
                break       # whole prompts only; an oversize one waits to be the step's only prefill
            else:
                n = remaining
            if not self.bm.allocate(seq, len(cached) * self.bm.block_size + n, cached):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks[seq] = n
            budget -= n
        return budget

    def _top_up(self, chunks: dict[Sequence, int], budget: int) -> None:
        for seq, n in chunks.items():
            if budget <= 0:
                return
            extra = min(seq.num_uncomputed_tokens - n, budget)
            if extra > 0 and self.bm.allocate(seq, seq.num_computed_tokens + n + extra):
                chunks[seq] = n + extra
                budget -= extra

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Record a finished step: advance computed counts, append the sampled tokens, stop
        sequences that are done. Returns the sequences that got a new token."""
        out = []
        now = time.monotonic()
        for seq, n, token in zip(batch.seqs, batch.num_new_tokens, sampled):
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
            if token is None:
                continue
            seq.append_token(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = stop_token_reason(token, seq.num_output_tokens, seq.params, self.eos_token_ids)
            if reason is None and len(seq) >= self.config.max_model_len:
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
            out.append(seq)
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, stop string, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.bm.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
