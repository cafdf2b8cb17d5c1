"""Prompt-lookup speculative decoding vs plain: `python -m prefixgate.backend.bench.speculative`.

Two engines on the same model and engine args, one with `--speculative-config` (default
{"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}), driven directly
(`LLMEngine.step()` in a loop, no HTTP). Both run each cell's batch side by side, one step of
each in turn, and each arm's clock runs only inside its own `step()` calls: the two see the
same machine load even on a busy machine. Every request generates exactly `--max-tokens` tokens
(ignore_eos). Figures are decode only: a cell is timed from the step where the last of its
requests got its first token (prefill and TTFT are left out) to its last token; TPOT p50 is the
median over its requests of (last token - first token) / (tokens - 1). Each engine is built once
and serves every round (fresh request ids each time; both first see every selected prompt once,
so repeated prompts hit the prefix cache alike, which only makes the untimed prefill cheaper).
The step budget has room for a whole batch's prompts, so a batch starts decoding (nearly)
together; other engine args are the engine's defaults. Medians of `--rounds` and the ratio of
the medians are reported.

Workloads (`--workloads`): on a GGUF model (smollm2, real weights) `rag`, chat requests through
the model's chat template (bench/chat_workloads.py): quoting is a RAG prompt (documents and a
question answered by quoting them), free is a free chat prompt, as many different prompts of
each as the largest batch. Elsewhere (the demo model's random weights quote nothing) `selected`,
picked reproducibly (`--seed`) from one greedy run of the baseline engine over
candidate prompts of `--prompt-tokens` tokens, 3 families of `--candidates` each: slices of
ordinary text (the demo tokenizer's corpus, backend/data), random token ids, and a random
pattern of 1-2 ids repeated. Each candidate's greedy output is scored by replaying the engine's
own lookup (`spec_decode.propose`) over it: tokens per step it would give at batch 1 (k + 1 at
best, 1 when nothing is ever accepted).
  quoting  the candidates scoring >= `--min-predicted` (2.0), best first: outputs that repeat
           their prompt or loop (on the random demo model mostly the repeated-pattern family;
           the table prints how many of each family qualified). Greedy.
  free     text candidates scoring <= `--free-max-predicted` (1.2), lowest first: greedy output
           that does not loop, so drafts are few and mostly rejected. (`--free-temperature 1`
           samples instead, seeded per request; on the demo model that finds no n-gram to draft
           from at all, a weaker test.)
A batch larger than the selection repeats prompts. Acceptance is read from `spec_stats()`:
mean acceptance length = 1 + accepted / drafts, acceptance rate = accepted / draft tokens.

Targets: (a) quoting, batch 1: speed-up >= 1.8x where the mean acceptance length is >= 3;
(b) free: >= 0.95x at batch 1 and 16 (the gates must make drafting close to free).
`--sweep` turns the gates off (disable_by_batch_size huge, min_acceptance_rate 0, no
break-even bar from the engine's step-cost fit) and runs
batches 1,4,16,32,64: where quoting stops paying bounds `disable_by_batch_size`; what free
generation costs there is what the bar must prevent, and the acceptance rate where drafting
breaks even (on the line between the two workloads' points) is what the engine's fitted bar
should track at that batch (`min_acceptance_rate` is its floor). `--quick` is a
tiny smoke run. `--out FILE` saves config, per-cell medians, ratios and acceptance figures as
JSON. On a 2-core CPU the default run takes ~1-2 minutes, `--sweep` ~4.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from prefixgate.backend.bench.script import run_report_save
from prefixgate.backend.bench.vocab import MODEL_HELP

DEFAULT_SPEC = {"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
GATES_OFF = {"disable_by_batch_size": 1 << 30, "min_acceptance_rate": 0.0}
TARGETS = {"quoting_speedup_b1": 1.8, "quoting_min_acceptance_length": 3.0, "free_ratio": 0.95}
FAMILIES = ("text", "random", "repeat")
SPEC_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_LOW_IDS = 16                    # ids below this are left out of random prompts (special tokens)


# --- candidates and their selection ---------------------------------------------------------

def candidates(tokenizer, vocab: int, per_family: int, prompt_tokens: int,
               seed: int) -> list[tuple[str, list[int]]]:
    """(family, prompt ids): text slices, random ids, a short random pattern repeated."""
    from prefixgate.backend.demo import corpus_texts

    rng = random.Random(seed)
    texts = [ids for ids in (tokenizer.encode(t) for t in corpus_texts())
             if len(ids) > prompt_tokens]
    out = []
    for _ in range(per_family):
        ids = rng.choice(texts)
        start = rng.randrange(len(ids) - prompt_tokens)
        out.append(("text", ids[start:start + prompt_tokens]))
        out.append(("random", [rng.randrange(_LOW_IDS, vocab) for _ in range(prompt_tokens)]))
        pattern = [rng.randrange(_LOW_IDS, vocab) for _ in range(rng.randint(1, 2))]
        out.append(("repeat", (pattern * prompt_tokens)[:prompt_tokens]))
    return out


def lookup_score(prompt: list[int], output: list[int], cfg) -> float:
    """Tokens per step the engine's prompt lookup would give on `output` at batch 1, greedy,
    no gates: every step proposes a draft, keeps its prefix that matches, and one token."""
    from prefixgate.backend.spec_decode import NgramIndex, propose

    tokens, index = list(prompt), NgramIndex(cfg.prompt_lookup_min)
    i = steps = 0
    while i < len(output):
        room = min(cfg.num_speculative_tokens, len(output) - i - 1)
        draft = propose(tokens, index, cfg.prompt_lookup_max, room) if room > 0 else []
        n = 0
        while n < len(draft) and draft[n] == output[i + n]:
            n += 1
        tokens.extend(output[i:i + n + 1])
        i += n + 1
        steps += 1
    return len(output) / steps


def select(pool: list[tuple[str, list[int]]], outputs: list[list[int]], cfg, args) -> dict:
    """The quoting and free prompt sets, with what the selection saw."""
    scored = [(lookup_score(p, o, cfg), fam, p) for (fam, p), o in zip(pool, outputs)]
    need = max(args.batches)
    quoting = sorted((s for s in scored if s[0] >= args.min_predicted), key=lambda s: -s[0])[:need]
    fallback = []
    if not quoting:                         # report what there is rather than fail
        quoting = [max(scored, key=lambda s: s[0])]
        fallback.append("quoting")
    text = [s for s in scored if s[1] == "text"]
    if args.free_temperature > 0:
        free = text[:need]
    else:
        free = sorted((s for s in text if s[0] <= args.free_max_predicted),
                      key=lambda s: s[0])[:need]
        if not free:
            free = sorted(text, key=lambda s: s[0])[:1]
            fallback.append("free")
    qualified = {f: sum(1 for s in scored if s[1] == f and s[0] >= args.min_predicted)
                 for f in FAMILIES}
    info = {"candidates": len(pool), "quoting_qualified_by_family": qualified,
            "none_qualified": fallback, "quoting_prompts": len(quoting), "free_prompts": len(free),
            "predicted_tokens_per_step": {
                "all_median": statistics.median(s[0] for s in scored),
                "quoting_median": statistics.median(s[0] for s in quoting),
                "free_median": statistics.median(s[0] for s in free)}}
    return {"quoting": [s[2] for s in quoting], "free": [s[2] for s in free], "info": info}


# --- driving an engine ------------------------------------------------------------------------

@dataclass
class _Req:
    first: float | None = None
    last: float | None = None
    tokens: list[int] = field(default_factory=list)


class _Arm:
    """One engine's share of a cell: its requests, and a clock that runs only inside its own
    `step()` calls (so two engines stepped alternately see the same machine load)."""

    def __init__(self, engine, prompts: list[list[int]], params: list, tag: str):
        self.engine, self.clock = engine, 0.0
        self.ids = [f"{tag}-{i}" for i in range(len(prompts))]
        self.reqs = {rid: _Req() for rid in self.ids}
        self.steps: list[tuple[float, int, int]] = []     # (clock, decode tokens, sequences served)
        self.before = engine.spec_stats()
        for rid, prompt, p in zip(self.ids, prompts, params):
            engine.add_request(rid, prompt, p)

    def step(self) -> None:
        t = time.perf_counter()
        outs = self.engine.step()
        self.clock += time.perf_counter() - t
        n = active = 0
        for o in outs:
            if not o.token_ids:
                continue
            r = self.reqs[o.request_id]
            if r.first is None:
                r.first = self.clock
            else:
                n += len(o.token_ids)
                active += 1
            r.last = self.clock
            r.tokens.extend(o.token_ids)
        self.steps.append((self.clock, n, active))

    def result(self) -> dict:
        reqs = self.reqs.values()
        start, end = max(r.first for r in reqs), max(r.last for r in reqs)
        after = [s for s in self.steps if s[0] > start]   # every request decoding
        tokens = sum(s[1] for s in after)
        tpots = [(r.last - r.first) / (len(r.tokens) - 1) for r in reqs if len(r.tokens) > 1]
        out = {"decode_tok_per_s": tokens / (end - start) if end > start else 0.0,
               "tpot_p50_s": statistics.median(tpots) if tpots else 0.0,
               "decode_steps": len(after), "decode_tokens": tokens,
               "tokens_per_seq_step": tokens / max(1, sum(s[2] for s in after)),
               "outputs": [self.reqs[rid].tokens for rid in self.ids]}
        if self.before is not None:
            now = self.engine.spec_stats()
            out["spec"] = {k: now[k] - self.before[k] for k in SPEC_COUNTS}
        return out


def generate(arms: list[_Arm]) -> list[dict]:
    """Run every arm to completion, one step of each in turn (the order flips every round)."""
    turn = 0
    while True:
        busy = [a for a in arms if a.engine.has_work()]
        if not busy:
            return [a.result() for a in arms]
        for a in busy if turn % 2 == 0 else reversed(busy):
            a.step()
        turn += 1


def _params(args, workload: str, n: int) -> list:
    from prefixgate.backend.sampling import SamplingParams

    temp = args.free_temperature if workload == "free" else 0.0
    return [SamplingParams(max_tokens=args.max_tokens, temperature=temp, ignore_eos=True,
                           seed=i if temp > 0 else None) for i in range(n)]


class _NoCost:
    """The sweep's stand-in for the engine's step-cost fit: no break-even bar at all."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def break_even(self, batch_size: int) -> float:
        return 0.0


