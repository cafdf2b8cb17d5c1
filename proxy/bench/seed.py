"""`prefixgate bench --scenario seed`: the TTFT staircase, reproduced on this machine.

The published experiment this follows cut p95 TTFT from 1850 to 425 ms (-77%) by fixing,
one after another, what sat in front of the model's arithmetic. Here the same steps run
against two bundled engines behind the gateway (on the demo model unless `--model` names
another, e.g. smollm2), stage by stage, each stage adding one fix to the one before (engines
restarted, so no stage inherits a cache; `--engine vllm` runs them on real vLLM servers
instead, with SGLang's router beside them: vllm_fleet.py):

    baseline           no normalize, no prefix cache, no chunked prefill, round robin
    +normalize         the timestamp at the head of the system prompt moves to the tail
    +prefix cache      engines reuse the KV of prompt prefixes they computed before
    +chunked prefill   long prefills are split so they do not stall other requests
    +affinity routing  requests go to the engine that holds their prefix (prefix_route)
    +KV offload tier   the engines keep prefixes evicted from their KV cache in a second
                       tier (`--kv-offloading-size`) and load them back instead of
                       recomputing them: a tenant's prefix is computed once per engine
    +PD disaggregation one prefill and one decode engine instead of the two mixed ones (same
                       cores): prefills no longer stall decodes; the prefill engine holds
                       every tenant's prefix (its cache and its second tier)

The workload, scaled to CPU: fixed-length prompts whose first 80% is one of several
tenants' system prompts with tool definitions, headed by the current time; the rest is per
request. A fixed number of users (closed loop), each pausing between a response and its
next request; fixed output length. The load is set where the published baseline ran: near
saturation, its p95 TTFT about 1.9 s. Each engine's KV cache holds the prefixes of about
3/4 of the tenants (as a production cache holds a fraction of its tenants' prompts), so
where a request lands matters.

Why pauses: with users sending back to back (`--think-ms 0`) every stage runs saturated,
and TTFT then only tracks the engine work per request, which a prefix cache cuts to the
uncached ~27% of the prompt here: about -73% at best. With pauses, as with real users, the
fixes also drain the queue the baseline builds, as they did in the published experiment.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import sys
from dataclasses import asdict, dataclass

from prefixgate.backend.config import served_name
from prefixgate.common.percentiles import percentile
from prefixgate.common.runtime import start_app
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.prompts import Lengths, PromptSet, PromptSpec, words
from prefixgate.proxy.bench.stats import (
    WARM_REQUESTS,
    fmt,
    prediction_errors,
    reduction,
    summarize,
)
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.doctor import scrape as pm


@dataclass
class Stage:
    name: str
    normalize: bool
    prefix_cache: bool
    chunked_prefill: bool
    routing: str                     # a routing plugin: round_robin or prefix_route
    pd: bool = False                 # one prefill + one decode engine (`pd: prefixgate`)
    kv_offload: bool = False         # a second KV tier behind each engine's cache

    def roles(self, w: Workload) -> list[str]:
        return ["prefill", "decode"] if self.pd else ["both"] * w.engines

    def engine_args(self, w: Workload) -> list[str]:
        args = ["--num-kv-blocks", str(w.kv_blocks()), "--max-num-seqs", str(w.concurrency),
                "--max-num-batched-tokens", str(w.batched_tokens), "--log-level", "warning"]
        if not self.prefix_cache:
            args.append("--no-prefix-caching")
        if not self.chunked_prefill:
            args.append("--no-chunked-prefill")
        if self.kv_offload:
            args += ["--kv-offloading-size", str(w.kv_offloading_size)]
        return args

    def plugins(self, w: Workload) -> list[dict]:
        chain = [{"normalize": {}}] if self.normalize else []
        route = {"policy": w.policy}
        if w.policy == "cache_aware":
            route["balance_abs_threshold"] = w.balance_abs
        if self.reads_kv_events(w):
            # the engines' own reports of their caches, keyed by token blocks of their size
            chain.append({"prerender": {}})
            route.update(index="kv_events", block_tokens=w.block_size)
        chain.append({"prefix_route": route} if self.routing == "prefix_route"
                     else {"round_robin": {}})
        return chain + [{"metrics": {}}]

    def reads_kv_events(self, w: Workload) -> bool:
        """Whether the stage's router keys on what the engines report holding."""
        return self.routing == "prefix_route" and w.index == "kv_events"


