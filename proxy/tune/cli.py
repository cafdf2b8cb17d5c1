"""`prefixgate tune`: sweep the engine's flags on your prompts against your SLO.

    prefixgate tune --model smollm2 --tiers 256,1024 --concurrency 8 --slo-ttft-ms 2000 \\
        --grid 'max_num_batched_tokens=256,512,1024,2048; max_num_seqs=4,8,16' \\
        --budget-min 30 --out tune.json --plot tune.png
    prefixgate tune --engine-cmd 'vllm serve {model} --port {port} {flags}' --model MODEL ...
    prefixgate tune --list-attention-backends

One fresh engine per point (proxy/tune/sweep.py), a row per point, and a recommendation: as
engine flags and as the gateway's `bundled:` block. The archive (`--out`) is read by
`prefixgate bench compare`, cell by cell (a cell per point, named by its flags).
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import sys

from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench.cli import fraction, int_list, load_flags
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from prefixgate.proxy.bench.stats import fmt
from prefixgate.proxy.tune import grid as grid_mod
from prefixgate.proxy.tune.sweep import Workload, sweep


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate tune", description="Sweep an engine's flags "
                                "on your prompts; recommend the point with the highest goodput "
                                "whose p99 TTFT meets the SLO.")
    p.add_argument("--model", default="demo", help="the model the engines serve: smollm2, demo "
                   "(default), a .gguf file or a model directory; with --engine-cmd, what "
                   "{model} stands for")
    p.add_argument("--grid", help="flags to sweep, vLLM's names with underscores: 'name=v1,v2; "
                   "name=v1,v2' (the cross product; attention_backend=available: every backend "
                   "this device runs)")
    p.add_argument("--engine-cmd", help="tune another engine: a command with {port}, {flags} "
                   "and {model}, e.g. 'vllm serve {model} --port {port} {flags}'")
    p.add_argument("--prompts", help="JSONL file of request bodies (`messages` or `prompt` per "
                   "line) to replay instead of --tiers")
    p.add_argument("--tiers", type=int_list, help="prompt lengths in tokens, requests cycling "
                   "through them (default 512,2400)")
    p.add_argument("--shared-prefix", type=fraction, default=0.8, help="fraction of each tier's "
                   "prompt that is a system prompt shared by its requests (default 0.8)")
    p.add_argument("--concurrency", type=int, default=8, help="users, closed loop (default 8)")
    p.add_argument("--think-ms", type=float, default=0.0, help="each user's mean pause")
    load_flags(p, ("measured requests per point", "uncounted requests per point",
                   "output tokens per request"), defaults=(48, 8, 32))
    p.add_argument("--slo-ttft-ms", type=float, default=600.0, help="TTFT SLO (p99 and goodput)")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO, if any")
    p.add_argument("--threads", type=int, help="the bundled engine's torch threads (default: "
                   "every core)")
    p.add_argument("--budget-min", type=float, help="stop starting points after this long; "
                   "the rest are listed as skipped")
    p.add_argument("--no-gate", action="store_true", help="recommend points that change "
                   "numerics without the quality gate")
    p.add_argument("--gate-contexts", type=int_list, help="the quality gate's document lengths "
                   "in tokens (default 1024,4096,8192, capped at the model's context)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", help="write the JSON archive here")
    p.add_argument("--plot", help="draw goodput and p99 TTFT per point to this PNG")
    p.add_argument("--list-attention-backends", action="store_true",
                   help="print the attention backends the bundled engine runs on this device")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.list_attention_backends:
        print("\n".join(attention_backends()))
        return 0
    if not args.grid:
        parser.error("--grid is required, e.g. --grid 'max_num_batched_tokens=512,1024'")
    if min(args.concurrency, args.requests, args.max_tokens) <= 0 or args.warmup < 0:
        parser.error("--concurrency, --requests and --max-tokens must be > 0, --warmup >= 0")
    if args.prompts and args.tiers:
        parser.error("--prompts and --tiers are exclusive")
    if args.plot and not archive_mod.have_matplotlib():
        print(f"prefixgate tune: {archive_mod.MISSING_MATPLOTLIB}", file=sys.stderr)
        return 2
    try:
        points = grid_mod.parse_grid(args.grid, attention_backends(),
                                     bundled=not args.engine_cmd)
    except grid_mod.GridError as e:
        print(f"prefixgate tune: {e}", file=sys.stderr)
        return 2
    try:
        lengths = Lengths(load_tokenizer(args.model))
    except (OSError, ValueError) as e:
        if not args.engine_cmd:
            print(f"prefixgate tune: cannot load {args.model}'s tokenizer: {e}", file=sys.stderr)
            return 2
        # another engine's model (a hub name vLLM resolves): prompt lengths in words
        print(f"prefixgate tune: no local tokenizer for {args.model} ({e}); prompt lengths "
              f"are approximate", file=sys.stderr)
        lengths = Lengths()
    w = workload(args)
    try:
        archive = asyncio.run(sweep(
            points, w, lengths, args.model, engine_cmd=args.engine_cmd,
            budget_s=args.budget_min * 60 if args.budget_min else None, timeout=args.timeout,
            gate=None if args.no_gate else quality_gate(args, w)))
    except (OSError, ValueError) as e:
        print(f"prefixgate tune: {e}", file=sys.stderr)
        return 2
    report(archive)
    if args.out:
        archive_mod.write(args.out, archive)
        print(f"archive written to {args.out}")
    if args.plot:
        plot(archive, args.plot)
        print(f"plot written to {args.plot}")
    return 0 if archive["recommended"] else 1


def workload(args) -> Workload:
    w = Workload(shared=args.shared_prefix, prompts_file=args.prompts,
                 concurrency=args.concurrency, think_ms=args.think_ms, requests=args.requests,
                 warmup=args.warmup, max_tokens=args.max_tokens, slo_ttft_ms=args.slo_ttft_ms,
                 slo_tpot_ms=args.slo_tpot_ms, seed=args.seed)
    if args.tiers:
        w.tiers = args.tiers
    if args.threads:
        w.threads = args.threads
    return w


def attention_backends() -> list[str]:
    """What `attention_backend=available` stands for: the backends of this device."""
    import torch

    from prefixgate.kernels.shared import runnable_backends
    return runnable_backends("cuda" if torch.cuda.is_available() else "cpu")


def quality_gate(args, w: Workload):
    """The sweep's gate for points that change numerics: the bundled engine with the point's
    flags against its defaults, on the gate's prompts (proxy/bench/quality.py). Another
    engine's (--engine-cmd) numerics are not gated: reported, never recommended (--no-gate:
    recommended untested)."""
    from prefixgate.proxy.bench.quality import Gate
    from prefixgate.proxy.bench.quality_prompts import Suite
    if args.engine_cmd:
        async def untested(point) -> dict:
            return {"passed": False, "note": "not gated: the gate runs the bundled engine"}
        return untested
    suite = Suite(contexts=tuple(args.gate_contexts)) if args.gate_contexts else Suite()
    gate = Gate(args.model, [], suite=suite, threads=w.threads, timeout=args.timeout)

    async def check(point) -> dict:
        try:
            return await gate.check(point.flags())
        except RuntimeError as e:           # an engine that would not start or answer
            return {"passed": False, "note": f"not gated: {e}"}
    return check


def report(archive: dict) -> None:
    w = archive["config"]["workload"]
    tiers = sorted({t for c in archive["cells"]
                    for t in c["summary"].get("ttft_p95_ms_by_tier", {})}, key=_tier_key)
    print(f"\nprefixgate tune: {archive['config']['model']}, {w['concurrency']} users, "
          f"{w['requests']} measured requests per point, {w['max_tokens']} output tokens; "
          f"SLO TTFT {w['slo_ttft_ms']:g} ms" + (f", TPOT {w['slo_tpot_ms']:g} ms"
                                                if w["slo_tpot_ms"] else "")
          + "; TTFT and TPOT in ms, goodput in requests/s within the SLO")
    width = max(len(c["label"]) for c in archive["cells"])
    head = (f"{'point':<{width}}{'p50':>7}{'p95':>7}{'p99':>7}"
            + "".join(f"{'p95@' + t:>9}" for t in tiers)
            + f"{'tpot':>7}{'goodput':>8}{'good%':>6}{'kv%':>5}{'preempt':>8}{'SLO':>5}"
            f"{'gate':>6}")
    print(head + "\n" + "-" * len(head))
    for c in archive["cells"]:
        s = c["summary"]
        if c.get("error"):
            print(f"{c['label']:<{width}}  {c['error']}")
            continue
        gate = c.get("gate")
        print(f"{c['label']:<{width}}" + "".join(fmt(s[f"ttft_p{q}_ms"], 7, 0)
                                                 for q in (50, 95, 99))
              + "".join(fmt(s["ttft_p95_ms_by_tier"].get(t), 9, 0) for t in tiers)
              + fmt(s["tpot_p50_ms"], 7, 1) + fmt(s["goodput_req_per_s"], 8, 2)
              + fmt(_pct(s["goodput_frac"]), 6, 0) + fmt(_pct(s["kv_usage_peak"]), 5, 0)
              + fmt(s["preemptions"] if s["preemptions"] is None else int(s["preemptions"]), 8)
              + f"{'yes' if s['meets_slo'] else 'no':>5}"
              + f"{gate_word(gate):>6}")
    for label in archive["skipped"]:
        print(f"{label:<{width}}  skipped: over the budget")
    for c in archive["cells"]:
        gate = c.get("gate") or {}
        if gate.get("note"):
            print(f"{c['label']}: {gate['note']}")
        elif gate and not gate.get("passed"):
            failed = [k for k, m in gate["metrics"].items() if not m["passed"]]
            print(f"{c['label']}: below the quality gate on {', '.join(failed)}")
    best = archive["recommended"]
    if best is None:
        print("\nno point met the SLO (and the quality gate): none recommended; try a looser "
              "SLO, fewer users or other values")
        return
    base = archive["cells"][0]["summary"]
    chosen = next(c for c in archive["cells"] if c["label"] == best["label"])["summary"]
    ratio = (chosen["goodput_req_per_s"] / base["goodput_req_per_s"]
             if base.get("goodput_req_per_s") else None)
    print(f"\nrecommended: {best['label']} (goodput {chosen['goodput_req_per_s']} req/s"
          + (f", {ratio:.2f}x the defaults'" if ratio else "") + f", p99 TTFT "
          f"{chosen['ttft_p99_ms']:.0f} ms)\n  engine flags: {shlex.join(best['flags'])}\n"
          f"  gateway config:\n"
          + "".join(f"    {line}\n" for line in grid_mod.bundled_yaml(
              archive["config"]["model"], best["flags"]).splitlines()))


def gate_word(gate: dict | None) -> str:
    if gate is None:
        return "-"
    return "pass" if gate.get("passed") else "skip" if gate.get("note") else "FAIL"


def _tier_key(t: str):
    return (0, int(t)) if t.isdigit() else (1, t)


def _pct(v):
    return None if v is None else 100.0 * v


def plot(archive: dict, path: str) -> None:
    """Goodput and p99 TTFT per point, the SLO as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in archive["cells"] if not c.get("error")]
    # each point by its values alone, the flags' names on the axis
    labels = ["\n".join(map(str, c["point"].values())) or "defaults" for c in cells]
    names = " / ".join(next((list(c["point"]) for c in cells if c["point"]), []))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, len(cells) * 0.8), 7), sharex=True)
    best = (archive["recommended"] or {}).get("label")
    colors = ["tab:green" if c["label"] == best else "tab:blue" for c in cells]
    top.bar(labels, [c["summary"]["goodput_req_per_s"] or 0 for c in cells], color=colors)
    top.set_ylabel("goodput (req/s within SLO)")
    bottom.bar(labels, [c["summary"]["ttft_p99_ms"] or 0 for c in cells], color=colors)
    bottom.axhline(archive["config"]["workload"]["slo_ttft_ms"], color="tab:red", ls="--",
                   label="TTFT SLO")
    bottom.set_ylabel("p99 TTFT (ms)")
    bottom.legend()
    bottom.set_xlabel(names)
    fig.suptitle(f"prefixgate tune: {archive['config']['model']} (recommended in green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
