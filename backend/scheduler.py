"""Continuous batching: which tokens of which sequences the next model step computes.

Each step is built under a token budget (`max_num_batched_tokens`):
1. decodes: every running sequence with one token to compute. When blocks run out, the
   newest running sequence is preempted: its blocks are freed and it goes back to the front
   of the queue to be recomputed later (the prefix cache usually makes that cheap).
2. prefills. With chunked prefill the oldest prefill first gets up to
   `long_prefill_token_threshold` tokens (so a stream of short prompts cannot starve a long
   one); the rest of the budget then goes shortest-remaining-first, counting only the tokens
   the prefix cache does not hold: short prompts and cache hits are not held up behind a
   long cold prompt, and prompts of equal length finish one after another instead of all
   sharing every step and all finishing late. Without chunked prefill, prompts are taken
   whole in arrival order (one that exceeds the budget runs as the only prefill of its step).

Prefill/decode disaggregation (backend/kv_transfer.py): a sequence that asks for its KV to
be handed over (`kv_hold`, a transfer id) keeps its blocks when it ends: they stay in `held`
until `release`. A sequence that arrives with its prompt's KV already written
(`add_prefilled`) joins the running batch with all but its last prompt token computed, so
its first step is that one token, scheduled as a decode, which samples its first output.

Speculative decoding (backend/spec_decode.py): a decode may carry a draft, its guessed next
tokens; it then computes 1 + len(draft) tokens in the step and `update` keeps the accepted
ones. The draft's blocks are taken only from blocks nobody else needs this step (a draft never
preempts a sequence), and the blocks of rejected tokens are given back at once.

Where every token costs the same compute (a CPU: no idle units to fill), packing more
prefill into a step that already finishes one prompt only delays that prompt's first token.
With `step_overhead_tokens` set (a step's fixed cost in tokens of compute: ~30 for the demo
model on one core), a prompt that would finish in this step is added only while what it
saves the prompts still waiting (one more step's fixed content each: that overhead, the
decodes and the oldest prefill's guaranteed chunk) outweighs the delay it adds to those
already finishing here; partial chunks are not added after a finishing prompt. 0 (GPUs,
where a fuller step costs little more) always fills the budget.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.sampling import stop_token_reason
from prefixgate.backend.sequence import Sequence, SequenceStatus
from prefixgate.backend.spec_decode import Speculator


@dataclass
class SchedulerConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0      # 0: a quarter of max_num_batched_tokens
    step_overhead_tokens: int = 0              # 0: fill every step; see the module doc

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.long_prefill_token_threshold <= 0:
            self.long_prefill_token_threshold = max(1, self.max_num_batched_tokens // 4)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]           # a drafted decode: 1 + its draft's length
    drafts: list[list[int]]             # per sequence, the draft tokens it computes after its own

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    @property
    def is_decoding(self) -> bool:
        """Only decodes (drafted or not): no prompt chunk in this step."""
        return all(n == 1 + len(d) for n, d in zip(self.num_new_tokens, self.drafts))

    def samples(self, i: int) -> bool:
        """Whether sequence i's chunk reaches its last token, so the step samples a new one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == len(seq) + len(self.drafts[i])


