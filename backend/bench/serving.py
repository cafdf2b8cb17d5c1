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
Prints medians and ratios; `--out FILE` saves them with the config as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time

import aiohttp

from prefixgate.backend.bench.flops import PrefillFlops
from prefixgate.backend.bench.sse import completion_chunks
from prefixgate.backend.bench.transformers_model import load_transformers
from prefixgate.backend.bench.vocab import MODEL_HELP, vocab_size
from prefixgate.backend.cli import parse_args as engine_server_args
from prefixgate.backend.server import start_server
from prefixgate.common.runtime import free_port

TARGETS = {"prefix_50": 1.8, "prefix_80": 3.5, "chunked_p95": 3.0, "throughput": 4.0}
ENGINE_COMMAND = (sys.executable, "-m", "prefixgate.backend")    # `prefixgate backend`


class Prompts:
    """Fresh random token ids, so no two measurements share a prefix by accident."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        # Skip the lowest ids, where tokenizers keep their special tokens.
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]


async def stream(session, url: str, prompt: list[int],
                 max_tokens: int = 1) -> tuple[float, float, int]:
    """One streamed greedy completion: seconds from sending it to its first token and to its
    last, and the completion tokens (from the usage chunk)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    async for seconds, chunk in completion_chunks(session, url, body):
        if chunk.get("choices"):
            last = seconds
            first = first or last
        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return first, last, tokens


async def ttft(session, url: str, prompt: list[int], max_tokens: int = 1) -> float:
    """Seconds from sending the request to the first streamed token; reads the stream to its
    end."""
    return (await stream(session, url, prompt, max_tokens))[0]


async def complete(session, url: str, prompt: list[int], max_tokens: int) -> int:
    """One whole (non-streamed) greedy completion; returns the completion tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        return (await r.json())["usage"]["completion_tokens"]


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


async def serve(model: str, *flags: str):
    return await start_server(engine_server_args(["--model", model, *flags]), host="127.0.0.1",
                              port=0)


async def prefix_hits(session, url: str, repeats: int, prompts: Prompts, tokens: int,
                      shares: tuple[float, ...], limit) -> dict:
    """Per repeat: a cold prompt of `tokens`, then for each share a prefix of that share served
    and the whole prompt after it. Medians, the speed-ups, and the FLOP limit of each
    (`limit(tokens, cached)`)."""
    cold, warm = [], {share: [] for share in shares}
    for _ in range(repeats):
        cold.append(await ttft(session, url, prompts(tokens)))
        for share in shares:
            prefix = prompts(round(tokens * share))
            await ttft(session, url, prefix)                         # served before
            warm[share].append(await ttft(session, url, prefix + prompts(tokens - len(prefix))))
    pct = {share: str(round(share * 100)) for share in shares}
    samples = {"cold": cold, **{f"shared_{pct[sh]}": v for sh, v in warm.items()}}
    m = {k: statistics.median(v) for k, v in samples.items()}
    # Each repeat measures cold and warm back to back; the median of those paired ratios is
    # less sensitive to load that drifts over the run than the ratio of medians.
    return {"prompt_tokens": tokens, "ttft_median_s": m, "samples_s": samples,
            "speedup": {pct[sh]: m["cold"] / m[f"shared_{pct[sh]}"] for sh in shares},
            "paired_ratio_median": {pct[sh]: statistics.median(c / w for c, w in zip(cold, v))
                                    for sh, v in warm.items()},
            "flop_limit": {pct[sh]: limit(tokens, round(tokens * sh)) for sh in shares}}


async def _with_server(model: str, prompts: Prompts, measure):
    """`await measure(session, url, limit)` against one in-process server on `model`, after a
    warm-up request; `limit(tokens, cached)` is the FLOP limit of a hit on `cached` of
    `tokens` prompt tokens, of which the cache keeps whole KV blocks only."""
    server = await serve(model)
    engine = server.engine.engine
    flops, block = PrefillFlops.of(engine.model, engine.model_config), engine.args.block_size
    try:
        async with aiohttp.ClientSession() as s:
            await ttft(s, server.url, prompts(64))
            return await measure(s, server.url, lambda tokens, cached: flops.hit_limit(
                tokens, cached // block * block))
    finally:
        await server.close()


async def bench_prefix(model: str, repeats: int, prompts: Prompts) -> dict:
    r = await _with_server(model, prompts, lambda s, url, limit: prefix_hits(
        s, url, repeats, prompts, 2400, (0.5, 0.8), limit))
    return {**r, "prefix_50": r["speedup"]["50"], "prefix_80": r["speedup"]["80"]}


async def bench_tiers(model: str, repeats: int, prompts: Prompts, tiers: list[int]) -> dict:
    async def measure(s, url, limit):
        return {str(t): await prefix_hits(s, url, repeats, prompts, t, (0.8,), limit)
                for t in tiers}
    return {"shared": 0.8, "tiers": await _with_server(model, prompts, measure)}


async def bench_decode(model: str, repeats: int, prompts: Prompts, batches: list[int],
                       new_tokens: int = 128) -> dict:
    """Each batch's requests start together (short prompts: one step prefills them all)."""
    async def measure(s, url, _limit):
        out = {}
        for b in batches:
            tpots = []
            for _ in range(repeats):
                runs = await asyncio.gather(*(stream(s, url, prompts(32), new_tokens)
                                              for _ in range(b)))
                tpots.append(statistics.median((last - first) / (n - 1)
                                               for first, last, n in runs))
            tpot = statistics.median(tpots)
            out[str(b)] = {"tpot_p50_s": tpot, "tok_per_s": b / tpot, "samples_tpot_s": tpots}
        return out
    return {"new_tokens": new_tokens, "batches": await _with_server(model, prompts, measure)}


