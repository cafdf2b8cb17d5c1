"""The six parts of the engine's serving benchmark (bench/serving.py says what each measures),
each against the real HTTP server: in this process (bench/measures.py over it) or, for
warm-up, fresh `prefixgate backend` processes."""
from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp

from prefixgate.backend.bench.completions import complete, ttft
from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.backend.bench.flops import PrefillFlops
from prefixgate.backend.bench.measures import decode_rate, prefix_hits, shorts_behind_long
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.transformers_model import load_transformers
from prefixgate.backend.cli import parse_args as engine_server_args
from prefixgate.backend.server import start_server

FIRST_PROMPT_TOKENS = 64     # short, so a one-time cost is not hidden in the prompt's own compute
READY_TIMEOUT_S = 600


async def serve(model: str, *flags: str):
    return await start_server(engine_server_args(["--model", model, *flags]), host="127.0.0.1",
                              port=0)


async def _with_server(model: str, prompts: Prompts, measure, *flags: str):
    """`await measure(session, url, limit)` against one in-process server on `model` (with
    `flags`), after a warm-up request; `limit(tokens, cached)` is the FLOP limit of a hit on
    `cached` of `tokens` prompt tokens, of which the cache keeps whole KV blocks only."""
    server = await serve(model, *flags)
    engine = server.engine.engine
    flops, block = PrefillFlops.of(engine.model_config), engine.args.block_size
    try:
        async with aiohttp.ClientSession() as s:
            await ttft(s, server.url, prompts(64))
            return await measure(s, server.url, lambda tokens, cached: flops.hit_limit(
                tokens, cached // block * block))
    finally:
        await server.close()


async def bench_prefix_cache(model: str, repeats: int, prompts: Prompts) -> dict:
    r = await _with_server(model, prompts, lambda s, url, limit: prefix_hits(
        s, url, repeats, prompts, 2400, (0.5, 0.8), limit))
    return {**r, "prefix_50": r["speedup"]["50"], "prefix_80": r["speedup"]["80"]}


async def bench_prompt_lengths(model: str, repeats: int, prompts: Prompts,
                               tiers: list[int]) -> dict:
    async def measure(s, url, limit):
        return {str(t): await prefix_hits(s, url, repeats, prompts, t, (0.8,), limit)
                for t in tiers}
    return {"shared": 0.8, "tiers": await _with_server(model, prompts, measure)}


async def bench_decode(model: str, repeats: int, prompts: Prompts, batches: list[int],
                       new_tokens: int = 128) -> dict:
    async def measure(s, url, _limit):
        return {str(b): await decode_rate(s, url, prompts, b, repeats, new_tokens)
                for b in batches}
    return {"new_tokens": new_tokens, "batches": await _with_server(model, prompts, measure)}


async def bench_chunked_prefill(model: str, repeats: int, prompts: Prompts) -> dict:
    async def measure(s, url, _limit):
        return (await shorts_behind_long(s, url, prompts, repeats))["samples_s"]["short_p95"]
    on = await _with_server(model, prompts, measure)
    off = await _with_server(model, prompts, measure, "--no-chunked-prefill")
    m_on, m_off = statistics.median(on), statistics.median(off)
    return {"short_p95_ttft_median_s": {"chunked": m_on, "whole_prompts": m_off},
            "samples_s": {"chunked": on, "whole_prompts": off}, "chunked_p95": m_off / m_on}


async def bench_continuous_batching(model: str, repeats: int, prompts: Prompts, n: int = 16,
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


async def _fresh_start(session, model: str, flags: list[str], prompts: Prompts) -> dict:
    """Launch an engine process, poll /health from the start; then two requests, one by one."""
    engine = engine_process(model, "--log-level", "warning", *flags)
    t0 = time.monotonic()
    engine.start()
    try:
        listening = await engine.ready(READY_TIMEOUT_S, interval=0.01) - t0
        ready = time.monotonic() - t0
        first = await ttft(session, engine.url, prompts(FIRST_PROMPT_TOKENS))
        second = await ttft(session, engine.url, prompts(FIRST_PROMPT_TOKENS))
    finally:
        await engine.close()
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
