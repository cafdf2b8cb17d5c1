"""The bundled engine beside vLLM: `python -m prefixgate.backend.bench.vs_vllm`.

The same model (`--model`, smollm2 by default: the GGUF for ours, its Hugging Face export for
vLLM, with the same weights and token ids), the same dtype, prompts (seeded random token ids),
step budget and KV cache size; each engine a server on loopback whose whole process tree is
pinned to one core (bench/pinned_servers.py); the engines measured one after the other, never
at once, client-side over HTTP streaming; a warm-up request first, fixed output lengths
(`ignore_eos`), medians over `--repeats`.
  agree    greedy agreement: a few chats, `return_token_ids`: per chat, are the prompt's and
           the answer's token ids the same, and where does the answer first differ.
  ttft     TTFT at each of `--tiers` prompt tokens, cold, and with a cached prefix: 80% of the
           prompt in whole 128-token blocks (vLLM's CPU block, so both can keep all of it)
           served just before, then that prefix with a new suffix.
  decode   `--batches` concurrent 128-token generations of 32-token prompts; tok/s = batch /
           the median request's time per output token.
  chunked  a 4,000-token prompt sent just before 16 short ones: the short ones' p95 TTFT, with
           chunked prefill on both (`--max-num-batched-tokens`, the step budget of both).
Then the memory of each server's process tree. Ratios are ours over vLLM in speed (>1: ours is
faster) and in memory (<1: ours holds less). Targets: TTFT with a cached prefix >= 1.0x,
decode tok/s >= 0.8x.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from prefixgate.backend.bench import pinned_servers
from prefixgate.backend.bench.completions import stream_completion
from prefixgate.backend.bench.measures import decode_rate, shorts_behind_long
from prefixgate.backend.bench.script import int_list, run_report_save, save_json
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.vocab import vocab_size
from prefixgate.proxy.testing.vllm_install import VLLM_VERSION

SERVED_NAME = pinned_servers.SERVED_NAME
ENGINES = {"ours": pinned_servers.ours, "vllm": pinned_servers.vllm}
PARTS = ("agree", "ttft", "decode", "chunked")
TARGETS = {"ttft_cached": 1.0, "decode": 0.8}
BLOCK = 128                 # vLLM's CPU KV block: cached prefixes are whole ones
SHARE = 0.8
CHATS = ("What is the capital of France?", "Write a haiku about the sea.",
         "Explain what a hash table is in two sentences.",
         "Give me three tips for learning to cook.")


class Sizes:
    """How big each part is: a full run's sizes, or `--quick`'s tiny ones."""

    def __init__(self, quick: bool):
        self.chats = CHATS[:1] if quick else CHATS
        self.answer_tokens = 8 if quick else 48
        self.new_tokens = 8 if quick else 128
        self.long_tokens = 512 if quick else 4000
        self.shorts = 4 if quick else 16


async def request(session, url: str, prompt: list[int], max_tokens: int = 1):
    """One streamed greedy completion of token ids (bench/completions.py) by the name both
    engines serve the model under."""
    return await stream_completion(session, url, prompt, max_tokens, SERVED_NAME)


async def chat_token_ids(session, url: str, question: str, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}], "return_token_ids": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        answer = await r.json()
    choice = answer["choices"][0]
    return {"prompt_ids": answer["prompt_token_ids"], "ids": choice["token_ids"],
            "text": choice["message"]["content"]}


async def ttft_tier(session, url: str, prompts: Prompts, tokens: int, repeats: int) -> dict:
    prefix_tokens = max(BLOCK, round(tokens * SHARE) // BLOCK * BLOCK)
    cold, warm, cached = [], [], []
    for _ in range(repeats):
        cold.append((await request(session, url, prompts(tokens))).ttft_s)
        prefix = prompts(prefix_tokens)
        await request(session, url, prefix)                          # served before
        hit = await request(session, url, prefix + prompts(tokens - prefix_tokens))
        warm.append(hit.ttft_s)
        cached.append(hit.cached)
    return {"prefix_tokens": prefix_tokens, "cold_s": statistics.median(cold),
            "cached_prefix_s": statistics.median(warm), "cached_tokens_reported": cached,
            "samples_s": {"cold": cold, "cached_prefix": warm}}


async def measure(server: pinned_servers.Running, args, sizes: Sizes) -> dict:
    """Every part of `args.parts` against one running engine, then its memory."""
    prompts = Prompts(vocab_size(args.model), args.seed)     # the same prompts for each engine
    out = {}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await request(s, server.url, prompts(64), max_tokens=8)               # warm-up
        if "agree" in args.parts:
            out["agree"] = [await chat_token_ids(s, server.url, q, sizes.answer_tokens)
                            for q in sizes.chats]
        if "ttft" in args.parts:
            out["ttft"] = {str(t): await ttft_tier(s, server.url, prompts, t, args.repeats)
                           for t in args.tiers}
        if "decode" in args.parts:
            out["decode"] = {str(b): await decode_rate(s, server.url, prompts, b, args.repeats,
                                                       sizes.new_tokens, SERVED_NAME)
                             for b in args.batches}
        if "chunked" in args.parts:
            out["chunked"] = await shorts_behind_long(
                s, server.url, prompts, args.repeats, long_tokens=sizes.long_tokens,
                shorts=sizes.shorts, head_start_s=0.1,      # the long prompt's prefill has begun
                model=SERVED_NAME)
    out["memory"] = pinned_servers.tree_memory(server.pid)
    return out


def agreement(ours: list[dict], vllm: list[dict], chats) -> list[dict]:
    """Per chat: same prompt ids, same answer ids, and the first answer position that
    differs (None when one answer is the other's prefix or both are equal)."""
    rows = []
    for question, a, b in zip(chats, ours, vllm):
        first = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)
        rows.append({"chat": question, "same_prompt_ids": a["prompt_ids"] == b["prompt_ids"],
                     "identical": a["ids"] == b["ids"], "first_divergence": first,
                     "tokens": [len(a["ids"]), len(b["ids"])],
                     "texts": [a["text"], b["text"]]})
    return rows


