"""The one percentile of every benchmark and report (bench, tune, doctor, the engine's
benchmarks, the simulator).

Linear interpolation between the closest ranks: numpy's default (`np.percentile`), which is
also what vLLM's own serving benchmark reports (vllm/benchmarks/serve.py), so a p95 here and a
p95 there are the same statistic. Nearest rank would jump from sample to sample on the small
sets a benchmark cell often has (16 short requests: p95 is the 15.25th value, not the 15th).
"""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) of `values`, linear between closest ranks; None when
    there are none."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
