"""The quality gate's verdict (proxy/bench/quality.py): a candidate engine's answers against
the baseline's, on the same prompts (proxy/bench/quality_prompts.py), measure by measure.

  short set   exact match: the share of outputs equal to the baseline's token for token; the
              median position of the first token that differs (no difference: max_tokens);
              top-1 agreement: teacher-forced on the baseline's continuation, the share of
              positions where the candidate's next-token argmax is the baseline's.
  numbers     the share of questions answered with the fact's number, compared with the
              baseline's own (a small model quotes few numbers from 8k tokens at any precision:
              the gate asks for no worse, not for good).

A candidate passes when every measure meets its threshold (`Thresholds`) and it answered every
request; one that does not is reported and never recommended. Identical settings give
identical greedy outputs, so the baseline passes against itself with every measure at 1.0.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from prefixgate.proxy.bench.quality_prompts import Inputs, Suite, quotes


@dataclass(frozen=True)
class Thresholds:
    """What a candidate must reach (docs/benchmarks.md, "The quality gate", says why these).

    exact_match       share of short-set outputs equal to the baseline's, token for token
    top1_agreement    teacher-forced share of positions whose argmax is the baseline's
    numbers_drop      the numbers share may fall at most this far below the baseline's
    first_divergence  the median first differing position, as a share of max_tokens (0: not
                      gated, only reported)
    """
    exact_match: float = 0.2
    top1_agreement: float = 0.95
    numbers_drop: float = 0.1
    first_divergence: float = 0.0


def parse_thresholds(text: str, base: Thresholds = Thresholds()) -> Thresholds:
    """'exact_match=0.5,top1_agreement=0.97' over `base`; ValueError names a bad key or value."""
    names = [f.name for f in dataclasses.fields(Thresholds)]
    values = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        key = key.replace("-", "_")
        if key not in names:
            raise ValueError(f"--gate: {key!r} is no threshold (one of: {', '.join(names)})")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not eq or not 0.0 <= number <= 1.0:
            raise ValueError(f"--gate: {key} takes a number in [0, 1], got {value!r}")
        values[key] = number
    return dataclasses.replace(base, **values)


@dataclass
class PointRun:
    """What one engine (one grid point) answered."""
    flags: list[str]
    outputs: list[list[int]]             # greedy token ids, per short prompt
    top1: list[list[int]]                # argmax after each prefix of the reference's output
    answers: list[str]                   # per long-context question
    texts: list[str] = field(default_factory=list)    # the short outputs, decoded
    max_model_len: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def first_divergence(base: list[int], cand: list[int], max_tokens: int) -> int:
    """The first position where the two outputs differ (an output that ended differs from one
    that goes on); `max_tokens` when they never do."""
    for i, (a, b) in enumerate(zip(base, cand)):
        if a != b:
            return i
    return max_tokens if len(base) == len(cand) else min(len(base), len(cand))


def compare(base: PointRun, cand: PointRun, suite: Suite, thresholds: Thresholds,
            inputs: Inputs | None = None) -> dict:
    """Every measure of `cand` against `base`, each with its threshold and pass/fail;
    `passed` when all pass and the candidate answered every request."""
    n = max(len(base.outputs), 1)
    exact = sum(a == b for a, b in zip(base.outputs, cand.outputs)) / n
    divergence = [first_divergence(a, b, suite.max_tokens)
                  for a, b in zip(base.outputs, cand.outputs)]
    median_div = statistics.median(divergence) if divergence else float(suite.max_tokens)
    agree = total = 0
    for ref, b, c in zip(base.outputs, base.top1, cand.top1):
        total += len(ref)
        agree += sum(x == y for x, y in zip(b, c))
    top1 = agree / total if total else 1.0
    questions = inputs.questions if inputs else []
    right_base = [quotes(a, q.expected) for a, q in zip(base.answers, questions)]
    right_cand = [quotes(a, q.expected) for a, q in zip(cand.answers, questions)]
    share_base = sum(right_base) / len(right_base) if right_base else 1.0
    share_cand = sum(right_cand) / len(right_cand) if right_cand else 1.0
    by_context = {}
    for q, rb, rc in zip(questions, right_base, right_cand):
        row = by_context.setdefault(str(q.context), {"prompt_tokens": len(q.prompt_ids),
                                                     "questions": 0, "baseline": 0,
                                                     "candidate": 0})
        row["questions"] += 1
        row["baseline"] += rb
        row["candidate"] += rc
    t = thresholds
    div_bar = t.first_divergence * suite.max_tokens
    metrics = {
        "exact_match": _metric(exact, t.exact_match),
        "first_divergence_median": _metric(median_div, div_bar if div_bar else None),
        "top1_agreement": _metric(top1, t.top1_agreement),
        "numbers_quoted": {**_metric(share_cand, max(share_base - t.numbers_drop, 0.0)),
                           "baseline": share_base},
    }
    passed = all(m["passed"] for m in metrics.values()) and not cand.errors
    return {"baseline_flags": base.flags, "candidate_flags": cand.flags, "passed": passed,
            "metrics": metrics, "numbers_by_context": by_context,
            "thresholds": dataclasses.asdict(thresholds), "errors": cand.errors[:5],
            "seconds": {"baseline": round(base.seconds, 1), "candidate": round(cand.seconds, 1)},
            "first_divergence": divergence,
            "answers": [{"context": q.context, "depth": q.depth, "expected": q.expected,
                         "baseline": a, "candidate": b}
                        for q, a, b in zip(questions, base.answers, cand.answers)],
            "outputs": [{"baseline": a, "candidate": b}
                        for a, b in zip(base.texts, cand.texts)]}


def _metric(value: float, bar: float | None) -> dict:
    return {"value": value, "threshold": bar, "passed": bar is None or value >= bar - 1e-9}