def build_engines(args, spec_cfg, prompt_tokens: int):
    from prefixgate.backend.config import EngineArgs
    from prefixgate.backend.engine import LLMEngine

    # A budget with room for a whole batch's prompts (`prompt_tokens`: the longest), so a
    # cell's requests start decoding within a step or two; everything else is the engine's
    # defaults.
    k = spec_cfg.num_speculative_tokens
    common = dict(model=args.model, device=args.device, dtype=args.dtype,
                  kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=max(64, max(args.batches), len(FAMILIES) * args.candidates),
                  max_num_batched_tokens=max(2048, max(args.batches) * (prompt_tokens + k + 1)))
    base = LLMEngine(EngineArgs(**common))
    spec = LLMEngine(EngineArgs(**common, speculative_config=spec_cfg))
    return base, spec


def default_workloads(model: str) -> str:
    """rag on a GGUF model (real weights: they quote what they are asked to), selected
    elsewhere (the demo's random weights answer nothing: workloads are found by their outputs)."""
    from prefixgate.backend.config import resolve_model
    from prefixgate.backend.gguf_weights import is_gguf

    return "rag" if is_gguf(resolve_model(model)) else "selected"


def rag_and_chat(args) -> dict:
    """The rag workloads: as many different prompts of each as the largest batch."""
    from prefixgate.backend.bench.chat_workloads import chat_prompts
    from prefixgate.backend.config import resolve_model
    from prefixgate.common.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_model(args.model))
    n = max(args.batches)
    quoting = chat_prompts(tokenizer, "rag", n, args.seed)
    free = chat_prompts(tokenizer, "chat", n, args.seed)
    info = {"quoting_prompts": len(quoting), "free_prompts": len(free), "none_qualified": [],
            "prompt_tokens_median": {"quoting": statistics.median(map(len, quoting)),
                                     "free": statistics.median(map(len, free))},
            "selection_s": 0.0}
    return {"quoting": quoting, "free": free, "info": info}