def table_rows(engines: dict) -> list[dict]:
    """One row per figure both engines have: label, kind (time: lower is better, rate: higher
    is better, size: MiB), each engine's value, and the target key where one applies."""
    ours, vllm = engines["ours"], engines["vllm"]
    rows = []

    def add(label, kind, get, target=None):
        rows.append({"label": label, "kind": kind, "ours": get(ours), "vllm": get(vllm),
                     "target": target})
    for t in ours.get("ttft", {}):
        add(f"TTFT cold, {int(t):,} tokens", "time", lambda e, t=t: e["ttft"][t]["cold_s"])
        add(f"TTFT cached prefix, {int(t):,} tokens ({ours['ttft'][t]['prefix_tokens']:,} "
            f"cached)", "time", lambda e, t=t: e["ttft"][t]["cached_prefix_s"], "ttft_cached")
    for b in ours.get("decode", {}):
        add(f"decode tok/s, batch {b}", "rate", lambda e, b=b: e["decode"][b]["tok_per_s"],
            "decode")
    if "chunked" in ours:
        add("short-request p95 TTFT behind a long prompt", "time",
            lambda e: e["chunked"]["short_p95_ttft_s"])
    add("memory, process tree PSS", "size", lambda e: e["memory"]["pss_mib"])
    add("memory, process tree RSS", "size", lambda e: e["memory"]["rss_mib"])
    for row in rows:
        # speed ours/vLLM for times and rates (>1: ours faster); size ours/vLLM for memory
        row["ratio"] = (row["vllm"] / row["ours"] if row["kind"] == "time"
                        else row["ours"] / row["vllm"])
    return rows


def _value(kind: str, x: float) -> str:
    return {"time": f"{x * 1e3:,.0f} ms", "rate": f"{x:,.1f}", "size": f"{x:,.0f} MiB"}[kind]


