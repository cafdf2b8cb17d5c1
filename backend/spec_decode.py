"""Prompt-lookup (n-gram) speculative decoding: the drafts, and when not to draft.

A decoding sequence whose last tokens (an n-gram of `prompt_lookup_min`..`prompt_lookup_max`
tokens) occurred earlier in its prompt or output is guessed to go on as it went on then: the
up to `num_speculative_tokens` tokens that followed that occurrence are its draft. The
scheduler gives the draft to the model with the sequence's last token, one forward pass over
the paged KV verifies every draft of the batch (`sampling.verify`), and the longest accepted
prefix plus one token of the target's own are kept. No extra model, nothing to load; it pays
where answers quote their inputs (RAG, code edits, agents re-reading tool output) or loop.

A draft costs compute whether or not it is accepted, so it is skipped (the step decodes plainly)
- for every sequence while more than `disable_by_batch_size` sequences decode (vLLM's key);
- for a sequence whose recent acceptance rate (a moving average of accepted/drafted, per draft)
  is under the bar: `min_acceptance_rate`, or this machine's break-even rate at this batch size
  if higher. A draft token lengthens the whole batch's step, and wins a token only if accepted.
  The engine times its decode steps and fits step time = a + c * tokens (`StepCost`, recent
  steps weigh most): with B decodes a draft token costs c / (a + c * B) of a step that yields B
  tokens, so drafts pay above an acceptance rate of B * c / (a + c * B). On the 2-core CPU of
  docs/engine.md's figures that is ~0.05 at batch 1, ~0.45 at batch 16; on a GPU, where a small
  batch's step costs about the same whatever its tokens, it stays near 0 until the batch fills it.
  A sequence's first draft is a probe (its average starts at the bar). Under the bar, the
  sequence skips its next 4 drafts (it finds the n-gram but does not draft), twice as many each
  time it fails again, then one draft probes whether its text has started quoting. Drafts, not
  steps: in free text matches are rare, and a pause counted in steps would end before the next.
The config (`--speculative-config`, `SpeculativeConfig`) and its defaults are in
backend/config.py; they come from `python -m prefixgate.backend.bench.speculative --sweep`
(docs/engine.md: "Measured: speculative decoding").
"""
from __future__ import annotations

from prefixgate.backend.config import SpeculativeConfig

_RATE_WEIGHT = 0.5              # the newest draft's share of the moving average
_FIRST_PAUSE, _MAX_PAUSE = 4, 256   # drafts a sequence skips after failing
_MAX_CANDIDATES = 64            # earlier occurrences of the n-gram examined per draft
_COST_DECAY = 0.995             # per step: the cost fit remembers ~200 recent decode steps
_COST_MIN_STEPS = 8.0           # weight of steps seen before the fit is trusted
_COST_MAX_RISE = 1.25           # a step counts at most this times what the standing fit predicts


class NgramIndex:
    """Where each `n`-gram of one sequence's tokens ended, filled in as tokens arrive."""

    def __init__(self, n: int):
        self.n = n
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0                # n-grams ending before this position are in `ends`

    def extend(self, tokens: list[int], upto: int) -> None:
        n = self.n
        for end in range(max(self.indexed, n - 1), upto):
            self.ends.setdefault(tuple(tokens[end - n + 1:end + 1]), []).append(end)
        self.indexed = max(self.indexed, upto)