def selected(base, spec_cfg, args) -> dict:
    """The selected workloads: candidates scored by one greedy run of the baseline engine."""
    vocab = min(base.tokenizer.vocab_size, base.model_config.vocab_size)
    pool = candidates(base.tokenizer, vocab, args.candidates, args.prompt_tokens, args.seed)
    greedy = _params(args, "quoting", len(pool))
    ts = time.perf_counter()
    outputs = generate([_Arm(base, [p for _, p in pool], greedy, "select")])[0]["outputs"]
    selection = select(pool, outputs, spec_cfg, args)
    selection["info"]["selection_s"] = time.perf_counter() - ts
    return selection


def run(args) -> dict:
    """The whole benchmark for parsed `args` (see `parse_args`); returns the JSON-able result."""
    from prefixgate.backend.config import parse_speculative_config
    from prefixgate.backend.sampling import SamplingParams

    t0 = time.perf_counter()
    raw = dict(DEFAULT_SPEC if args.speculative_config is None
               else json.loads(args.speculative_config))
    if args.sweep:
        raw.update(GATES_OFF)
    spec_cfg = parse_speculative_config(raw)
    args.workloads = args.workloads or default_workloads(args.model)
    chat = rag_and_chat(args) if args.workloads == "rag" else None
    longest = max(map(len, chat["quoting"] + chat["free"])) if chat else args.prompt_tokens
    base, spec = build_engines(args, spec_cfg, longest)
    if args.sweep:
        spec.speculator.cost = _NoCost()
    selection = chat or selected(base, spec_cfg, args)
    # Both engines see every selected prompt once (warm-up, and the same prefix-cache state
    # for both arms from the first round on).
    warm = selection["quoting"] + selection["free"]
    short = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)] * len(warm)
    generate([_Arm(base, warm, short, "warm-baseline"), _Arm(spec, warm, short, "warm-spec")])
    samples: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for rnd in range(args.rounds):
        for workload in ("quoting", "free"):
            for b in args.batches:
                prompts = list(itertools.islice(itertools.cycle(selection[workload]), b))
                cell = samples.setdefault((workload, b), {"baseline": [], "spec": []})
                tag = f"{workload}-b{b}-r{rnd}"
                res = generate([_Arm(base, prompts, _params(args, workload, b), f"{tag}-baseline"),
                                _Arm(spec, prompts, _params(args, workload, b), f"{tag}-spec")])
                cell["baseline"].append(res[0])
                cell["spec"].append(res[1])
    cells = [_cell(w, b, s, args) for (w, b), s in samples.items()]
    result = {"config": {**{k: v for k, v in vars(args).items() if k != "speculative_config"},
                         "speculative_config": raw, "device": str(base.device),
                         "dtype_resolved": str(next(base.model.parameters()).dtype),
                         "model_dir": str(base.model_dir)},
              "selection": selection["info"], "cells": cells,
              "targets": {} if args.sweep else _targets(cells), "target_values": TARGETS}
    if args.sweep:
        result["sweep"] = sweep_summary(cells)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _cell(workload: str, batch: int, s: dict, args) -> dict:
    med = {arm: {k: statistics.median(r[k] for r in runs)
                 for k in ("decode_tok_per_s", "tpot_p50_s", "tokens_per_seq_step")}
           for arm, runs in s.items()}
    spec = {k: sum(r["spec"][k] for r in s["spec"]) for k in SPEC_COUNTS}
    pairs = [sp["decode_tok_per_s"] / b["decode_tok_per_s"]
             for b, sp in zip(s["baseline"], s["spec"]) if b["decode_tok_per_s"]]
    same = [a == b for rb, rs in zip(s["baseline"], s["spec"])
            for a, b in zip(rb["outputs"], rs["outputs"])]
    greedy = workload == "quoting" or args.free_temperature == 0
    return {"workload": workload, "batch": batch, "rounds": len(s["spec"]),
            "baseline": med["baseline"], "spec": med["spec"],
            "samples_decode_tok_per_s": {arm: [r["decode_tok_per_s"] for r in runs]
                                         for arm, runs in s.items()},
            "ratio": (med["spec"]["decode_tok_per_s"] / med["baseline"]["decode_tok_per_s"]
                      if med["baseline"]["decode_tok_per_s"] else 0.0),
            "tpot_ratio": (med["baseline"]["tpot_p50_s"] / med["spec"]["tpot_p50_s"]
                           if med["spec"]["tpot_p50_s"] else 0.0),
            "paired_ratio_median": statistics.median(pairs) if pairs else 0.0,
            **spec,
            "mean_acceptance_length": (1 + spec["num_accepted_tokens"] / spec["num_drafts"]
                                       if spec["num_drafts"] else 1.0),
            "acceptance_rate": (spec["num_accepted_tokens"] / spec["num_draft_tokens"]
                                if spec["num_draft_tokens"] else 0.0),
            # greedy: the speculative engine must give the baseline's tokens (float ties aside)
            "same_output_fraction": (sum(same) / len(same) if same else None) if greedy else None}


