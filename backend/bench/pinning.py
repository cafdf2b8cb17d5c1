"""cache_control pins under a flood: `python -m prefixgate.backend.bench.pinning`.

One bundled engine (`prefixgate backend`, pinned to `--cores` with taskset) with a KV cache too
small for the traffic. Each round, over /v1/messages:
  1. a marked prefix (a system prompt whose text block carries `cache_control`, ttl 5m) and an
     unmarked one of the same length are each sent once (their first turn);
  2. a flood of other prompts, `--flood` times the KV cache's tokens, overflows the cache;
  3. each prefix's next turn (its history plus one more user message), streamed: its hit rate
     (cache_read_input_tokens over its prompt tokens) and its TTFT;
  4. the same next turn of a prefix never sent (a cold prompt of the same shape): the TTFT of
     recomputing it.
Rounds use fresh prefixes and alternate which next turn goes first. Prints medians over the
rounds (hit rate and TTFT, marked vs unmarked vs recomputing) and the engine's pin metrics;
`--out FILE` saves them with every sample as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import uuid

import aiohttp

from prefixgate.backend.bench.completions import timed_events
from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.backend.bench.script import THREADS_HELP, run_report_save
from prefixgate.backend.bench.vocab import MODEL_HELP
from prefixgate.backend.config import resolve_model
from prefixgate.common.tokenizer import Tokenizer

SERVED = "bench"
MARK = {"type": "ephemeral", "ttl": "5m"}
FIRST, REPLY, NEXT = "Here is the task. Start.", "Done; what next?", "Now the second step."
WORDS = ("the engine keeps every block a client marked while its time lasts and the flood of "
         "other prompts takes the rest of the cache in least recently used order so a long "
         "session comes back to find its history where it left it").split()


class Texts:
    """Texts of a given number of the model's tokens, each starting with a fresh tag."""

    def __init__(self, model: str, seed: int):
        self.tok = Tokenizer.load(resolve_model(model))
        self.seed = seed
        self.n = 0

    def __call__(self, tokens: int) -> str:
        self.n += 1
        words = [WORDS[(self.seed * 7919 + self.n * 104729 + i * i) % len(WORDS)]
                 for i in range(2 * tokens)]
        ids = self.tok.encode(" ".join(words), add_special_tokens=False)[:tokens]
        return uuid.uuid4().hex[:8] + " " + self.tok.decode(ids)


def turns(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
            for i, t in enumerate(texts)]


def body(system: str, marked: bool, messages: list[dict]) -> dict:
    block = {"type": "text", "text": system, **({"cache_control": MARK} if marked else {})}
    return {"model": SERVED, "max_tokens": 1, "temperature": 0, "system": [block],
            "messages": messages, "stream": True}


async def send(session, url: str, request: dict) -> dict:
    """One streamed Messages request read to its end: TTFT (the first event comes with the
    first token) and the final usage."""
    ttft, usage = None, {}
    async for elapsed, event in timed_events(session, url, "/v1/messages", request):
        ttft = ttft if ttft is not None else elapsed
        if event.get("type") == "message_delta":
            usage = event.get("usage") or usage
    read = usage.get("cache_read_input_tokens") or 0
    prompt = usage.get("input_tokens", 0) + read + (usage.get("cache_creation_input_tokens") or 0)
    return {"ttft_s": ttft, "prompt_tokens": prompt, "cache_read": read,
            "cache_creation": usage.get("cache_creation_input_tokens"),
            "hit_rate": read / prompt if prompt else 0.0}


async def one_round(session, url: str, args, texts: Texts, r: int) -> dict:
    prefixes = {"marked": texts(args.prefix_tokens), "unmarked": texts(args.prefix_tokens)}
    first = {arm: await send(session, url, body(p, arm == "marked", turns(FIRST)))
             for arm, p in prefixes.items()}
    flood_tokens = 0
    while flood_tokens < args.flood * args.kv_blocks * args.block_size:
        sent = await send(session, url, body(texts(args.flood_tokens), False, turns(FIRST)))
        flood_tokens += sent["prompt_tokens"]
    order = ["marked", "unmarked"] if r % 2 == 0 else ["unmarked", "marked"]
    nxt = {arm: await send(session, url, body(prefixes[arm], arm == "marked",
                                               turns(FIRST, REPLY, NEXT)))
           for arm in order}
    nxt["recompute"] = await send(session, url, body(texts(args.prefix_tokens), False,
                                                     turns(FIRST, REPLY, NEXT)))
    return {"first": first, "flood_tokens": flood_tokens, "next": nxt}