STAGES = [
    Stage("baseline", False, False, False, "round_robin"),
    Stage("+normalize", True, False, False, "round_robin"),
    Stage("+prefix cache", True, True, False, "round_robin"),
    Stage("+chunked prefill", True, True, True, "round_robin"),
    Stage("+affinity routing", True, True, True, "prefix_route"),
    Stage("+KV offload tier", True, True, True, "prefix_route", kv_offload=True),
    Stage("+PD disaggregation", True, True, True, "prefix_route", pd=True, kv_offload=True),
]


SLOW_STEP_TOKENS = 32


@dataclass
class Workload:
    prompt_tokens: int = 1024        # whole prompt, chat template included
    shared: float = 0.8              # system prompt + tools (timestamp at its head)
    tenants: int = 16                # distinct system prompts + tool sets
    concurrency: int = 12            # users (closed loop), over both engines
    think_ms: float = 1500.0         # each user's mean pause between requests (exponential);
                                     # 12 users x 1.5 s put the baseline near saturation
    requests: int = 60               # measured per stage and round
    warmup: int = 48                 # per stage and round, not measured: each tenant three
                                     # times (the first visits all answered before the users
                                     # start, see run_stage)
    max_tokens: int = 8              # fixed output length (ignore_eos)
    engines: int = 2
    engine_threads: int = 1          # torch threads per engine: engines x threads <= cores
    batched_tokens: int = 512        # engine step budget
    cached_tenants: float = 0.75     # fraction of all tenants' prefixes one engine's KV holds
    kv_offloading_size: float = 1.0  # GiB of second tier per engine (last stages): every
                                     # tenant's prefix, 0.6 GiB in SmolLM2's fp32 KV (45 KB
                                     # a token), 0.08 GiB in the demo's
    policy: str = "cache_aware"      # prefix_route policy for the last stage
    balance_abs: float = 8           # cache_aware: in-flight gap that counts as imbalance;
                                     # a spilled request recomputes its whole prefix, which
                                     # on one core costs more than waiting a few requests
    rounds: int = 2                  # runs of every stage, interleaved, samples pooled
    seed: int = 0
    block_size: int = 16             # the engines' KV block, in tokens
    index: str = "approximate"       # prefix_route's index in the affinity stage
    slow_engine: bool = False        # the second engine prefills at about half speed

    def instance_args(self) -> list[list[str]] | None:
        """Per engine flags: with `slow_engine`, a step budget of SLOW_STEP_TOKENS for the
        second, which pays a CPU step's fixed cost (about 30 tokens' worth) that often."""
        return [[], ["--max-num-batched-tokens", str(SLOW_STEP_TOKENS)]] if self.slow_engine \
            else None

    def kv_blocks(self) -> int:
        """Per engine: the prefixes of `cached_tenants` of the tenants next to the in-flight
        requests' own blocks, and never less than every in-flight prompt whole (so the
        stages without a prefix cache are not starved of KV)."""
        per_prompt = -(-self.prompt_tokens // self.block_size) + 1
        prefix = int(self.prompt_tokens * self.shared) // self.block_size
        cached = int(self.tenants * self.cached_tenants * prefix)
        return max(self.concurrency * per_prompt,
                   cached + self.concurrency * (per_prompt - prefix))


def tools_for(tenant: int, prompt_tokens: int) -> list[dict]:
    """A tenant's tool definitions: up to three (one per 250 prompt tokens)."""
    rng = random.Random(f"tools{tenant}")
    names = ("search", "lookup", "update")[:max(1, min(3, prompt_tokens // 250))]
    return [{"type": "function", "function": {
        "name": f"tenant{tenant}_{name}", "description": words(rng, 8),
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": words(rng, 4)}},
            "required": ["query"]}}} for name in names]


class SeedPrompts:
    """Request i: a tenant's system prompt + tools (with the time at its head) and a
    per-request user message; the tenant is drawn at random so no router sees a pattern."""

    def __init__(self, w: Workload, lengths: Lengths):
        self.w = w
        self.sets = [PromptSet(PromptSpec(w.prompt_tokens, w.shared, dynamic_head=True,
                                          tools=tools_for(t, w.prompt_tokens),
                                          seed=w.seed * 1000 + t), lengths)
                     for t in range(w.tenants)]

    def body(self, i: int) -> dict:
        """Warm-up requests (i < warmup of each round) visit the tenants in turn, so every
        stage starts measuring from the same steady state; measured ones draw at random."""
        per_round = self.w.warmup + self.w.requests
        if i % per_round < self.w.warmup:
            tenant = i % per_round % self.w.tenants
        else:
            tenant = random.Random(f"{self.w.seed}:tenant:{i}").randrange(self.w.tenants)
        return self.sets[tenant].body(i)


def parse_workload(args, w: Workload | None = None) -> Workload:
    """`w` (default: the bundled engines' workload) with the command line's overrides."""
    w = w or Workload()
    if args.quick:
        w.requests, w.rounds = 30, 1
    w = target.given(w, requests=args.requests, warmup=args.warmup, max_tokens=args.max_tokens,
                     seed=args.seed, rounds=args.rounds, policy=args.policy,
                     think_ms=args.think_ms, slow_engine=args.slow_engine or None,
                     concurrency=target.first(args.concurrency),
                     prompt_tokens=target.first(args.tiers))
    return w


class Fleet:
    """What runs a stage: its engines (bundled engine processes, or `launcher`'s: stand-ins
    in tests) and what sits in front of them (prefixgate's gateway with the stage's plugins).
    `vllm_fleet.VLLMFleet` runs vLLM servers instead."""

    engine = "bundled"
    stages = STAGES
    named_only: list[Stage] = []         # stages run only when `--stages` names them

    def __init__(self, launcher=None):
        self.launcher = launcher

    def workload(self) -> Workload:
        return Workload()

    def engine_args(self, stage: Stage, w: Workload) -> list[str]:
        return stage.engine_args(w)

    def launcher_for(self, stage: Stage, w: Workload):
        """Makes the stage's engines from a BundledEngines-like mapping (None: bundled)."""
        return self.launcher

    def gateway_config(self, stage: Stage, w: Workload, engines, timeout: float,
                       model: str) -> dict:
        return target.engines_config(engines, stage.roles(w), stage.plugins(w), timeout)

    @contextlib.asynccontextmanager
    async def front(self, stage: Stage, w: Workload, engines, timeout: float, model: str):
        """The stage's router in front of `engines`: yields its base URL and its config."""
        raw = self.gateway_config(stage, w, engines, timeout, model)
        runner = None
        try:
            gateway = Gateway(config_mod.validate(raw))
            runner, url = await start_app(gateway.make_app(), "127.0.0.1", 0)
            yield url, raw
        finally:
            if runner is not None:
                await runner.cleanup()

    def report(self, archive: dict) -> None:
        print_staircase(archive)


def run_seed(args, fleet: Fleet | None = None) -> int:
    fleet = fleet or Fleet()
    w = parse_workload(args, fleet.workload())
    stages = fleet.stages if not args.stages else [
        s for s in fleet.stages + fleet.named_only if s.name.lstrip("+") in args.stages]
    return target.run_scenario(
        args, lambda lengths: run_stages(w, stages, lengths, args, fleet=fleet), fleet.report)


async def run_stages(w: Workload, stages: list[Stage], lengths: Lengths, args,
                     launcher=None, fleet: Fleet | None = None) -> dict:
    """Every stage, `w.rounds` times over (stages interleaved, so a slow spell of a shared
    machine spreads over all of them); samples of a stage's rounds are pooled."""
    fleet = fleet or Fleet(launcher)
    prompts = SeedPrompts(w, lengths)
    model = target.scenario_model(args)
    runs: dict[str, list[dict]] = {s.name: [] for s in stages}
    per_round = w.warmup + w.requests
    for r in range(w.rounds):
        for n, stage in enumerate(stages, 1):
            print(f"[round {r + 1}/{w.rounds}, stage {n}/{len(stages)}] {stage.name}: "
                  f"starting {w.engines} {fleet.engine} engines "
                  f"({' '.join(fleet.engine_args(stage, w))})", file=sys.stderr, flush=True)
            runs[stage.name].append(await run_stage(stage, w, prompts, args.timeout,
                                                    offset=r * per_round, model=model,
                                                    fleet=fleet))
    slo_s = args.slo_ttft_ms / 1000.0
    return {"schema": archive_mod.SCHEMA, "kind": "seed",
            "config": {"scenario": "seed", "engine": fleet.engine, "model": model,
                       "max_tokens": w.max_tokens,
                       "lengths": "exact", "slo_ttft_ms": args.slo_ttft_ms,
                       "workload": asdict(w), "kv_blocks_per_engine": w.kv_blocks(),
                       "prompt_tokens_built": prompts.sets[0].measured_tokens(prompts.body(0))},
            "environment": archive_mod.environment(),
            "cells": [stage_cell(s, w, runs[s.name], slo_s, fleet) for s in stages]}


async def run_stage(stage: Stage, w: Workload, prompts: SeedPrompts, timeout: float,
                    launcher=None, offset: int = 0, model: str = "demo",
                    fleet: Fleet | None = None) -> dict:
    """One run of a stage: start the engines on `model` (the fleet's, default: bundled engine
    processes, or `launcher`'s), put the stage's router in front, measure, stop everything."""
    fleet = fleet or Fleet(launcher)
    engines = await target.start_engines(stage.roles(w), fleet.engine_args(stage, w),
                                         w.engine_threads, fleet.launcher_for(stage, w), model,
                                         w.instance_args())
    try:
        async with fleet.front(stage, w, engines, timeout, model) as (url, raw), \
                target.client_session(timeout) as session:
            def body(i: int, start: int = offset) -> dict:
                return target.request_body(prompts.body(start + i), served_name(model),
                                           w.max_tokens, True, "chat")
            # each tenant's first, cold visit, all answered before the users start (a
            # production cache is warm in steady state; the scheduler would serve these
            # cold prefills after the cache hits that keep arriving)
            prime = min(w.tenants, w.warmup)
            primed = await target.measure(session, url + "/v1/chat/completions", {}, body,
                                          requests=0, warmup=prime, concurrency=w.concurrency,
                                          label=f"{stage.name} (prime)")
            await kv_events_settled(session, url)
            samples = await target.measure(
                session, url + "/v1/chat/completions", {},
                lambda i: body(i, offset + prime), requests=w.requests,
                warmup=w.warmup - prime, concurrency=w.concurrency,
                think_s=w.think_ms / 1000.0, seed=w.seed, label=stage.name)
            for sample in samples:
                sample.index += prime           # request i of the round, as its body was
            samples = primed + samples
            engine_metrics = [await archive_mod.snapshot(session, u, "/metrics", {})
                              for u in engines.urls]
            gateway_metrics = await archive_mod.snapshot(session, url, "/metrics", {})
    finally:
        await engines.stop()
    return {"samples": samples, "gateway": raw,
            "engines": [engine_summary(text) for text in engine_metrics],
            "routes": route_decisions(gateway_metrics),
            "kv_events": kv_event_stats(gateway_metrics)}


def stage_cell(stage: Stage, w: Workload, runs: list[dict], slo_s: float,
               fleet: Fleet | None = None) -> dict:
    """A stage's archive cell: latencies over the pooled samples of its rounds, throughput
    as the mean of the rounds' (each round has its own clock), engine/route stats summed."""
    samples = [s for run in runs for s in run["samples"]]
    cell = target.cell_record(stage.name, {"stage": asdict(stage),
                                           "engine_args": (fleet or Fleet()).engine_args(stage, w),
                                           "gateway": runs[0]["gateway"]}, samples, slo_s)
    rounds = [summarize(run["samples"], slo_s) for run in runs]
    for key in ("req_per_s", "out_tok_per_s", "goodput_req_per_s"):
        values = [r[key] for r in rounds if r[key] is not None]
        cell["summary"][key] = round(sum(values) / len(values), 3) if values else None
    cell["summary"]["wall_s"] = round(sum(r["wall_s"] for r in rounds), 3)
    # each round's gateway learns afresh: its upstreams' first requests are left out per round
    predicted = [e for run in runs for e in prediction_errors(run["samples"])]
    cell["summary"].pop("prediction_error_p50", None)
    cell["summary"].pop("prediction_error_n", None)
    if predicted:
        cell["summary"]["prediction_error_p50"] = round(percentile(predicted, 50), 4)
        cell["summary"]["prediction_error_n"] = len(predicted)
    cell["engines"] = [e for run in runs for e in run["engines"]]
    cell["routes"], cell["kv_events"] = {}, {}
    for run in runs:
        for total, part in ((cell["routes"], run["routes"]),
                            (cell["kv_events"], run.get("kv_events", {}))):
            for k, v in part.items():
                total[k] = total.get(k, 0.0) + v
    return cell


async def kv_events_settled(session, url: str, quiet_s: float = 0.3,
                            limit_s: float = 10.0) -> None:
    """Until the router's count of KV-event batches holds still for `quiet_s` (at most
    `limit_s`): the engines publish the primes' blocks as they store them, and a user that
    starts before the router applied them is routed as if the cache were cold. A router that
    reads no events holds still at once."""
    loop = asyncio.get_running_loop()
    deadline, last = loop.time() + limit_s, None
    while loop.time() < deadline:
        now = kv_event_stats(await archive_mod.snapshot(session, url, "/metrics", {}))
        if now == last:
            return
        last = now
        await asyncio.sleep(quiet_s)


def route_decisions(text: str | None) -> dict[str, float]:
    """The gateway's routing outcomes over the stage, e.g. {'home': 70, 'spill': 10}."""
    return summed(text, "prefixgate_route_decisions_total", "outcome")


def kv_event_stats(text: str | None) -> dict[str, float]:
    """What the gateway took from the engines' KV events over the stage, e.g. {'batches':
    900, 'events': 2400, 'ignored_blocks': 0, 'malformed': 0}; empty where the router read
    no events."""
    stats = summed(text, "prefixgate_route_kv_events_received_total", "kind")
    for name in ("ignored_blocks", "malformed"):
        stats.update(summed(text, f"prefixgate_route_kv_events_{name}_total", "", name))
    return stats


def summed(text: str | None, metric: str, label: str, key: str = "") -> dict[str, float]:
    """`metric`'s samples summed by the value of `label` (or all under `key`)."""
    out = {}
    for line in (text or "").splitlines():
        if line.startswith(metric + "{"):
            labels, value = line[line.index("{") + 1:].rsplit("}", 1)
            name = key or dict(kv.split("=", 1) for kv in labels.split(",")).get(label, "?")
            out[name.strip('"')] = out.get(name.strip('"'), 0.0) + float(value)
    return out


def engine_summary(text: str | None) -> dict:
    """Prefix-cache hit ratio and preemptions of one engine over the whole stage."""
    m = pm.parse(text)
    q, h, p = (pm.get(m, k) for k in ("prefix_queries", "prefix_hits", "preemptions"))
    return {"prefix_queries": q and q[1], "prefix_hits": h and h[1], "preemptions": p and p[1]}


def print_staircase(archive: dict) -> None:
    cells = archive["cells"]
    base = cells[0]["summary"]
    w = archive["config"]["workload"]
    load = (f"{w['concurrency']} users pausing {w['think_ms'] / 1000:g} s on average"
            if w.get("think_ms") else f"concurrency {w['concurrency']} back to back")
    slow = (f" (engine1 slowed: step budget {SLOW_STEP_TOKENS})" if w.get("slow_engine")
            else "")
    print(f"\nseed staircase: {w['engines']} engines{slow} on the {archive['config']['model']} "
          f"model, "
          f"{archive['config']['prompt_tokens_built']}-token prompts ({w['shared']:.0%} shared "
          f"by tenant, {w['tenants']} tenants), {load}, {w['max_tokens']} output tokens, "
          f"{w['requests'] * w['rounds']} requests per stage; TTFT in ms, reduction vs "
          f"{cells[0]['label']}; itl p99: decode stalls; cached%: prompt tokens the engines "
          f"reported cached (usage); hit%: their prefix cache counters; miss: requests served "
          f"with no cached prefix")
    head = (f"{'stage':<20}{'p50':>8}{'p95':>8}{'p99':>8}{'-p50%':>7}{'-p95%':>7}{'-p99%':>7}"
            f"{'itl p99':>9}{'req/s':>7}{'cached%':>8}{'hit%':>6}{'miss':>6}{'preempt':>8}"
            f"{'err':>5}")
    print(head + "\n" + "-" * len(head))
    for c in cells:
        s = c["summary"]
        q = sum(e["prefix_queries"] or 0 for e in c["engines"])
        hits = sum(e["prefix_hits"] or 0 for e in c["engines"])
        pre = sum(e["preemptions"] or 0 for e in c["engines"])
        misses = sum(1 for x in c["samples"] if not x["warmup"] and x["status"] == 200
                     and not x.get("cached_tokens"))
        print(f"{c['label']:<20}" + "".join(fmt(s[f"ttft_p{q_}_ms"], 8, 0) for q_ in (50, 95, 99))
              + "".join(fmt(reduction(base[f"ttft_p{q_}_ms"], s[f"ttft_p{q_}_ms"]), 7, 1)
                        for q_ in (50, 95, 99))
              + fmt(s["itl_p99_ms"], 9, 0) + fmt(s["req_per_s"], 7, 2)
              + fmt(cached_share(c), 8, 0) + fmt(100.0 * hits / q if q else None, 6, 0)
              + fmt(misses, 6) + fmt(int(pre), 8)
              + fmt(s["errors"], 5))
    for c in cells:
        s = c["summary"]
        if s.get("prediction_error_p50") is not None:
            print(f"{c['label']}: predicted_ttft's median |predicted - TTFT| / TTFT "
                  f"{100 * s['prediction_error_p50']:.1f}% over {s['prediction_error_n']} "
                  f"requests (each engine's first {WARM_REQUESTS} per round left out)")


def cached_share(cell: dict) -> float | None:
    """Percent of the measured requests' prompt tokens that the engines served from their
    prefix cache, as their usage reported (None: no usage reported cached tokens)."""
    done = [x for x in cell["samples"] if not x["warmup"] and x["status"] == 200
            and x.get("prompt_tokens")]
    if not any(x.get("cached_tokens") is not None for x in done):
        return None
    prompt = sum(x["prompt_tokens"] for x in done)
    return 100.0 * sum(x.get("cached_tokens") or 0 for x in done) / prompt