def _find(cells, workload, batch):
    return next((c for c in cells if c["workload"] == workload and c["batch"] == batch), None)


def _targets(cells) -> dict:
    t = {}
    q = _find(cells, "quoting", 1)
    if q is not None:
        applies = q["mean_acceptance_length"] >= TARGETS["quoting_min_acceptance_length"]
        t["quoting_b1"] = {"ratio": q["ratio"], "target": TARGETS["quoting_speedup_b1"],
                           "mean_acceptance_length": q["mean_acceptance_length"],
                           "applies": applies,
                           "pass": q["ratio"] >= TARGETS["quoting_speedup_b1"] if applies else None}
    for b in (1, 16):
        f = _find(cells, "free", b)
        if f is not None:
            t[f"free_b{b}"] = {"ratio": f["ratio"], "target": TARGETS["free_ratio"],
                               "pass": f["ratio"] >= TARGETS["free_ratio"]}
    return t


# --- report -------------------------------------------------------------------------------------

def report(r: dict) -> None:
    c, sel = r["config"], r["selection"]
    gates = " (gates off: sweep)" if c["sweep"] else ""
    print(f"speculative decoding (prompt lookup "
          f"{json.dumps(r['config']['speculative_config'])}){gates}")
    print(f"  model {c['model']} on {c['device']} ({c['dtype_resolved']}), "
          f"{c['max_tokens']} tokens per request, median of {c['rounds']} rounds, decode only "
          f"(timed from each request's first token)")
    _report_selection(c, sel)
    for w in sel["none_qualified"]:
        print(f"  WARNING: no candidate qualified for {w}; it runs on the closest one "
              f"(see predicted tokens/step)")
    print(f"  {'workload':<8} {'batch':>5} {'base tok/s':>10} {'spec tok/s':>10} {'ratio':>6} "
          f"{'TPOT p50 base':>13} {'spec':>8} {'acc.len':>7} {'acc.rate':>8} {'tok/step':>8} "
          f"{'same':>5}")
    for cell in r["cells"]:
        b, s = cell["baseline"], cell["spec"]
        same = cell["same_output_fraction"]
        same = "-" if same is None else f"{same:.0%}"
        print(f"  {cell['workload']:<8} {cell['batch']:>5} {b['decode_tok_per_s']:>10.1f} "
              f"{s['decode_tok_per_s']:>10.1f} {cell['ratio']:>5.2f}x "
              f"{b['tpot_p50_s'] * 1e3:>10.2f} ms {s['tpot_p50_s'] * 1e3:>5.2f} ms "
              f"{cell['mean_acceptance_length']:>7.2f} {cell['acceptance_rate']:>8.2f} "
              f"{s['tokens_per_seq_step']:>8.2f} {same:>5}")
    print("  (acc.len = 1 + accepted/drafts; acc.rate = accepted/draft tokens; "
          "tok/step = tokens per sequence per decode step, speculative; "
          "same = greedy outputs equal to the baseline's)")
    if c["sweep"]:
        _report_sweep(r["sweep"])
    else:
        _report_targets(r["targets"])
    print(f"  wall time {r['wall_s']:.0f} s (selection {sel['selection_s']:.0f} s)")


