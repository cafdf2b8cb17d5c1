"""Prompt-lookup (n-gram) speculative decoding: the config, the drafts, and when not to draft.

A decoding sequence whose last tokens (an n-gram of `prompt_lookup_min`..`prompt_lookup_max`
tokens) occurred earlier in its prompt or output is guessed to go on as it went on then: the
up to `num_speculative_tokens` tokens that followed that occurrence are its draft. The
scheduler gives the draft to the model with the sequence's last token, one forward pass over
the paged KV verifies every draft of the batch (`sampling.verify`), and the longest accepted
prefix plus one token of the target's own are kept. No extra model, nothing to load; it pays
where answers quote their inputs (RAG, code edits, agents re-reading tool output) or loop.

A draft costs compute whether or not it is accepted, so it is skipped (the step decodes plainly)
- for every sequence while the running batch is larger than `disable_by_batch_size` (vLLM's
  key): a full batch already keeps the hardware busy, so verifying guesses only adds work;
- for a sequence whose recent acceptance rate (a moving average of accepted/drafted, per draft)
  fell below `min_acceptance_rate`: it pauses for a few steps, twice as many each time it fails
  again, then one draft probes whether its text has started quoting.
Defaults are from `python -m prefixgate.backend.bench_spec_decode` (README: speculative decoding).

Pure Python (no torch): the gateway validates `bundled.speculative_config` with it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram",)
# Defaults, from the benchmark on a 2-core CPU (README): at batch 32 a step costs about twice
# one at batch 1, and drafts for every sequence would double it again, so beyond 32 they cost
# more than an acceptance length of ~3 gives back; 0.25 accepted per drafted token is where a
# draft of 5 at batch 16 stops paying for its verification.
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
DEFAULT_MIN_ACCEPTANCE_RATE = 0.25
_RATE_WEIGHT = 0.5              # the newest draft's share of the moving average
_FIRST_PAUSE, _MAX_PAUSE = 4, 256   # decode steps a sequence skips drafting after failing
_MAX_CANDIDATES = 64            # earlier occurrences of the n-gram examined per draft


class SpecConfigError(ValueError):
    """A bad `--speculative-config`; `key` names the offending key ("" for the whole value)."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"{key}: {reason}" if key else reason)
        self.key, self.reason = key, reason


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE
    method: str = "ngram"


def parse_speculative_config(raw: str | dict | None) -> SpeculativeConfig | None:
    """vLLM's `--speculative-config` (JSON text or a dict) checked; None when not given."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecConfigError("", f"not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise SpecConfigError("", "must be a JSON object")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "disable_by_batch_size", "min_acceptance_rate"}
    for key in raw:
        if key not in known:
            raise SpecConfigError(key, f"unknown key (known: {', '.join(sorted(known))})")
    method = raw.get("method", "ngram")
    if method not in METHODS:
        raise SpecConfigError("method", f"{method!r} is not supported (only 'ngram': prompt lookup)")
    if "num_speculative_tokens" not in raw:
        raise SpecConfigError("num_speculative_tokens", "is required (the draft length, e.g. 5)")
    lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5                     # vLLM's defaults
    lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
    values = {"num_speculative_tokens": raw["num_speculative_tokens"], "prompt_lookup_min": lo,
              "prompt_lookup_max": hi,
              "disable_by_batch_size": raw.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecConfigError(key, f"must be a positive integer, got {value!r}")
    if lo > hi:
        raise SpecConfigError("prompt_lookup_min", f"{lo} is more than prompt_lookup_max ({hi})")
    rate = raw.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE)
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
        raise SpecConfigError("min_acceptance_rate", f"must be a number in [0, 1], got {rate!r}")
    return SpeculativeConfig(method=method, min_acceptance_rate=float(rate), **values)


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


class _SeqState:
    """One sequence's n-gram index and its recent acceptance."""
    __slots__ = ("index", "rate", "pause", "skip")

    def __init__(self, n: int):
        self.index = NgramIndex(n)
        self.rate = 1.0                 # moving average of accepted / drafted
        self.pause = _FIRST_PAUSE       # steps to skip after the next failure
        self.skip = 0                   # steps left to skip now


class Speculator:
    """Drafts for the scheduler, acceptance bookkeeping for the metrics (vLLM's counters)."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def draft(self, seq, batch_size: int, room: int) -> list[int]:
        """The draft for `seq`'s next step in a batch of `batch_size` decodes; at most `room`
        tokens (what its max_tokens, the context and the step's budget leave)."""
        cfg = self.config
        if room < 1 or batch_size > cfg.disable_by_batch_size:
            return []
        state = seq.spec
        if state is None:
            state = seq.spec = _SeqState(cfg.prompt_lookup_min)
        if state.skip:
            state.skip -= 1
            return []
        return propose(seq.token_ids, state.index, cfg.prompt_lookup_max,
                       min(room, cfg.num_speculative_tokens))

    def record(self, seq, num_drafted: int, num_accepted: int) -> None:
        """A verified draft: count it, and pause a sequence whose drafts keep failing."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
        state = seq.spec
        state.rate += _RATE_WEIGHT * (num_accepted / num_drafted - state.rate)
        if state.rate >= self.config.min_acceptance_rate:
            state.pause = _FIRST_PAUSE
            return
        state.skip = state.pause
        state.pause = min(state.pause * 2, _MAX_PAUSE)
        state.rate = self.config.min_acceptance_rate    # the probe after the pause decides