async def _long_and_shorts(model: str, flags: list[str], repeats: int,
                           prompts: Prompts) -> list[float]:
    server = await serve(model, *flags)
    p95s = []
    try:
        async with aiohttp.ClientSession() as s:
            await ttft(s, server.url, prompts(64))
            for _ in range(repeats):
                long_task = asyncio.create_task(ttft(s, server.url, prompts(4000)))
                await asyncio.sleep(0)                               # the long one is sent first
                shorts = await asyncio.gather(*(ttft(s, server.url, prompts(24), max_tokens=8)
                                                for _ in range(16)))
                await long_task
                p95s.append(p95(shorts))
    finally:
        await server.close()
    return p95s


async def bench_chunked(model: str, repeats: int, prompts: Prompts) -> dict:
    on = await _long_and_shorts(model, [], repeats, prompts)
    off = await _long_and_shorts(model, ["--no-chunked-prefill"], repeats, prompts)
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"short_p95_ttft_median_s": {"chunked": m_on, "whole_prompts": m_off},
            "samples_s": {"chunked": on, "whole_prompts": off}, "chunked_p95": m_off / m_on}


async def bench_throughput(model: str, repeats: int, prompts: Prompts, n: int = 16,
                           new_tokens: int = 128) -> dict:
    """Engine batch and transformers one-by-one, alternated, so both see the same machine load."""
    server = await serve(model)
    ours, theirs = [], []
    try:
        hf = await asyncio.to_thread(_load_hf, server.engine.engine.model_dir)    # dir or .gguf
        async with aiohttp.ClientSession() as s:
            await ttft(s, server.url, prompts(32), max_tokens=4)
            for _ in range(repeats):
                batch = [prompts(32) for _ in range(n)]
                t0 = time.perf_counter()
                done = await asyncio.gather(*(complete(s, server.url, p, new_tokens)
                                              for p in batch))
                ours.append(time.perf_counter() - t0)
                assert sum(done) == n * new_tokens
                theirs.append(await asyncio.to_thread(_hf_one_by_one, hf, batch, new_tokens))
    finally:
        await server.close()
    tokens = n * new_tokens
    m_ours, m_hf = statistics.median(ours), statistics.median(theirs)
    return {"engine_s": m_ours, "transformers_s": m_hf,
            "samples_s": {"engine": ours, "transformers": theirs},
            "engine_tok_per_s": tokens / m_ours, "transformers_tok_per_s": tokens / m_hf,
            "throughput": m_hf / m_ours}


FIRST_PROMPT_TOKENS = 64     # short, so a one-time cost is not hidden in the prompt's own compute