async def pin_metrics(session, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("prefixgate:cache_pin"):
            out[name] = float(value)
    return out


async def run(args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 1)}
    engine = engine_process(args.model, "--served-model-name", SERVED, "--device", "cpu",
                            "--block-size", str(args.block_size), "--num-kv-blocks",
                            str(args.kv_blocks), "--log-level", "warning", *args.engine_flag,
                            cores=args.cores, env=env, inherit_output=True)
    texts = Texts(args.model, args.seed)
    rounds = []
    try:
        await engine.start().ready(300)
        async with aiohttp.ClientSession() as s:
            await send(s, engine.url, body(texts(args.prefix_tokens), False, turns(FIRST)))
            for r in range(args.rounds):
                rounds.append(await one_round(s, engine.url, args, texts, r))
            metrics = await pin_metrics(s, engine.url)
    finally:
        await engine.close()
    return summarize(args, rounds, metrics)


def summarize(args, rounds: list[dict], metrics: dict) -> dict:
    arms = {}
    for arm in ("marked", "unmarked", "recompute"):
        xs = [r["next"][arm] for r in rounds]
        arms[arm] = {"hit_rate_median": statistics.median(x["hit_rate"] for x in xs),
                     "ttft_median_ms": statistics.median(x["ttft_s"] for x in xs) * 1e3,
                     "prompt_tokens": statistics.median(x["prompt_tokens"] for x in xs)}
    pinned = [r["first"]["marked"]["cache_creation"] for r in rounds]
    return {"config": vars(args), "arms": arms, "pinned_tokens_median": statistics.median(pinned),
            "flood_tokens_median": statistics.median(r["flood_tokens"] for r in rounds),
            "ttft_speedup": arms["recompute"]["ttft_median_ms"] / arms["marked"]["ttft_median_ms"],
            "metrics": metrics, "rounds": rounds}


def report(r: dict) -> None:
    c, a = r["config"], r["arms"]
    cache = c["kv_blocks"] * c["block_size"]
    print(f"cache_control pins: {c['model']}, a {cache}-token KV cache ({c['kv_blocks']} blocks), "
          f"{c['prefix_tokens']}-token prefixes, a flood of {r['flood_tokens_median']:.0f} tokens "
          f"per round, {c['rounds']} rounds (medians)")
    print(f"  {'next turn':<28}{'prompt':>8}{'hit rate':>10}{'TTFT ms':>10}")
    for arm, label in (("marked", "marked (cache_control, 5m)"), ("unmarked", "unmarked"),
                       ("recompute", "recomputing (never sent)")):
        x = a[arm]
        print(f"  {label:<28}{x['prompt_tokens']:8.0f}{x['hit_rate_median']:10.0%}"
              f"{x['ttft_median_ms']:10.1f}")
    print(f"  marked next turn TTFT: {r['ttft_speedup']:.2f}x faster than recomputing; "
          f"pinned per marked prefix: {r['pinned_tokens_median']:.0f} tokens")
    print("  " + json.dumps(r["metrics"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.pinning",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks (default: "
                   "%(default)s, 4,096 tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--flood-tokens", type=int, default=768, help="tokens per flood prompt")
    p.add_argument("--flood", type=float, default=2.0,
                   help="flood tokens per round, in KV caches (default %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cores", default="0", help="taskset cores for the engine (default 0)")
    p.add_argument("--engine-flag", action="append", default=[], metavar="FLAG",
                   help="one more engine flag (repeat; e.g. --engine-flag=--cache-pin-fraction"
                   " --engine-flag=0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--quick", action="store_true", help="2 rounds of 256-token prefixes")
    p.add_argument("--out", default=None, help="save results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.prefix_tokens, args.flood_tokens, args.kv_blocks = 2, 256, 256, 64
    return run_report_save(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