class _InFlightBlocks:
    """Prompt blocks that admitted sequences are computing now (by prefix-cache hash).

    A queued prompt whose next uncached block is among them waits a step or a few: admitted
    now, it would compute the same prefix a second time; once its twin has computed those
    blocks they are cached and it only computes the rest. (A burst of requests with a new
    system prompt otherwise computes that prompt once per request.)"""

    def __init__(self, bm: BlockManager, running: list[Sequence]):
        self.bm = bm
        self.hashes: set[int] = set()
        self.cached_tokens: dict[Sequence, int] = {}    # of the queued prompts looked at
        if bm.enable_prefix_caching:
            for seq in running:
                if seq.num_uncomputed_tokens > 1:       # still prefilling
                    self.hashes.update(seq.block_hashes[seq.num_computed_tokens // bm.block_size:])

    def wait(self, seq: Sequence) -> bool:
        """Whether `seq` should wait for a twin; if not, its blocks count as in flight."""
        match = self.bm.match_prefix(seq)               # also hashes seq's full blocks
        i = match.num_blocks                            # the second KV tier's hits count too
        self.cached_tokens[seq] = match.num_tokens
        if not self.bm.enable_prefix_caching:
            return False
        if i < len(seq.block_hashes) and seq.block_hashes[i] in self.hashes:
            return True
        self.hashes.update(seq.block_hashes[i:])
        return False


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: set[int] | frozenset[int] = frozenset(),
                 speculator: Speculator | None = None):
        self.config = config
        self.bm = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.held: dict[str, Sequence] = {}     # transfer id -> a finished sequence holding its KV
        self.num_held_blocks = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A sequence whose blocks (allocated) already hold its prompt's KV: only the last prompt
        token is left to compute, as vLLM does after a remote prefill (that step gives the
        logits)."""
        seq.num_computed_tokens = len(seq) - 1
        self.bm.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def release(self, transfer_id: str) -> None:
        """Free the blocks a finished sequence held for a KV transfer (no-op if none)."""
        seq = self.held.pop(transfer_id, None)
        if seq is not None:
            self.num_held_blocks -= len(seq.block_table)
            self.bm.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        chunks: dict[Sequence, int] = {}
        drafts: dict[Sequence, list[int]] = {}
        budget = self._schedule_decodes(chunks, drafts, budget)
        if self.config.enable_chunked_prefill:
            self._schedule_chunks(chunks, budget)
        else:
            self._schedule_whole_prompts(chunks, budget)
        if not chunks:
            return None
        now = time.monotonic()
        for seq in chunks:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
        return ScheduledBatch(list(chunks), list(chunks.values()),
                              [drafts.get(s, []) for s in chunks])

    def _schedule_decodes(self, chunks: dict[Sequence, int], drafts: dict[Sequence, list[int]],
                          budget: int) -> int:
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        for i, seq in enumerate(decoding):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue        # preempted a moment ago
            # A draft gets only the budget that the decodes after this one do not need (one
            # token each), as it gets only spare blocks: else early sequences' drafts could
            # fill a small budget step after step and leave later decodes waiting.
            draft = self._draft(seq, len(decoding), budget - (len(decoding) - i - 1))
            while not self.bm.allocate(seq, seq.num_computed_tokens + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks[seq] = 1 + len(draft)
                budget -= 1 + len(draft)
                if draft:
                    drafts[seq] = draft
        return budget

    def _draft(self, seq: Sequence, batch_size: int, budget: int) -> list[int]:
        """`seq`'s draft, with its blocks taken, if there is one and room for it: no more
        tokens than max_tokens, the context and the budget leave, and blocks to spare."""
        if self.speculator is None or budget < 2:
            return []
        room = min(budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - len(seq) - 1)
        draft = self.speculator.draft(seq, batch_size, room)
        if not draft:
            return []
        spare = self.bm.num_free_blocks - batch_size      # a block for every decode first
        need = self.bm.blocks_needed(len(seq) + len(draft)) - len(seq.block_table)
        if need > spare or not self.bm.allocate(seq, len(seq) + len(draft)):
            return []
        return draft

    def _schedule_chunks(self, chunks: dict[Sequence, int], budget: int) -> None:
        """Chunked prefill: share out the budget (see the module doc), then take blocks in
        arrival order; the first sequence that cannot get its blocks ends the pass."""
        seats = max(self.config.max_num_seqs - len(self.running), 0)
        candidates = [s for s in self.running if s not in chunks]
        twins = _InFlightBlocks(self.bm, self.running)
        candidates += [s for s in itertools.islice(self.waiting, seats) if not twins.wait(s)]
        if not candidates or budget <= 0:
            return
        left = {s: s.num_uncomputed_tokens if s.status is SequenceStatus.RUNNING
                else len(s) - twins.cached_tokens[s] for s in candidates}
        grant = dict.fromkeys(candidates, 0)
        oldest = candidates[0]
        grant[oldest] = min(left[oldest], self.config.long_prefill_token_threshold, budget)
        budget -= grant[oldest]
        finishing = int(grant[oldest] == left[oldest])
        fixed = self._fixed_tokens(sum(chunks.values()) + (0 if finishing else grant[oldest]))
        order = sorted(candidates, key=lambda s: left[s] - grant[s])   # stable: ties FCFS
        for i, seq in enumerate(order):
            need = left[seq] - grant[seq]
            if budget <= 0:
                break
            if need == 0:
                continue
            extra = min(need, budget)
            if finishing and not self._worth_adding(extra, need, finishing, len(order) - i, fixed):
                break
            grant[seq] += extra
            budget -= extra
            finishing += extra == need
        for seq in candidates:
            n = grant[seq]
            if n and not self._take_blocks(seq, n):
                return
            if n:
                chunks[seq] = n

    def _fixed_tokens(self, repeated: int) -> int:
        """A step's fixed content in tokens: the overhead plus `repeated` tokens every step
        carries anyway (decodes, the oldest prefill's chunk); 0 when steps are filled."""
        k = self.config.step_overhead_tokens
        return k + repeated if k > 0 else 0

    @staticmethod
    def _worth_adding(extra: int, need: int, finishing: int, waiting: int, fixed: int) -> bool:
        """Whether `extra` more prefill tokens belong in a step where `finishing` prompts get
        their first token: yes if they finish a prompt and the step saved for the `waiting`
        prompts (this one included) outweighs the delay to those finishing."""
        return fixed <= 0 or (extra == need and extra * finishing <= fixed * waiting)

    def _take_blocks(self, seq: Sequence, n: int) -> bool:
        """Blocks for the next `n` tokens of `seq`; a waiting sequence is admitted with its
        cached prefix (matched again here: blocks taken a moment ago may have evicted some)."""
        if seq.status is SequenceStatus.RUNNING:
            return self.bm.allocate(seq, seq.num_computed_tokens + n)
        match = self.bm.match_prefix(seq)
        # a tier block that fails its checksum leaves fewer tokens computed than matched: the
        # chunk then ends short of the prompt's end and the rest follows next step
        if not self.bm.allocate(seq, match.num_tokens + n, match):
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _schedule_whole_prompts(self, chunks: dict[Sequence, int], budget: int) -> None:
        """No chunked prefill: partly computed prompts (after a preemption) and queued ones
        are taken whole, in arrival order."""
        for seq in self.running:
            if budget <= 0:
                return
            if seq in chunks:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                return
            chunks[seq] = n
            budget -= n
        num_prefills = len(chunks)
        fixed = self._fixed_tokens(sum(chunks.values()))
        twins = _InFlightBlocks(self.bm, self.running)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if twins.wait(seq):
                break       # the next step finds its prefix cached
            match = self.bm.match_prefix(seq)
            remaining = len(seq) - match.num_tokens
            if remaining > budget and len(chunks) > num_prefills:
                # whole prompts only; an oversize one waits to be the step's only prefill
                break
            taken = len(chunks) - num_prefills
            if taken and not self._worth_adding(remaining, remaining, taken, len(self.waiting),
                                                fixed):
                break
            if not self.bm.allocate(seq, match.num_tokens + remaining, match):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks[seq] = remaining
            budget -= remaining

    def update(self, batch: ScheduledBatch, sampled: list[list[int]]) -> list[tuple[Sequence, int]]:
        """Record a finished step: advance computed counts, append the sampled tokens (a
        drafted decode: its accepted draft tokens and one more), stop sequences that are done.
        Returns the sequences that got new tokens, with how many."""
        out = []
        now = time.monotonic()
        for seq, n, draft, tokens in zip(batch.seqs, batch.num_new_tokens, batch.drafts, sampled):
            accepted = len(tokens) - 1 if draft else 0
            seq.num_computed_tokens += n - (len(draft) - accepted)   # rejected tokens' KV is void
            reason, added = None, 0
            for token in tokens:
                seq.append_token(token)
                added += 1
                reason = stop_token_reason(token, seq.num_output_tokens, seq.params,
                                           self.eos_token_ids)
                if reason is None and len(seq) >= self.config.max_model_len:
                    reason = "length"
                if reason is not None:
                    break       # tokens accepted past a stop are never generated
            seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq))
            self.bm.cache_full_blocks(seq)
            if draft:
                self.bm.truncate(seq, len(seq))
                self.speculator.record(seq, len(draft), accepted)
            if not added:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            if reason is not None:
                self.finish(seq, reason)
            out.append((seq, added))
        return out

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (done, stop string, or aborted) and free its blocks (or hold them)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.kv_hold is not None and reason != "abort":
            self.held[seq.kv_hold] = seq        # its blocks stay referenced until release()
            self.num_held_blocks += len(seq.block_table)
        else:
            self.bm.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
