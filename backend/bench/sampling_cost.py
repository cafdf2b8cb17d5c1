"""Sampling cost per step: `python -m prefixgate.backend.bench.sampling_cost`.

Times `sampling.sample` on one step's logits [batch, vocab] (float32, all rows random, no
seeds), the full-sort path (`candidates=None`: every top-k/top-p row sorted whole,
full-vocabulary probabilities, the exponential race over all of them; the sampler before issue
#29) against the default path (top-k/top-p on `sampling.CANDIDATES` torch.topk candidates,
the full sort only for rows whose kept set is not among them, the draw by inverse CDF over the
kept tokens), for vocabularies 49,152 (SmolLM2) and 151,936 (Qwen2) x batches 1, 16, 64 x
settings top-p 0.9, top-k 50, top-k 50 + top-p 0.9 and temperature only (all at temperature
1). The two paths keep exactly the same tokens (tests/engine/test_sampling_candidates.py).

Logits are random normal times a scale: `peaked` (default 4.5: the top-p 0.9 nucleus holds tens
to hundreds of tokens, as a trained model's usually does) and `flat` (default 1.0: the nucleus
holds tens of thousands, far more than the candidates, so every top-p row falls back to the
full sort and pays the topk on top). The table reports both, with the median number of tokens
kept and how many rows fell back. Each cell times `--repeats` steps of each path in turn
(after one untimed step of each) and reports the medians and their ratio (full sort / new).
`--threads` sets torch's CPU threads (default 1, the engine's usual CPU setting here; 0 leaves
torch's default). `--json FILE` saves the rows. `--quick`: vocab 49,152, batches 1 and 16, 3
repeats. On a 2-core CPU the default run takes ~2 minutes.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from prefixgate.backend.bench.script import int_list, save_json

VOCABS = (49_152, 151_936)
BATCHES = (1, 16, 64)
SETTINGS = {                     # name: SamplingParams keywords
    "top_p 0.9": {"top_p": 0.9},
    "top_k 50": {"top_k": 50},
    "top_k 50 + top_p 0.9": {"top_k": 50, "top_p": 0.9},
    "temperature only": {},
}


def kept_counts(logits: torch.Tensor, params: list) -> tuple[float, int]:
    """Median number of tokens each row keeps, and how many rows the default path sorts whole
    (not timed)."""
    from prefixgate.backend.sampling import CANDIDATES, _cuts, _kept_sorted, _scaled

    vocab = logits.shape[1]
    if not any(_cuts(p, vocab) for p in params):
        return float(vocab), 0
    groups = _kept_sorted(_scaled(logits, params), [p.top_k for p in params],
                          [p.top_p for p in params], CANDIDATES)
    kept = torch.cat([m for _, _, _, m in groups]).float()
    fallback = sum(len(rows) for rows, vals, _, _ in groups if vals.shape[1] == vocab)
    if 4 * CANDIDATES > vocab:              # the default path sorts everything at this size
        fallback = len(params)
    return float(kept.median()), fallback


def time_cell(logits: torch.Tensor, params: list, repeats: int) -> tuple[float, float]:
    """Median ms per step of the full-sort path and of the default path, run in turn."""
    from prefixgate.backend.sampling import CANDIDATES, sample

    gens = [None] * len(params)
    paths = {"full": None, "new": CANDIDATES}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for cand in paths.values():                 # warm-up: allocator, lazy init
        sample(logits, params, gens, candidates=cand)
    for _ in range(repeats):
        for name, cand in paths.items():
            t0 = time.perf_counter()
            sample(logits, params, gens, candidates=cand)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times["full"]), statistics.median(times["new"])


def run(vocabs, batches, kinds: dict[str, float], repeats: int, seed: int) -> list[dict]:
    from prefixgate.backend.sampling import SamplingParams

    rows = []
    for kind, scale in kinds.items():
        for vocab in vocabs:
            for batch in batches:
                gen = torch.Generator().manual_seed(seed + vocab + batch)
                logits = torch.randn(batch, vocab, generator=gen) * scale
                for setting, kw in SETTINGS.items():
                    if kind != "peaked" and "top_p" not in kw:
                        continue        # flatness changes nothing for top-k or no cut
                    params = [SamplingParams(**kw) for _ in range(batch)]
                    kept, fallback = kept_counts(logits, params)
                    full, new = time_cell(logits, params, repeats)
                    row = {"logits": kind, "scale": scale, "vocab": vocab, "batch": batch,
                           "setting": setting, "kept_median": kept, "fallback_rows": fallback,
                           "full_sort_ms": round(full, 3), "candidates_ms": round(new, 3),
                           "ratio": round(full / new, 2)}
                    rows.append(row)
                    print(f"| {kind} | {vocab:,} | {batch} | {setting} | {kept:,.0f} | "
                          f"{fallback}/{batch} | {full:,.2f} | {new:,.2f} | "
                          f"**{full / new:.2f}x** |", flush=True)
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.sampling_cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default=None, help="comma-separated (default 49152,151936)")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,16,64)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per path (default 5)")
    p.add_argument("--peaked-scale", type=float, default=4.5)
    p.add_argument("--flat-scale", type=float, default=1.0)
    p.add_argument("--logits", choices=("peaked", "flat", "both"), default="both")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="vocab 49152, batches 1,16, 3 repeats")
    p.add_argument("--json", default=None, help="save the rows as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    vocabs = int_list(a.vocabs) if a.vocabs else ([49_152] if a.quick else list(VOCABS))
    batches = int_list(a.batches) if a.batches else ([1, 16] if a.quick else list(BATCHES))
    repeats = a.repeats or (3 if a.quick else 5)
    kinds = {k: s for k, s in (("peaked", a.peaked_scale), ("flat", a.flat_scale))
             if a.logits in (k, "both")}
    from prefixgate.backend.sampling import CANDIDATES

    print(f"# sampling cost per step, torch {torch.__version__}, {torch.get_num_threads()} "
          f"thread(s), {CANDIDATES} candidates, median of {repeats} steps; logits randn x "
          + ", ".join(f"{s} ({k})" for k, s in kinds.items()))
    print("| logits | vocab | batch | setting | kept (median) | fell back | full sort ms "
          "| candidates ms | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = run(vocabs, batches, kinds, repeats, a.seed)
    save_json({"threads": torch.get_num_threads(), "candidates": CANDIDATES, "repeats": repeats,
               "torch": torch.__version__, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