def propose(tokens: list[int], index: NgramIndex, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the latest, longest earlier occurrence of the sequence's
    suffix n-gram ([index.n, max_n] tokens); [] when it never occurred."""
    last = len(tokens) - 1
    index.extend(tokens, last)          # every n-gram but the suffix itself
    min_n = index.n
    if last + 1 < min_n:
        return []
    ends = index.ends.get(tuple(tokens[last + 1 - min_n:]))
    if not ends:
        return []
    best, best_len = -1, 0
    for end in reversed(ends[-_MAX_CANDIDATES:]):
        n = min_n
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[last - n]:
            n += 1
        if n > best_len:
            best, best_len = end, n
            if n == max_n:
                break
    # The tokens after the match; where they run into the suffix itself, the copy continues
    # from what it has already proposed (a loop of period p drafts k tokens, not p).
    draft: list[int] = []
    for i in range(k):
        src = best + 1 + i
        draft.append(tokens[src] if src <= last else draft[src - last - 1])
    return draft


class StepCost:
    """Decode step time as a + c * tokens, fitted by least squares over recent steps (each
    step's weight decays by `_COST_DECAY` per newer one): what a draft token costs.

    Once the fit stands, a step counts at most 1.25 times the time it predicts: steps stalled by
    another process (10x their time on a busy CPU, often several in a row) must not flip the
    fit; stalls only ever slow steps, so faster ones count in full, and a real rise of cost
    still moves the fit, a little per step."""

    def __init__(self):
        self.sums = [0.0] * 5           # weighted sums of 1, n, t, n*n, n*t

    def observe(self, num_tokens: int, seconds: float) -> None:
        n, t = float(num_tokens), seconds
        fit = self.fit()
        if fit is not None and (predicted := fit[0] + fit[1] * n) > 0:
            t = min(t, predicted * _COST_MAX_RISE)
        self.sums = [s * _COST_DECAY + x for s, x in zip(self.sums, (1.0, n, t, n * n, n * t))]

    def fit(self) -> tuple[float, float] | None:
        """(a, c): seconds per step and per token; None until steps of different sizes
        have been seen."""
        w, n, t, nn, nt = self.sums
        spread = w * nn - n * n
        if w < _COST_MIN_STEPS or spread <= 1e-9 * w * w:
            return None
        c = (w * nt - n * t) / spread
        return (t - c * n) / w, c

    def break_even(self, batch_size: int) -> float:
        """The acceptance rate above which a draft pays in a batch of `batch_size` decodes
        (0 while there is no fit)."""
        fit = self.fit()
        if fit is None or fit[1] <= 0:
            return 0.0                  # no fit yet, or more tokens cost nothing measurable
        a, c = max(fit[0], 0.0), fit[1]
        return batch_size * c / (a + c * batch_size)


class _SeqState:
    """One sequence's n-gram index and its recent acceptance."""
    __slots__ = ("index", "rate", "bar", "pause", "skip")

    def __init__(self, n: int):
        self.index = NgramIndex(n)
        self.rate: float | None = None  # moving average of accepted / drafted; None: no draft yet
        self.bar = 0.0                  # the rate its last draft had to reach
        self.pause = _FIRST_PAUSE       # drafts to skip after the next failure
        self.skip = 0                   # drafts left to skip now


class Speculator:
    """Drafts for the scheduler, acceptance bookkeeping for the metrics (vLLM's counters)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.cost = StepCost()          # fed by the engine with its decode steps' times
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def bar(self, batch_size: int) -> float:
        """The acceptance rate a draft must reach in a batch of `batch_size` decodes."""
        return max(self.config.min_acceptance_rate, self.cost.break_even(batch_size))

    def draft(self, seq, batch_size: int, room: int) -> list[int]:
        """The draft for `seq`'s next step in a batch of `batch_size` decodes; at most `room`
        tokens (what its max_tokens, the context and the step's budget leave)."""
        cfg = self.config
        cap = cfg.disable_by_batch_size
        if room < 1 or (cap is not None and batch_size > cap):
            return []
        state = seq.spec
        if state is None:
            state = seq.spec = _SeqState(cfg.prompt_lookup_min)
        draft = propose(seq.token_ids, state.index, cfg.prompt_lookup_max,
                        min(room, cfg.num_speculative_tokens))
        if not draft:
            return []
        if state.skip:
            state.skip -= 1
            return []
        state.bar = self.bar(batch_size)
        if state.rate is None:
            state.rate = state.bar      # the first draft is a probe
        elif state.rate < state.bar:    # the batch grew since its last draft: no longer pays
            self._pause(state)
            return []
        return draft

    def record(self, seq, num_drafted: int, num_accepted: int) -> None:
        """A verified draft: count it, and pause a sequence whose drafts keep failing."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        state = seq.spec
        state.rate += _RATE_WEIGHT * (num_accepted / num_drafted - state.rate)
        if state.rate >= state.bar:
            state.pause = _FIRST_PAUSE
        else:
            self._pause(state)

    @staticmethod
    def _pause(state: _SeqState) -> None:
        state.skip = state.pause
        state.pause = min(state.pause * 2, _MAX_PAUSE)
        state.rate = state.bar          # the probe after the pause decides
