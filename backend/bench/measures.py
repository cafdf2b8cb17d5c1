"""What the engine benchmarks measure on one running engine, over HTTP (bench/completions.py),
whichever engine it is: the bundled one (bench/serving.py) or vLLM beside it
(bench/vs_vllm.py)."""
from __future__ import annotations

import asyncio
import statistics

from prefixgate.backend.bench.completions import stream_completion, ttft
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.common.percentiles import percentile


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


async def decode_rate(session, url: str, prompts: Prompts, batch: int, repeats: int,
                      new_tokens: int, model: str | None = None) -> dict:
    """`batch` generations of `new_tokens` that start together (short prompts: one step
    prefills them all): per repeat the median request's time per output token after the
    first; the median of those, and the batch's rate, batch / that TPOT."""
    tpots = []
    for _ in range(repeats):
        runs = await asyncio.gather(*(stream_completion(session, url, prompts(32), new_tokens,
                                                        model) for _ in range(batch)))
        if any(run.tokens != new_tokens for run in runs):
            raise RuntimeError(f"{url}: asked for {new_tokens} tokens, got "
                               f"{[run.tokens for run in runs]}")
        tpots.append(statistics.median((run.last_s - run.ttft_s) / (new_tokens - 1)
                                       for run in runs))
    tpot = statistics.median(tpots)
    return {"tpot_p50_s": tpot, "tok_per_s": batch / tpot, "samples_tpot_s": tpots}


async def shorts_behind_long(session, url: str, prompts: Prompts, repeats: int, *,
                             long_tokens: int = 4000, shorts: int = 16, head_start_s: float = 0,
                             model: str | None = None) -> dict:
    """Per repeat, a `long_tokens` prompt sent `head_start_s` before `shorts` short ones (24
    tokens, 8 generated): the short ones' p95 TTFT and the long one's TTFT; their medians
    and every repeat's."""
    p95s, longs = [], []
    for _ in range(repeats):
        long = asyncio.create_task(stream_completion(session, url, prompts(long_tokens),
                                                     model=model))
        await asyncio.sleep(head_start_s)     # 0: the long one is sent first all the same
        runs = await asyncio.gather(*(stream_completion(session, url, prompts(24), 8, model)
                                      for _ in range(shorts)))
        p95s.append(percentile([run.ttft_s for run in runs], 95))
        longs.append((await long).ttft_s)
    return {"short_p95_ttft_s": statistics.median(p95s), "long_ttft_s": statistics.median(longs),
            "samples_s": {"short_p95": p95s, "long": longs}}