def _report_selection(c: dict, sel: dict) -> None:
    if c["workloads"] == "rag":
        t = sel["prompt_tokens_median"]
        print(f"  workloads: quoting = {sel['quoting_prompts']} RAG prompts (median "
              f"{t['quoting']:.0f} tokens), free = {sel['free_prompts']} chat prompts (median "
              f"{t['free']:.0f} tokens), through the chat template")
        return
    q = sel["quoting_qualified_by_family"]
    p = sel["predicted_tokens_per_step"]
    print(f"  selection: {sel['candidates']} candidates, greedy once; "
          f"quoting = {sel['quoting_prompts']} prompts "
          f"with predicted >= {c['min_predicted']} tokens/step (qualified: "
          + ", ".join(f"{k} {v}" for k, v in q.items())
          + f"), free = {sel['free_prompts']} text prompts; predicted tokens/step median: all "
          f"{p['all_median']:.2f}, quoting {p['quoting_median']:.2f}, free {p['free_median']:.2f}")


def _verdict(ok) -> str:
    return "PASS" if ok else "FAIL"


def _report_targets(t: dict) -> None:
    print("targets:")
    if "quoting_b1" in t:
        q = t["quoting_b1"]
        cond = f"mean acceptance length {q['mean_acceptance_length']:.2f}"
        least = TARGETS["quoting_min_acceptance_length"]
        verdict = _verdict(q["pass"]) if q["applies"] else f"N/A ({cond} < {least})"
        print(f"  (a) quoting, batch 1: {q['ratio']:.2f}x, target >= {q['target']}x when mean "
              f"acceptance length >= {least:g} ({cond}): {verdict}")
    for b in (1, 16):
        if f"free_b{b}" in t:
            f = t[f"free_b{b}"]
            print(f"  (b) free, batch {b}: {f['ratio']:.2f}x, target >= {f['target']}x: "
                  f"{_verdict(f['pass'])}")


