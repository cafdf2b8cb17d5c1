"""Engine benchmarks on CPU: `python -m prefixgate.backend.bench.serving`.

On the demo model unless `--model` names another (`smollm2`, a .gguf file, a Hugging Face
directory). Each figure is a ratio against a baseline measured in the same run, through the
real HTTP server (streamed completions with token-id prompts, so tokenization is not measured):
  a) prefix cache: TTFT of a 2,400-token prompt whose first 1,200 (or 1,920 = 80%) tokens
     were served just before, vs the same-length prompt cold; beside each, the most a hit
     could give if time followed the arithmetic (cold / warm prefill FLOPs, bench/flops.py,
     with the whole KV blocks the cache keeps counted as cached).
                                                                        targets 1.8x, 3.5x
  b) chunked prefill: one 4,000-token prompt arriving with 16 short ones; the short ones'
     p95 TTFT with chunked prefill vs with prompts taken whole.        target 3x
  c) continuous batching: 16 concurrent 128-token generations vs the same 16 run one by one
     with transformers' `generate` on the same model (a GGUF too).     target 4x
  d) warm-up: fresh `prefixgate backend` processes, per --load-format (mmap, eager), with
     and without --skip-server-warmup: seconds from launch until /health says 200, then the
     first request's TTFT (a 64-token prompt) and a second one's; the ratio is the first
     request's TTFT without warm-up over with it.                      no target
  e) prompt lengths: TTFT at each of `--tiers` (512, 2,400, 8,000 tokens) cold and with 80%
     of the prompt served before, against the FLOP limit as in a).     no target
  f) decode: `--decode-batches` (1, 8, 32) concurrent 128-token generations of short
     prompts; TPOT p50 over the batch's requests and the batch's rate, batch / TPOT p50.
                                                                        no target
Prints medians and ratios as each part finishes (bench/serving_report.py); `--out FILE` saves
them with the config as JSON.
"""
from __future__ import annotations

import argparse
import sys

from prefixgate.backend.bench import serving_parts as parts
from prefixgate.backend.bench import serving_report as reports
from prefixgate.backend.bench.script import THREADS_HELP, int_list, run_report_save
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.vocab import MODEL_HELP, vocab_size

# part: its key in the result, its benchmark (bench/serving_parts.py), its report
PARTS = {"a": ("prefix_cache", parts.bench_prefix_cache, reports.report_prefix_cache),
         "b": ("chunked_prefill", parts.bench_chunked_prefill, reports.report_chunked_prefill),
         "c": ("continuous_batching", parts.bench_continuous_batching,
               reports.report_continuous_batching),
         "d": ("warmup", parts.bench_warmup, reports.report_warmup),
         "e": ("prompt_lengths", parts.bench_prompt_lengths, reports.report_prompt_lengths),
         "f": ("decode", parts.bench_decode, reports.report_decode)}


async def run(args) -> dict:
    prompts = Prompts(vocab_size(args.model), args.seed)
    result = {"config": vars(args), "targets": reports.TARGETS}
    chosen = set(args.parts.split(","))
    sizes = {"e": [args.tiers], "f": [args.decode_batches]}       # the parts' own flags
    for part, (key, bench, report) in PARTS.items():
        if part in chosen:
            result[key] = await bench(args.model, args.repeats, prompts, *sizes.get(part, []))
            report(result[key])
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.serving",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--parts", default="a,b,c", help="which benchmarks: any of a,b,c,d,e,f")
    p.add_argument("--tiers", type=int_list, default=[512, 2400, 8000],
                   help="e: prompt lengths (default 512,2400,8000)")
    p.add_argument("--decode-batches", type=int_list, default=[1, 8, 32],
                   help="f: concurrent generations (default 1,8,32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--out", default=None, help="save results as JSON here")
    # each part prints its figures as it finishes
    return run_report_save(run, lambda result: None, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
