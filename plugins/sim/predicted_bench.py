"""Benchmark: routing by predicted TTFT against the affinity and load policies, on mixed
hardware, in the fleet simulator.

Eight backends, two of which prefill at half speed (`SPEEDS`); the trace's tenants are
Zipf-popular system prompts and documents under chat sessions, RAG and one-shot requests
(fleet_trace.py's default mix). Load is the offered prompt work if nothing were cached, as a
fraction of the fleet's prefill capacity (the half-speed backends count for half), at 50, 80,
100 and 120%. Per policy and load: TTFT p50/p95/p99, the token hit rate, goodput (the share
of requests whose TTFT meets the SLO) and, for predicted_ttft, the median prediction error
once each backend answered its first 50 requests.

    python -m prefixgate.plugins.sim.route_bench --scenario predicted [--quick] [--out FILE]
"""
from __future__ import annotations

from dataclasses import asdict

import numpy as np

from prefixgate.plugins.sim.fleet_sim import CostModel, FleetSim, rate_for
from prefixgate.plugins.sim.fleet_trace import TraceConfig

POLICIES = ("round_robin", "chwbl", "cache_aware", "predicted_ttft")
LOADS = (0.5, 0.8, 1.0, 1.2)
SPEEDS = (1.0,) * 6 + (0.5,) * 2
SLO_S = 0.5                 # the metrics plugin's default slo_ttft_ms


def run(requests: int = 20_000, loads=LOADS, policies=POLICIES, speeds=SPEEDS,
        slo_s: float = SLO_S, seed: int = 0, progress=None) -> dict:
    cost = CostModel()
    results = []
    for load in loads:
        trace = TraceConfig(requests=requests, seed=seed)
        trace.rate = rate_for(load, sum(speeds), cost, trace)
        for policy in policies:
            sim = FleetSim(len(speeds), policy, trace, cost, seed=seed, speeds=list(speeds))
            r = sim.run()
            r.update(load=load, goodput=float(np.mean(np.array(sim.ttft) <= slo_s)))
            results.append(r)
            if progress is not None:
                progress(_line(r))
    settings = {"backends": len(speeds), "speeds": list(speeds), "loads": list(loads),
                "slo_s": slo_s, "seed": seed, "trace": asdict(TraceConfig(requests=requests,
                                                                          seed=seed)),
                "cost": asdict(cost)}
    return {"settings": settings, "results": results}


def _line(r: dict) -> str:
    return (f"load {r['load']:4.0%} {r['policy']:>15}: TTFT p50 {r['ttft_p50_s'] * 1e3:7.1f} ms "
            f"p95 {r['ttft_p95_s'] * 1e3:7.1f} ms p99 {r['ttft_p99_s'] * 1e3:7.1f} ms  hit "
            f"{r['hit_rate']:.1%}  goodput {r['goodput']:.1%}  ({r['wall_seconds']:.0f} s)")


def table(bench: dict) -> str:
    s = bench["settings"]
    head = (f"{s['backends']} backends (speeds {', '.join(f'{x:g}' for x in s['speeds'])}), "
            f"{s['trace']['requests']:,} requests, SLO {s['slo_s'] * 1e3:g} ms")
    lines = [head, "| load | policy | TTFT p50 | p95 | p99 | hit rate | goodput | "
                   "p95 vs cache_aware | hit vs cache_aware | prediction error p50 |",
             "|---" * 10 + "|"]
    base = {r["load"]: r for r in bench["results"] if r["policy"] == "cache_aware"}
    for r in bench["results"]:
        ca = base.get(r["load"])
        vs = (f"{r['ttft_p95_s'] / ca['ttft_p95_s']:.2f}x", f"{r['hit_rate'] / ca['hit_rate']:.2f}x"
              ) if ca else ("", "")
        err = r["prediction_error_p50"]
        lines.append(f"| {r['load']:.0%} | {r['policy']} | {r['ttft_p50_s'] * 1e3:.1f} ms | "
                     f"{r['ttft_p95_s'] * 1e3:.1f} ms | {r['ttft_p99_s'] * 1e3:.1f} ms | "
                     f"{r['hit_rate']:.1%} | {r['goodput']:.1%} | {vs[0]} | {vs[1]} | "
                     + (f"{err:.1%}" if err is not None else "") + " |")
    return "\n".join(lines)
