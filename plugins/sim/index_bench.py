"""Benchmark: the prefix-cache hit rate each index gives the cache-aware router, as gateway
replicas are added.

Policies (`fleet_sim.py`'s names), all but round robin the same cache_aware scorer with the
same balance knobs and load view, so only the index differs (`route_indexes.py`):

    oracle       asks every engine's block manager: the ceiling for this scorer's choices
                 (greedy ones, so a run whose choices part from it may end slightly above)
    exact        a KVEventIndex per replica, fed by every engine's KV events
    approximate  (cache_aware) a PrefixIndex per replica, of the requests that replica routed
    round_robin  the floor

A load balancer hands each request to one of N gateway replicas at random. Hit rate = cached
prompt tokens / prompt tokens, counted by the engines' block managers.

Workload: tenants are Zipf-popular system prompts (400 of 0.5-4k tokens, s = 1.0, ~680k
tokens in all) under multi-turn chat sessions (half the requests; each turn's prompt is the
whole history) and one-shot requests (half). A backend's KV holds 4,096 blocks (65k tokens)
and the fleet's 524k tokens, less what running requests use, cannot hold every tenant even
once, so where each tenant goes decides the hit rate. Load: 0.8 of the fleet's prefill
capacity if nothing were cached; every replica sees the backends' load (as with
`poll_metrics_s`), or only its own in-flight requests with `local_load`.

    python -m prefixgate.plugins.sim.route_bench --scenario indexes [--quick] [--out FILE]
"""
from __future__ import annotations

from dataclasses import asdict

from prefixgate.plugins.sim.fleet_sim import EVENT_DELAY_S, CostModel, FleetSim, rate_for
from prefixgate.plugins.sim.fleet_trace import TraceConfig

POLICIES = {"oracle": "oracle", "exact": "exact", "approximate": "cache_aware",
            "round_robin": "round_robin"}       # row name -> fleet_sim policy
LOAD = 0.8


def workload(requests: int | None, quick: bool, seed: int) -> tuple[TraceConfig, CostModel]:
    """The trace and the backends' cost model (--quick: half the tenants and the KV)."""
    tenants, kv_blocks, default_requests = (200, 2048, 2000) if quick else (400, 4096, 10_000)
    trace = TraceConfig(requests=requests or default_requests, seed=seed,
                        mix=(("chat", 0.5), ("oneshot", 0.5)), system_prompts=tenants,
                        system_zipf=1.0, system_tokens=(500, 4000))
    return trace, CostModel(kv_blocks=kv_blocks)


def run(backends: int = 8, replicas=(1, 8), requests: int | None = None, quick: bool = False,
        seed: int = 0, event_delay_s: float = EVENT_DELAY_S, local_load: bool = False,
        progress=None) -> dict:
    trace, cost = workload(requests, quick, seed)
    trace.rate = rate_for(LOAD, backends, cost, trace)
    results = []
    for n in replicas:
        for row, policy in POLICIES.items():
            r = FleetSim(backends, policy, trace, cost, seed=seed, replicas=n,
                         shared_load=not local_load, balancer="random",
                         event_delay_s=event_delay_s, measure_agreement=False).run()
            results.append({"row": row, **r})
            if progress is not None:
                progress(f"{row:>12} x {n} replica(s): hit {r['hit_rate']:.1%} "
                         f"({r['wall_seconds']:.1f} s)")
    settings = {"backends": backends, "replicas": list(replicas), "load": LOAD,
                "balancer": "random", "shared_load": not local_load,
                "event_delay_s": event_delay_s, "seed": seed, "quick": quick,
                "trace": asdict(trace), "cost": asdict(cost)}
    return {"settings": settings, "results": results, "summary": summarize(results)}


def summarize(results: list[dict]) -> dict:
    """replicas -> row -> hit rate and its fraction of the oracle's (at those replicas)."""
    out: dict = {}
    for r in results:
        out.setdefault(str(r["replicas"]), {})[r["row"]] = {"hit_rate": r["hit_rate"]}
    for rows in out.values():
        oracle = rows["oracle"]["hit_rate"]
        for row in rows.values():
            row["of_oracle"] = row["hit_rate"] / oracle
    return out


def table(bench: dict) -> str:
    s = bench["settings"]
    counts = list(bench["summary"])
    head = (f"{s['backends']} backends, {s['trace']['requests']:,} requests, "
            f"{s['trace']['system_prompts']} tenants, {s['cost']['kv_blocks']:,} KV blocks "
            f"each, event delay {s['event_delay_s'] * 1e3:g} ms, "
            f"{'shared' if s['shared_load'] else 'local'} load view")
    lines = [head, "| policy | " + " | ".join(f"{n} replica{'s' if n != '1' else ''}: hit rate "
                                              f"| of oracle" for n in counts) + " |",
             "|---" * (1 + 2 * len(counts)) + "|"]
    for row in POLICIES:
        cells = []
        for n in counts:
            r = bench["summary"][n][row]
            cells += [f"{r['hit_rate']:.1%}", f"{r['of_oracle']:.1%}"]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
