"""Benchmark: the cost of one routing decision at N upstreams, per policy.

Times the gateway's own `pick()` (scorers included) on requests from the fleet trace, with
busy upstreams (random in-flight counts) and, for cache_aware, an index warmed by the
requests before. Baseline: `round_robin`'s pick in the same run. Key hashing is timed on its
own (prerender hashes token blocks once per request; the text fallback renders and hashes
the messages).

    python -m prefixgate.plugins.sim.route_bench --upstreams 64 --requests 20000
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config import validate
from prefixgate.proxy.context import RequestContext

from prefixgate.plugins.sim.fleet_trace import Trace, TraceConfig
from prefixgate.plugins.prefix_keys import block_hash_chain, byte_hash_chain, render

POLICIES = {
    "round_robin": ["round_robin"],
    "least_inflight": ["least_inflight"],
    "chwbl": [{"prefix_route": {"policy": "chwbl", "dynamic_cut": "never"}}],
    "cache_aware": [{"prefix_route": {"policy": "cache_aware", "dynamic_cut": "never"}}],
    "chwbl+least_inflight": [{"prefix_route": {"policy": "chwbl", "dynamic_cut": "never"}},
                             {"least_inflight": {"weight": 0.1}}],
}


def bench_pick(policy: str, upstreams: int, reqs, seed: int, models: int = 1) -> list[float]:
    """Decision times; with `models` > 1, upstream i serves model m{i % models} and request j
    asks for m{j % models}, so the model filter runs before the scorers."""
    rng = random.Random(seed)
    gw = Gateway(validate({"upstreams": [{"name": f"u{i}", "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                                          "max_inflight": 10**6,
                                          "models": [f"m{i % models}"]} for i in range(upstreams)],
                           "plugins": POLICIES[policy]}))
    hooks = gw.chain.on_first_byte
    times = []
    for j, req in enumerate(reqs):
        for u in gw.upstreams:
            u.inflight = rng.randrange(0, 48)
        ctx = RequestContext(request_id="", path="/v1/chat/completions", body={}, headers={},
                             model=f"m{j % models}")
        ctx.tokens, ctx.block_hashes = req.tokens, req.chain     # as prerender leaves them
        ctx.block_tokens = 16
        t0 = time.perf_counter()
        ctx.upstream = gw.decide(ctx)
        times.append(time.perf_counter() - t0)
        for hook in hooks:                       # record, so cache_aware's index is warm
            hook(ctx)
    return times


def bench_keys(reqs) -> dict:
    tok, text = [], []
    for req in reqs:
        ids = req.tokens.tolist()
        t0 = time.perf_counter()
        block_hash_chain(ids, 16, 512)
        tok.append(time.perf_counter() - t0)
        body = {"messages": [{"role": "system", "content": "x" * (len(ids) * 4 // 2)},
                             {"role": "user", "content": "y" * (len(ids) * 4 // 2)}]}
        t0 = time.perf_counter()
        byte_hash_chain(render(body, None)[0], 64, 512)
        text.append(time.perf_counter() - t0)
    return {"token_chain_us_p50": _us(tok, 50), "text_chain_us_p50": _us(text, 50),
            "prompt_tokens_p50": statistics.median(len(r.tokens) for r in reqs)}


def _us(xs, q) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))] * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.plugins.sim.route_bench")
    p.add_argument("--upstreams", type=int, default=64)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--models", type=int, default=1, help="models served (upstreams split "
                   "evenly); more than 1 times the model filter too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="save results to this file")
    args = p.parse_args(argv)
    reqs = list(Trace(TraceConfig(requests=args.requests, seed=args.seed, rate=5.0,
                                  long_tokens=(4000, 8000))))
    results = {}
    for policy in args.policies.split(","):
        t = bench_pick(policy, args.upstreams, reqs, args.seed, args.models)
        warm = t[len(t) // 10:]                  # the first tenth warms the index
        results[policy] = {"pick_us_p50": _us(warm, 50), "pick_us_p99": _us(warm, 99)}
    base = results.get("round_robin", {}).get("pick_us_p50")
    for policy, r in results.items():
        ratio = f"  ({r['pick_us_p50'] / base:.1f}x round_robin)" if base else ""
        print(f"{policy:>22}: pick p50 {r['pick_us_p50']:6.1f} us  p99 {r['pick_us_p99']:6.1f} us"
              f"{ratio}  at {args.upstreams} upstreams x {args.models} model(s)")
    keys = bench_keys(reqs[:2000])
    print(f"{'keys':>22}: token chain p50 {keys['token_chain_us_p50']:.1f} us, text chain p50 "
          f"{keys['text_chain_us_p50']:.1f} us (median prompt {keys['prompt_tokens_p50']:.0f} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "pick": results, "keys": keys}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