async def _fresh_start(session, model: str, flags: list[str], prompts: Prompts) -> dict:
    """Launch an engine process, poll /health from the start; then two requests, one by one."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *ENGINE_COMMAND, "--model", model, "--port", str(port),
        "--log-level", "warning", *flags, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        listening = None
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"engine {flags} exited with {proc.returncode}")
            try:
                async with session.get(url + "/health") as r:
                    listening = listening or time.perf_counter() - t0
                    if r.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.01)
        ready = time.perf_counter() - t0
        first = await ttft(session, url, prompts(FIRST_PROMPT_TOKENS))
        second = await ttft(session, url, prompts(FIRST_PROMPT_TOKENS))
    finally:
        proc.terminate()
        await proc.wait()
    return {"listening_s": listening, "ready_s": ready, "first_ttft_s": first,
            "second_ttft_s": second}


async def bench_warmup(model: str, repeats: int, prompts: Prompts) -> dict:
    """Each repeat starts every configuration once, so drifting load hits them alike."""
    configs = {f"{fmt}_{'warm' if warm else 'skip'}":
               ["--load-format", fmt] + ([] if warm else ["--skip-server-warmup"])
               for fmt in ("mmap", "eager") for warm in (True, False)}
    samples = {name: [] for name in configs}
    async with aiohttp.ClientSession() as s:
        for _ in range(repeats):
            for name, flags in configs.items():
                samples[name].append(await _fresh_start(s, model, flags, prompts))
    medians = {name: {k: statistics.median(run[k] for run in runs) for k in runs[0]}
               for name, runs in samples.items()}
    ratios = {fmt: medians[f"{fmt}_skip"]["first_ttft_s"] / medians[f"{fmt}_warm"]["first_ttft_s"]
              for fmt in ("mmap", "eager")}
    return {"medians": medians, "samples": samples, "first_ttft_skip_over_warm": ratios,
            "prompt_tokens": FIRST_PROMPT_TOKENS}


def _load_hf(model_path):
    import torch

    model = load_transformers(model_path, torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():   # warm-up
        model.generate(torch.tensor([[16, 17, 18]]), max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    return model


def _hf_one_by_one(model, batch: list[list[int]], new_tokens: int) -> float:
    import torch

    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for prompt in batch:
            model.generate(torch.tensor([prompt]), **kwargs)
        return time.perf_counter() - t0


async def run(args) -> dict:
    vocab = vocab_size(args.model)
    prompts = Prompts(vocab, args.seed)
    result = {"config": vars(args), "targets": TARGETS}
    parts = set(args.parts.split(","))
    m, n = args.model, args.repeats
    benches = {"a": ("prefix_cache", lambda: bench_prefix(m, n, prompts), _report_a),
               "b": ("chunked_prefill", lambda: bench_chunked(m, n, prompts), _report_b),
               "c": ("continuous_batching", lambda: bench_throughput(m, n, prompts), _report_c),
               "d": ("warmup", lambda: bench_warmup(m, n, prompts), _report_d),
               "e": ("prompt_lengths", lambda: bench_tiers(m, n, prompts, args.tiers), _report_e),
               "f": ("decode", lambda: bench_decode(m, n, prompts, args.decode_batches),
                     _report_f)}
    for part, (key, bench, report) in benches.items():
        if part in parts:
            result[key] = await bench()
            report(result[key])
    return result


def _verdict(ratio: float, key: str) -> str:
    met = "met" if ratio >= TARGETS[key] else "MISSED"
    return f"{ratio:.2f}x (target >= {TARGETS[key]}x: {met})"


def _report_a(r):
    m, lim = r["ttft_median_s"], r["flop_limit"]
    print(f"a) prefix cache, 2,400-token prompt TTFT median: cold {m['cold'] * 1e3:.0f} ms, "
          f"50% served before {m['shared_50'] * 1e3:.0f} ms, 80% {m['shared_80'] * 1e3:.0f} ms")
    print(f"   speed-up 50%: {_verdict(r['prefix_50'], 'prefix_50')}; "
          f"80%: {_verdict(r['prefix_80'], 'prefix_80')}")
    p = r["paired_ratio_median"]
    print(f"   (median of per-repeat cold/warm ratios: 50% {p['50']:.2f}x, 80% {p['80']:.2f}x; "
          f"FLOP limit: 50% {lim['50']:.2f}x, 80% {lim['80']:.2f}x)")


def _report_b(r):
    m = r["short_p95_ttft_median_s"]
    print(f"b) 4,000-token prompt + 16 short ones, short p95 TTFT (median of runs): chunked "
          f"{m['chunked'] * 1e3:.0f} ms, whole prompts {m['whole_prompts'] * 1e3:.0f} ms")
    print(f"   improvement: {_verdict(r['chunked_p95'], 'chunked_p95')}")


def _report_c(r):
    print(f"c) 16 x 128 tokens (medians): engine {r['engine_s']:.1f} s "
          f"({r['engine_tok_per_s']:.0f} tok/s), transformers one by one "
          f"{r['transformers_s']:.1f} s ({r['transformers_tok_per_s']:.0f} tok/s)")
    print(f"   throughput: {_verdict(r['throughput'], 'throughput')}")


def _report_d(r):
    m = r["medians"]
    print(f"d) fresh engine processes, medians of runs; first request: "
          f"a {r['prompt_tokens']}-token prompt")
    for fmt in ("mmap", "eager"):
        warm, skip = m[f"{fmt}_warm"], m[f"{fmt}_skip"]
        print(f"   {fmt:5}: /health 200 after {warm['ready_s']:.2f} s "
              f"(listening at {warm['listening_s']:.2f} s; "
              f"{skip['ready_s']:.2f} s with --skip-server-warmup); "
              f"first TTFT {warm['first_ttft_s'] * 1e3:.0f} ms "
              f"warmed vs {skip['first_ttft_s'] * 1e3:.0f} ms skipped: "
              f"{r['first_ttft_skip_over_warm'][fmt]:.2f}x; "
              f"second TTFT {warm['second_ttft_s'] * 1e3:.0f} / "
              f"{skip['second_ttft_s'] * 1e3:.0f} ms")


def _report_e(r):
    pct = str(round(r["shared"] * 100))
    print(f"e) TTFT by prompt length (medians), cold and with {pct}% served before; "
          f"FLOP limit = cold/warm prefill FLOPs")
    for tokens, t in r["tiers"].items():
        m = t["ttft_median_s"]
        print(f"   {int(tokens):>6,} tokens: cold {m['cold'] * 1e3:8.0f} ms, "
              f"warm {m['shared_' + pct] * 1e3:7.0f} ms, {t['speedup'][pct]:5.2f}x "
              f"(paired {t['paired_ratio_median'][pct]:.2f}x; FLOP limit "
              f"{t['flop_limit'][pct]:.2f}x)")


def _report_f(r):
    print(f"f) decode, {r['new_tokens']} tokens per request (medians): batch, TPOT p50, "
          f"batch / TPOT")
    for b, d in r["batches"].items():
        print(f"   batch {int(b):>3}: {d['tpot_p50_s'] * 1e3:7.1f} ms, "
              f"{d['tok_per_s']:7.1f} tok/s")


def run_report_save(run, report, args) -> int:
    """The engine benchmarks' ending: torch's CPU threads as `--threads` says (where the
    benchmark has the flag), `asyncio.run(run(args))`, `report(result)`, and the result saved
    as JSON where `--out` says."""
    t0 = time.monotonic()
    if getattr(args, "threads", None):
        import torch
        torch.set_num_threads(args.threads)
    result = asyncio.run(run(args))
    report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"saved {args.out} ({time.monotonic() - t0:.0f}s)")
    return 0


THREADS_HELP = "torch CPU threads for the engine (and transformers) (default: torch's)"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.serving",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--parts", default="a,b,c", help="which benchmarks: any of a,b,c,d,e,f")
    p.add_argument("--tiers", type=_int_list, default=[512, 2400, 8000],
                   help="e: prompt lengths (default 512,2400,8000)")
    p.add_argument("--decode-batches", type=_int_list, default=[1, 8, 32],
                   help="f: concurrent generations (default 1,8,32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--out", default=None, help="save results as JSON here")
    # each part prints its figures as it finishes
    return run_report_save(run, lambda result: None, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
