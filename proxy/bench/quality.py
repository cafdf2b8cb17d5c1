"""`prefixgate bench --scenario quality`: the quality gate. A setting that changes the engine's
numerics (an FP8 KV cache, another attention backend, another dtype: backend/config.py's
NUMERIC) is compared with the baseline on the same prompts before it can be recommended.

    prefixgate bench --scenario quality --candidate kv_cache_dtype=fp8 --model smollm2
    prefixgate bench --scenario quality --candidate 'kv_cache_dtype=fp8;attention_backend=torch' \\
        --gate exact_match=0.5,top1_agreement=0.97 --contexts 1024,4096 --out gate.json

Each engine (the baseline, then each candidate; one at a time, on every core) answers, greedy,
the gate's prompts (proxy/bench/quality_prompts.py: a short set of chat prompts, documents
with numbers to quote); proxy/bench/quality_verdict.py measures the candidate's answers
against the baseline's. For the top-1 agreement each position of the baseline's short outputs
is one probe request (the bundled engine has no `logprobs`): the prompt and the baseline's
first i output tokens as token ids, max_tokens 1 (a greedy token is the top-1). The probes of
a prompt share its prefix, so the prefix cache leaves each at most a block of tokens to
compute; the baseline is probed the same way.

For a tuner: `gate = Gate(model, baseline_flags)`, then `verdict = await gate.check(flags)`
per grid point (the baseline runs once, on the first check); `flags_from_spec(spec)` turns
'kv_cache_dtype=fp8' into engine flags (backend/config.py `setting_flags`); `run_gate(...)`
is the one-shot form. The gate's own tests plant a fault below FP8's precision with the
engine's hidden `--debug-kv-mantissa-bits N` (stored K/V rounded to N mantissa bits).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time

from prefixgate.backend.config import resolve_model, served_name, setting_flags
from prefixgate.common.schema import ConfigError
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.prompts import load_tokenizer
from prefixgate.proxy.bench.quality_prompts import Inputs, Suite, long_questions, short_prompts
from prefixgate.proxy.bench.quality_verdict import PointRun, Thresholds, compare, parse_thresholds

# --- candidate specs: 'kv_cache_dtype=fp8,attention_backend=torch' -> engine flags -----------


class SpecError(ValueError):
    """A candidate spec that names no engine setting, or a value the setting does not take."""


def flags_from_spec(spec: str) -> list[str]:
    """One grid point, `key=value` pairs joined by commas, as `prefixgate backend` flags
    (backend/config.py `setting_flags`): 'kv_cache_dtype=fp8' -> ['--kv-cache-dtype', 'fp8'].
    SpecError names the spec and what is wrong."""
    try:
        return setting_flags(spec)
    except ConfigError as e:
        raise SpecError(f"candidate {e}") from None


def parse_candidates(texts: list[str]) -> list[str]:
    """`--candidate` values (each may hold several specs separated by ';') as a list of specs."""
    return [s.strip() for text in texts for s in text.split(";") if s.strip()]


# --- one engine's answers --------------------------------------------------------------------

# a gate measures answers, not latency: no warm-up run before the first request
ENGINE_ARGS = ["--log-level", "warning", "--skip-server-warmup"]


class Gate:
    """Compares grid points with a baseline on one model; the baseline runs once."""

    def __init__(self, model: str = "demo", baseline_flags: list[str] | None = None, *,
                 suite: Suite | None = None, thresholds: Thresholds | None = None,
                 threads: int | None = None, launcher=None, timeout: float = 1800.0,
                 tokenizer=None, log=None, concurrency: int = 32):
        self.model = model
        # requests in flight at once. 1 makes the answers independent of how the engine
        # batches them: a CPU engine's decode rows go through the few-rows product in a small
        # step and through oneDNN's in a large one, which round differently, so near-tied
        # logits (a random model's) can pick another token when the same prompts are batched
        # otherwise (as in vLLM, whose batches are not invariant either)
        self.concurrency = concurrency
        self.baseline_flags = list(baseline_flags or [])
        self.suite = suite or Suite()
        self.thresholds = thresholds or Thresholds()
        self.threads = threads or os.cpu_count() or 1      # one engine at a time: every core
        self.launcher = launcher
        self.timeout = timeout
        self.tokenizer = tokenizer
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.inputs: Inputs | None = None
        self.baseline: PointRun | None = None

    async def run_baseline(self) -> PointRun:
        if self.baseline is None:
            self.baseline = await self.measure(self.baseline_flags)
            if self.baseline.errors:
                raise RuntimeError(f"the baseline ({' '.join(self.baseline_flags) or 'defaults'})"
                                   f" failed: {self.baseline.errors[0]}")
        return self.baseline

    async def check(self, candidate_flags: list[str],
                    thresholds: Thresholds | None = None) -> dict:
        """The verdict on one grid point: every measure, its threshold, and `passed`."""
        base = await self.run_baseline()
        cand = await self.measure(candidate_flags, reference=base)
        return compare(base, cand, self.suite, thresholds or self.thresholds, self.inputs)

    async def measure(self, flags: list[str], reference: PointRun | None = None) -> PointRun:
        """Start an engine with `flags`, send it every prompt, stop it."""
        label = " ".join(flags) or "defaults"
        self.log(f"quality gate: {self.model} with {label}: starting the engine")
        t0 = time.monotonic()
        engines = await target.start_engines(["both"], ENGINE_ARGS + list(flags), self.threads,
                                             self.launcher, self.model)
        try:
            async with target.client_session(self.timeout) as session:
                client = _Client(session, engines.urls[0], served_name(self.model),
                                 self.concurrency)
                max_len = await client.max_model_len()
                if self.inputs is None:
                    self.inputs = self._build_inputs(max_len)
                run = await self._answer(client, flags, reference, max_len)
        finally:
            await engines.stop()
        run.seconds = time.monotonic() - t0
        self.log(f"quality gate: {label}: done in {run.seconds:.0f} s")
        return run

    def _build_inputs(self, max_model_len: int) -> Inputs:
        tok = self.tokenizer or load_tokenizer(str(resolve_model(self.model)))
        self.tokenizer = tok
        s = self.suite
        short = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True))
                 for m in short_prompts(s)]
        return Inputs(short, long_questions(s, tok, max_model_len - s.answer_tokens - 1))

    async def _answer(self, client: _Client, flags: list[str], reference: PointRun | None,
                      max_len: int) -> PointRun:
        s, inputs = self.suite, self.inputs
        run = PointRun(list(flags), [], [], [], max_model_len=max_len)
        t0 = time.monotonic()
        self.log(f"  {len(inputs.short)} short prompts, {s.max_tokens} tokens each")
        short = await asyncio.gather(*(client.complete(ids, s.max_tokens) for ids in inputs.short))
        run.outputs = [ids for ids, _ in short]
        run.texts = [text for _, text in short]
        # the probes next, while the outputs' KV blocks are still in the prefix cache
        ref = (reference or run).outputs
        self.log(f"  top-1 probes ({sum(map(len, ref))} positions; {time.monotonic() - t0:.0f} s)")
        probes = [[client.complete(ids + out[:i], 1, probe=True) for i in range(len(out))]
                  for ids, out in zip(inputs.short, ref)]
        results = await asyncio.gather(*(asyncio.gather(*row) for row in probes))
        run.top1 = [[ids[0] if ids else -1 for ids, _ in row] for row in results]
        for context in s.contexts:       # a document's first question fills the prefix cache
            qs = [q for q in inputs.questions if q.context == context]
            if not qs:
                continue
            self.log(f"  numbers at {context} tokens ({len(qs[0].prompt_ids)} in the prompt; "
                     f"{time.monotonic() - t0:.0f} s)")
            first = await client.complete(qs[0].prompt_ids, s.answer_tokens)
            rest = await asyncio.gather(*(client.complete(q.prompt_ids, s.answer_tokens)
                                          for q in qs[1:]))
            run.answers += [text for _, text in [first, *rest]]
        run.errors = client.errors
        return run


class _Client:
    """Greedy /v1/completions on token ids; a failed request is recorded and answers empty."""

    def __init__(self, session, url: str, model: str, concurrency: int):
        self.session, self.url, self.model = session, url, model
        self.errors: list[str] = []
        self.slots = asyncio.Semaphore(concurrency)     # Gate's; the engine's max_num_seqs is 64

    async def max_model_len(self) -> int:
        async with self.session.get(self.url + "/v1/models") as resp:
            models = await resp.json()
        return int(models["data"][0]["max_model_len"])

    async def complete(self, prompt_ids: list[int], max_tokens: int,
                       probe: bool = False) -> tuple[list[int], str]:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": probe}
        async with self.slots:
            try:
                async with self.session.post(self.url + "/v1/completions", json=body) as resp:
                    obj = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: "
                                           f"{(obj.get('error') or {}).get('message')}")
            except Exception as e:  # recorded: the verdict says the point failed, and why
                self.errors.append(f"{type(e).__name__}: {e}")
                return [], ""
        choice = obj["choices"][0]
        return list(choice.get("token_ids") or []), choice.get("text") or ""



async def run_gate(model: str, baseline_flags: list[str], candidate_flags: list[str], *,
                   suite: Suite | None = None, thresholds: Thresholds | None = None,
                   threads: int | None = None, launcher=None) -> dict:
    """One candidate against the baseline, from scratch (a tuner checking several points keeps
    one `Gate` so the baseline runs once)."""
    gate = Gate(model, baseline_flags, suite=suite, thresholds=thresholds, threads=threads,
                launcher=launcher)
    return await gate.check(candidate_flags)


# --- `prefixgate bench --scenario quality` ----------------------------------------------------

def run_quality(args) -> int:
    """The gate from the command line: exit status 0 when every candidate passes, 1 when one
    does not (or an engine failed), 2 for a bad spec, threshold or model."""
    try:
        candidates = parse_candidates(args.candidate or [])
        points = [(spec, flags_from_spec(spec)) for spec in candidates]
        baseline = flags_from_spec(args.baseline or "")
        thresholds = parse_thresholds(args.gate or "")
        suite = target.given(Suite(), prompts=args.requests, max_tokens=args.max_tokens,
                             seed=args.seed,
                             contexts=tuple(args.contexts) if args.contexts else None)
    except ValueError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 2
    if getattr(args, "self_check", False):
        points.insert(0, ("baseline (self-check)", baseline))
    if not points:
        print("prefixgate bench: --scenario quality needs --candidate SPEC (e.g. "
              "kv_cache_dtype=fp8) or --self-check", file=sys.stderr)
        return 2
    model = target.scenario_model(args)
    try:
        tokenizer = load_tokenizer(str(resolve_model(model)))
    except (OSError, ValueError) as e:
        print(f"prefixgate bench: cannot run the scenario on {model}: {e}", file=sys.stderr)
        return 2
    gate = Gate(model, baseline, suite=suite, thresholds=thresholds, timeout=args.timeout,
                tokenizer=tokenizer)
    t0 = time.monotonic()
    try:
        verdicts = asyncio.run(_check_all(gate, points))
    except RuntimeError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 1
    archive = {"schema": archive_mod.SCHEMA, "kind": "quality",
               "config": {"scenario": "quality", "model": model, "baseline": baseline,
                          "candidates": [spec for spec, _ in points],
                          "suite": dataclasses.asdict(gate.suite),
                          "thresholds": dataclasses.asdict(thresholds),
                          "engine_args": ENGINE_ARGS, "threads": gate.threads},
               "environment": archive_mod.environment(),
               "baseline": {"flags": baseline, "seconds": round(gate.baseline.seconds, 1),
                            "max_model_len": gate.baseline.max_model_len},
               "verdicts": verdicts, "seconds": round(time.monotonic() - t0, 1), "cells": []}
    print_quality(archive)
    archive_mod.save_outputs(archive, args.out, None)
    return 0 if all(v["passed"] for v in verdicts) else 1


async def _check_all(gate: Gate, points: list[tuple[str, list[str]]]) -> list[dict]:
    await gate.run_baseline()           # its failure ends the run: there is nothing to compare
    verdicts = []
    for spec, flags in points:
        try:
            verdict = await gate.check(flags)
        except RuntimeError as e:       # this candidate's engine would not start
            verdict = {"candidate_flags": flags, "passed": False, "metrics": {},
                       "errors": [str(e)]}
        verdicts.append({"spec": spec, **verdict})
    return verdicts


def print_quality(archive: dict) -> None:
    """The table: a row per measure, a column per candidate, each value with ok / FAIL."""
    cfg, verdicts = archive["config"], archive["verdicts"]
    s = cfg["suite"]
    base = " ".join(cfg["baseline"]) or "the engine's defaults"
    print(f"\nquality gate: {cfg['model']}, baseline {base}; {s['prompts']} prompts x "
          f"{s['max_tokens']} greedy tokens; numbers: {s['questions']} questions at each of "
          f"{', '.join(map(str, s['contexts'])) or 'no'} tokens of context")
    rows = [["metric", "threshold", *(v["spec"] for v in verdicts)]]
    for title, key, form in (("exact match", "exact_match", "{:.2f}"),
                             ("first divergence, median", "first_divergence_median", "{:.1f}"),
                             ("top-1 agreement", "top1_agreement", "{:.3f}"),
                             ("numbers quoted", "numbers_quoted", "{:.2f}")):
        ms = [v["metrics"].get(key) for v in verdicts]
        bar = next((m["threshold"] for m in ms if m), None)
        rows.append([title, "-" if bar is None else ">= " + form.format(bar)]
                    + ["-" if m is None else form.format(m["value"]) + (
                        "" if m["threshold"] is None else " ok" if m["passed"] else " FAIL")
                       for m in ms])
    rows.append(["  the baseline's", ""] + [
        f"{v['metrics']['numbers_quoted']['baseline']:.2f}" if v["metrics"] else "-"
        for v in verdicts])
    contexts = {c: r["prompt_tokens"] for v in verdicts
                for c, r in v.get("numbers_by_context", {}).items()}
    for context, tokens in contexts.items():
        cells = [v.get("numbers_by_context", {}).get(context) for v in verdicts]
        rows.append([f"  at {context} ({tokens} tok)", "candidate/base"]
                    + ["-" if r is None else f"{r['candidate']}/{r['questions']} vs "
                       f"{r['baseline']}/{r['questions']}" for r in cells])
    rows.append(["engine time, s", f"base {archive['baseline']['seconds']:.0f}"]
                + [f"{v['seconds']['candidate']:.0f}" if "seconds" in v else "-"
                   for v in verdicts])
    rows.append(["verdict", ""] + ["PASS" if v["passed"] else "FAIL" for v in verdicts])
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        print(row[0].ljust(widths[0]) + "".join(c.rjust(w) for c, w in zip(row[1:], widths[1:])))
        if n == 0:
            print("-" * sum(widths))
    for v in verdicts:
        if v.get("errors"):
            print(f"{v['spec']}: {len(v['errors'])} errors, first: {v['errors'][0]}",
                  file=sys.stderr)
        failed = [k for k, m in v["metrics"].items() if not m["passed"]] or ["engine errors"]
        print(f"{v['spec']}: " + ("passes the gate" if v["passed"] else
                                  "reported, not recommended: below the gate on "
                                  + ", ".join(failed)))
    print(f"wall time {archive['seconds']:.0f} s")
