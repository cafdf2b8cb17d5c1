"""Where a loaded engine's time goes: `python -m prefixgate.backend.bench.replay`.

Replays vLLM's `random` workload (random prompts of `--input-len` tokens, `--output-len` out,
Poisson arrivals at `--rate` requests/s, seeded) straight into LLMEngine, with no HTTP server and
no client in between, and reports what decode waits on: the share of the wall time the engine
spent in steps (near 1: the core is saturated and every millisecond of a step shows in TPOT and
TTFT), the decode-only steps and the steps that carry a prompt chunk (how many, their median
time, the chunks' sizes), and the requests' TTFT and TPOT p50/p95. Run it pinned
(`taskset -c 0`) with `--threads 1` to measure one core.
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

from prefixgate.backend.bench.script import add_dtype_arg, run_report_save
from prefixgate.backend.bench.vocab import MODEL_HELP
from prefixgate.backend.config import EngineArgs
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams
from prefixgate.common.percentiles import percentile


def arrivals(rate: float, count: int, rng: random.Random) -> list[float]:
    """Poisson arrival offsets in seconds (exponential gaps), as vLLM's client sends them."""
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


class StepLog:
    """Wraps the engine's model runner: per step, its decodes, prompt tokens and seconds."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[tuple[int, int, float]] = []
        self._run = engine.runner.run
        engine.runner.run = self.run

    def run(self, batch):
        start = time.perf_counter()
        sampled = self._run(batch)
        decodes = sum(1 for n in batch.num_new_tokens if n == 1)
        self.steps.append((decodes, batch.num_tokens - decodes, time.perf_counter() - start))
        return sampled


def run(args) -> dict:
    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=args.input_len + args.output_len + 16,
                                  kv_cache_memory=args.kv_cache_memory))
    engine.warm_up()
    log = StepLog(engine)
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    due = arrivals(args.rate, args.num_prompts, rng)
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in due]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    start, sent = time.monotonic(), 0
    while sent < len(due) or engine.has_work():
        now = time.monotonic() - start
        while sent < len(due) and due[sent] <= now:
            engine.add_request(str(sent), prompts[sent], params, arrival_time=start + due[sent])
            sent += 1
        if not engine.has_work():
            time.sleep(min(0.005, due[sent] - now))
            continue
        for out in engine.step():
            stamp = time.monotonic() - start
            first.setdefault(out.request_id, stamp)
            last[out.request_id] = stamp
    wall = time.monotonic() - start
    ttft = [first[str(i)] - t for i, t in enumerate(due)]
    tpot = [(last[str(i)] - first[str(i)]) / max(args.output_len - 1, 1) for i in range(len(due))]
    return {"config": dict(vars(args)), "wall_s": wall, **summarize(log.steps),
            "ttft_ms": _quantiles(ttft), "tpot_ms": _quantiles(tpot)}


def summarize(steps: list[tuple[int, int, float]]) -> dict:
    decode_only = [s for d, p, s in steps if p == 0]
    mixed = [(p, s) for d, p, s in steps if p > 0]
    return {
        "busy_s": sum(s for *_, s in steps),
        "decode_only": {"steps": len(decode_only), "median_ms": _median_ms(decode_only),
                        "s": sum(decode_only)},
        "with_prompt_chunk": {
            "steps": len(mixed), "median_ms": _median_ms([s for _, s in mixed]),
            "s": sum(s for _, s in mixed), "prompt_tokens": sum(p for p, _ in mixed),
            "chunk_sizes": dict(sorted(collections.Counter(
                64 * (p // 64) for p, _ in mixed).items()))},
    }


def _median_ms(seconds: list[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


def _quantiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"p50": percentile(ms, 50), "p95": percentile(ms, 95)}


def report(r: dict) -> None:
    c, d, m = r["config"], r["decode_only"], r["with_prompt_chunk"]
    print(f"{c['model']}: {c['num_prompts']} random prompts of {c['input_len']} tokens, "
          f"{c['output_len']} out, at {c['rate']} req/s, "
          f"step budget {c['max_num_batched_tokens']} tokens")
    print(f"  busy {r['busy_s']:.1f} s of {r['wall_s']:.1f} s wall "
          f"({r['busy_s'] / r['wall_s']:.0%})")
    print(f"  decode-only steps   {d['steps']:5d}, median {d['median_ms'] or 0:7.1f} ms, "
          f"{d['s']:.1f} s in all")
    print(f"  with a prompt chunk {m['steps']:5d}, median {m['median_ms'] or 0:7.1f} ms, "
          f"{m['s']:.1f} s in all, {m['prompt_tokens']:,} prompt tokens; "
          f"chunk sizes (floor to 64): {m['chunk_sizes']}")
    print(f"  TTFT p50 / p95 {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p95']:.0f} ms, "
          f"TPOT p50 / p95 {r['tpot_ms']['p50']:.0f} / {r['tpot_ms']['p95']:.0f} ms")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.replay",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    add_dtype_arg(p)
    p.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="save the result as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_report_save(run, report, parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