def report(result: dict) -> None:
    cfg = result["config"]
    print(f"\nbundled engine vs vLLM {result.get('vllm_version', '')}: {cfg['model']}, "
          f"{cfg['dtype']}, both pinned to core {cfg['core']}, step budget "
          f"{cfg['max_num_batched_tokens']} tokens, medians of {cfg['repeats']}")
    for row in result.get("agreement", []):
        verdict = ("identical" if row["identical"] else
                   f"first divergence at token {row['first_divergence']}"
                   if row["first_divergence"] is not None else "one stops earlier")
        print(f"  greedy: {row['chat']!r}: {verdict} ({row['tokens'][0]} vs "
              f"{row['tokens'][1]} tokens; same prompt ids: {row['same_prompt_ids']})")
    if not result.get("rows"):
        return
    print("  ratio: ours/vLLM in speed (>1: ours faster); memory: ours/vLLM (<1: ours smaller)")
    print(f"  {'':52} {'ours':>11} {'vLLM':>11} {'ratio':>7}")
    for row in result["rows"]:
        goal = row["target"] and TARGETS[row["target"]]
        verdict = (f"  target >= {goal}x: {'met' if row['ratio'] >= goal else 'MISSED'}"
                   if goal else "")
        print(f"  {row['label']:52} {_value(row['kind'], row['ours']):>11} "
              f"{_value(row['kind'], row['vllm']):>11} {row['ratio']:6.2f}x{verdict}")


def run(args) -> dict:
    sizes = Sizes(args.quick)
    settings = pinned_servers.Settings(
        args.model, args.dtype, args.core, args.max_num_batched_tokens, args.max_model_len,
        args.kvcache_gib, Path(args.log_dir) if args.log_dir else None)
    for folder in (settings.log_dir, args.profile):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    result = {"config": dict(vars(args)), "vllm_version": VLLM_VERSION,
              "targets": TARGETS, "engines": {}}
    for name in args.engines:
        t0 = time.monotonic()
        profile = Path(args.profile) / f"{name}.txt" if args.profile else None
        with ENGINES[name](settings) as server:
            ready, load = time.monotonic() - t0, os.getloadavg()[0]
            with pinned_servers.profiled(server.pid, profile):
                figures = result["engines"][name] = asyncio.run(measure(server, args, sizes))
        # the machine's 1-minute load average as the engine's measurements began and ended
        figures["load_average"] = [load, os.getloadavg()[0]]
        print(f"{name}: ready in {ready:.0f} s, measured in {time.monotonic() - t0 - ready:.0f} s "
              f"(load average {load:.1f} -> {figures['load_average'][1]:.1f})", flush=True)
        save_json(result, args.out)                # what is measured survives a later failure
    engines = result["engines"]
    if "ours" in engines and "vllm" in engines:
        if "agree" in args.parts:
            result["agreement"] = agreement(engines["ours"]["agree"], engines["vllm"]["agree"],
                                            sizes.chats)
        result["rows"] = table_rows(engines)
    return result


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.vs_vllm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or a .gguf file")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--parts", default=",".join(PARTS), type=lambda s: s.split(","),
                   help=f"any of {','.join(PARTS)} (default: all)")
    p.add_argument("--engines", default="ours,vllm", type=lambda s: s.split(","),
                   help="which to run, in this order (default ours,vllm; the table needs both)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, one repeat: to see that it works, not to measure")
    p.add_argument("--tiers", type=int_list, default=None,
                   help="ttft: prompt lengths (default 512,2400,8000; --quick 256)")
    p.add_argument("--batches", type=int_list, default=None,
                   help="decode: concurrent generations (default 1,8,32; --quick 1,4)")
    p.add_argument("--core", type=int, default=1, help="the CPU both engines run on")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="both engines' step budget (chunked prefill), default 512")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kvcache-gib", type=int, default=1, help="both engines' KV cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the servers' logs go here")
    p.add_argument("--out", default=None, help="save the results as JSON here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="sample each engine's process tree with py-spy while it is measured "
                        "(collapsed stacks: DIR/ours.txt, DIR/vllm.txt; needs py-spy)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    args.tiers = args.tiers or ([256] if args.quick else [512, 2400, 8000])
    args.batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    unknown = set(args.parts) - set(PARTS) | set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown part or engine: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so the servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run_report_save(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
