"""Benchmark: the cost of one routing decision at N upstreams, per policy.

Times the gateway's own `pick()` (scorers included) on requests from the fleet trace, with
busy upstreams (random in-flight counts) and, for cache_aware, an index warmed by the
requests before. Baseline: `round_robin`'s pick in the same run. Key hashing is timed on its
own (prerender hashes token blocks once per request; the text fallback renders and hashes
the messages).

    python -m prefixgate.plugins.sim.route_bench --upstreams 64 --requests 20000

`--scenario indexes` measures instead the hit rate the cache-aware router's index gives
(oracle, exact from KV events, approximate, round robin) with 1 and 8 gateway replicas, in
the fleet simulator (`index_bench.py`).

`--scenario predicted` compares round robin, chwbl, cache_aware and predicted_ttft in the
fleet simulator, eight backends of which two at half speed, at 50-120% load
(`predicted_bench.py`), then times the decision of cache_aware and predicted_ttft at
`--upstreams` (64) with requests left unanswered for a while (`--pending` per upstream, 4),
so that predicted_ttft's queues are not empty.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import deque

from prefixgate.common.block_hash import block_hash_chain
from prefixgate.common.percentiles import percentile
from prefixgate.plugins.prefix_keys import byte_hash_chain, render
from prefixgate.plugins.sim import index_bench, predicted_bench
from prefixgate.plugins.sim.fleet_sim import EVENT_DELAY_S
from prefixgate.plugins.sim.fleet_trace import SyntheticTrace, TraceConfig
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.context import RequestContext

POLICIES = {
    "round_robin": ["round_robin"],
    "least_inflight": ["least_inflight"],
    "chwbl": [{"prefix_route": {"policy": "chwbl", "dynamic_cut": "never"}}],
    "cache_aware": [{"prefix_route": {"policy": "cache_aware", "dynamic_cut": "never"}}],
    "predicted_ttft": [{"prefix_route": {"policy": "predicted_ttft", "dynamic_cut": "never"}}],
    "chwbl+least_inflight": [{"prefix_route": {"policy": "chwbl", "dynamic_cut": "never"}},
                             {"least_inflight": {"weight": 0.1}}],
}


def bench_pick(policy: str, upstreams: int, reqs, seed: int, models: int = 1,
               pending: int = 0) -> list[float]:
    """Decision times; with `models` > 1, upstream i serves model m{i % models} and request j
    asks for m{j % models}, so the model filter runs before the scorers. A request's first
    byte comes `pending` decisions after its own (0: at once)."""
    rng = random.Random(seed)
    gw = Gateway(validate({"upstreams": [{"name": f"u{i}",
                                          "url": f"http://10.0.{i // 250}.{i % 250}:8000",
                                          "max_inflight": 10**6,
                                          "models": [f"m{i % models}"]} for i in range(upstreams)],
                           "plugins": POLICIES[policy]}))
    hooks = gw.chain.on_first_byte
    times = []
    unanswered: deque = deque()
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
        unanswered.append(ctx)
        if len(unanswered) > pending:
            answered = unanswered.popleft()
            for hook in hooks:                   # record, so cache_aware's index is warm
                hook(answered)
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
    return percentile(xs, q) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.plugins.sim.route_bench")
    p.add_argument("--scenario", choices=("pick", "indexes", "predicted"), default="pick",
                   help="pick: the cost of a decision; indexes: the hit rate per router index; "
                        "predicted: predicted_ttft against the others on mixed hardware")
    p.add_argument("--upstreams", type=int, help="default: 64 (pick), 8 (indexes)")
    p.add_argument("--requests", type=int, help="default: 20,000 (pick, predicted), 10,000 "
                   "(indexes)")
    p.add_argument("--quick", action="store_true", help="a small run, for tests")
    p.add_argument("--policies", default=",".join(POLICIES), help="pick: the policies timed")
    p.add_argument("--models", type=int, default=1, help="pick: models served (upstreams "
                   "split evenly); more than 1 times the model filter too")
    p.add_argument("--replicas", default="1,8", help="indexes: gateway replica counts")
    p.add_argument("--event-delay-s", type=float, default=EVENT_DELAY_S,
                   help="indexes: from an engine's cache change to the exact indexes")
    p.add_argument("--local-load", action="store_true", help="indexes: each replica sees "
                   "only its own in-flight requests (default: the backends' load)")
    p.add_argument("--pending", type=int, default=4, help="predicted: requests per upstream "
                   "routed and not yet answered while decisions are timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", "--out", dest="json", help="save results and settings to this file")
    args = p.parse_args(argv)
    if args.scenario == "indexes":
        return _indexes(args)
    args.upstreams = args.upstreams or 64
    args.requests = args.requests or (2000 if args.quick else 20_000)
    if args.scenario == "predicted":
        return _predicted(args)
    reqs = _pick_requests(args)
    results = {}
    for policy in args.policies.split(","):
        t = bench_pick(policy, args.upstreams, reqs, args.seed, args.models)
        warm = t[len(t) // 10:]                  # the first tenth warms the index
        results[policy] = {"pick_us_p50": _us(warm, 50), "pick_us_p95": _us(warm, 95),
                           "pick_us_p99": _us(warm, 99)}
    base = results.get("round_robin", {}).get("pick_us_p50")
    for policy, r in results.items():
        ratio = f"  ({r['pick_us_p50'] / base:.1f}x round_robin)" if base else ""
        print(f"{policy:>22}: pick p50 {r['pick_us_p50']:6.1f} us  p95 {r['pick_us_p95']:6.1f} us"
              f"  p99 {r['pick_us_p99']:6.1f} us{ratio}  at {args.upstreams} upstreams x "
              f"{args.models} model(s)")
    keys = bench_keys(reqs[:2000])
    print(f"{'keys':>22}: token chain p50 {keys['token_chain_us_p50']:.1f} us, text chain p50 "
          f"{keys['text_chain_us_p50']:.1f} us "
          f"(median prompt {keys['prompt_tokens_p50']:.0f} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "pick": results, "keys": keys}, f, indent=2)
    return 0


def _pick_requests(args) -> list:
    return list(SyntheticTrace(TraceConfig(requests=args.requests, seed=args.seed, rate=5.0,
                                           long_tokens=(4000, 8000))))


def _predicted(args) -> int:
    bench = predicted_bench.run(args.requests, seed=args.seed,
                                progress=lambda line: print(line, flush=True))
    print(predicted_bench.table(bench))
    reqs = _pick_requests(args)
    pick = {}
    for policy in ("cache_aware", "predicted_ttft"):
        t = bench_pick(policy, args.upstreams, reqs, args.seed,
                       pending=args.pending * args.upstreams)[len(reqs) // 10:]
        pick[policy] = {"pick_us_p50": _us(t, 50), "pick_us_p99": _us(t, 99)}
        print(f"decision at {args.upstreams} upstreams, {args.pending} unanswered each: "
              f"{policy} p50 {pick[policy]['pick_us_p50']:.1f} us, "
              f"p99 {pick[policy]['pick_us_p99']:.1f} us")
    bench["pick"] = {"upstreams": args.upstreams, "pending": args.pending, **pick}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench, f, indent=2)
    return 0


def _indexes(args) -> int:
    bench = index_bench.run(args.upstreams or 8, [int(n) for n in args.replicas.split(",")],
                            args.requests, args.quick, args.seed, args.event_delay_s,
                            args.local_load, progress=lambda line: print(line, flush=True))
    print(index_bench.table(bench))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