def sweep_summary(cells) -> dict:
    """Per batch: the two ratios and the acceptance rate at which drafting breaks even, read
    off the line through (free rate, free ratio) and (quoting rate, quoting ratio); None where
    both sides pay or both lose. The largest batch where quoting still pays."""
    rows = {}
    for q in (c for c in cells if c["workload"] == "quoting"):
        f = _find(cells, "free", q["batch"])
        if f is None:
            continue
        (af, rf), (aq, rq) = (f["acceptance_rate"], f["ratio"]), (q["acceptance_rate"], q["ratio"])
        crosses = rq != rf and min(rf, rq) < 1 <= max(rf, rq)
        even = af + (1 - rf) * (aq - af) / (rq - rf) if crosses else None
        rows[q["batch"]] = {"quoting_ratio": rq, "free_ratio": rf, "quoting_acceptance_rate": aq,
                            "free_acceptance_rate": af, "break_even_acceptance_rate": even}
    paying = [b for b, r in rows.items() if r["quoting_ratio"] >= 1.0]
    return {"by_batch": rows, "largest_batch_quoting_pays": max(paying) if paying else None}


def _report_sweep(summary: dict) -> None:
    print("sweep (gates off): spec/baseline decode tok/s, and the acceptance rate where drafting "
          "breaks even")
    print(f"  {'batch':>5} {'quoting':>8} {'(acc.rate)':>10} {'free':>6} {'(acc.rate)':>10} "
          f"{'break-even acc.rate':>20}")
    for b, r in summary["by_batch"].items():
        even = r["break_even_acceptance_rate"]
        even = "-" if even is None else f"{even:.2f}"
        print(f"  {b:>5} {r['quoting_ratio']:>7.2f}x {r['quoting_acceptance_rate']:>10.2f} "
              f"{r['free_ratio']:>5.2f}x {r['free_acceptance_rate']:>10.2f} {even:>20}")
    top = summary["largest_batch_quoting_pays"]
    print(f"  disable_by_batch_size: quoting still pays up to batch {top} here (largest batch run: "
          f"{max(summary['by_batch'], default=0)})" if top
          else "  disable_by_batch_size: quoting pays at no batch run")
    print("  the bar: free generation's ratio is what drafting costs without it; the break-even "
          "rate (linear between the two workloads) is what the engine's fitted bar should track "
          "at that batch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.speculative",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16, float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--kv-cache-memory", default="1GiB", help="per engine (two are built)")
    p.add_argument("--workloads", choices=("rag", "selected"), default=None,
                   help="rag: RAG quoting and free chat through the chat template; selected: "
                        "found by a greedy run (default: rag on a GGUF model, else selected)")
    p.add_argument("--speculative-config", default=None,
                   help=f"JSON (default {json.dumps(DEFAULT_SPEC)})")
    p.add_argument("--batches", default=None,
                   help="comma list (default 1,16; with --sweep 1,4,16,32,64)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per arm (default 3)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per request (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="candidate prompt length (default 96)")
    p.add_argument("--candidates", type=int, default=None,
                   help="candidates per family (default 24)")
    p.add_argument("--min-predicted", type=float, default=2.0,
                   help="quoting: predicted tokens/step at least")
    p.add_argument("--free-max-predicted", type=float, default=1.2,
                   help="free: predicted tokens/step at most")
    p.add_argument("--free-temperature", type=float, default=0.0,
                   help="free: sample at this temperature (seeded) instead of greedy "
                        "non-looping text")
    p.add_argument("--sweep", action="store_true", help="gates off, batches 1,4,16,32,64")
    p.add_argument("--quick", action="store_true",
                   help="tiny run: 1 round, 16 tokens, 4 candidates per family")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None, help="save results as JSON here")
    a = p.parse_args(argv)
    quick = {"rounds": 1, "max_tokens": 16, "prompt_tokens": 64, "candidates": 4}
    full = {"rounds": 3, "max_tokens": 128, "prompt_tokens": 96, "candidates": 24}
    for k, v in (quick if a.quick else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.batches = [int(x) for x in (a.batches or ("1,4,16,32,64" if a.sweep else "1,16")).split(",")]
    if a.speculative_config is not None:
        from prefixgate.backend.config import parse_speculative_config
        try:
            parse_speculative_config(a.speculative_config)
        except ValueError as e:
            p.error(f"--speculative-config: {e}")
    return a


def main(argv: list[str] | None = None) -> int:
    return run_report_save(run, report, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
