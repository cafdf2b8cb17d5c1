"""Running a `prefixgate tune` sweep: one fresh engine per grid point, the same workload on
each, and the recommendation.

Every point gets a new engine process (nothing cached from the point before), a warm-up that
is not counted, then the measured requests, each streamed and timed on the client from just
before it is sent to its first content event, with fixed output lengths (`ignore_eos`) so
points compare like for like. Meanwhile the engine's /metrics is polled for its KV cache use;
its preemption counter is read before and after.

The recommendation is the point with the highest goodput (requests per second that met the
TTFT SLO, and the TPOT SLO when one is set) among those whose p99 TTFT meets the SLO and whose
numerics passed the quality gate (only points that change numerics need it: proxy/bench/
quality.py, against the engine's defaults on the same prompts).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field

from prefixgate.common.percentiles import percentile
from prefixgate.common.processes import ServerProcess
from prefixgate.common.runtime import free_port
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.client import Sample
from prefixgate.proxy.bench.prompts import Lengths, PromptSet, PromptSpec
from prefixgate.proxy.bench.stats import summarize
from prefixgate.proxy.doctor import scrape as pm
from prefixgate.proxy.tune.grid import Point


@dataclass
class Workload:
    tiers: list[int] = field(default_factory=lambda: [512, 2400])
    shared: float = 0.8              # of each tier's prompt, a system prompt shared by all
    prompts_file: str | None = None  # JSONL of request bodies instead of the tiers
    concurrency: int = 8             # users, back to back (closed loop)
    think_ms: float = 0.0
    requests: int = 48               # measured per point
    warmup: int = 8                  # per point, not measured
    max_tokens: int = 32             # every answer's length (ignore_eos)
    slo_ttft_ms: float = 600.0
    slo_tpot_ms: float | None = None
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)   # bundled engine's
    seed: int = 0


class Prompts:
    """Request i's body (messages, or a prompt for /v1/completions) and its tier's name."""

    def __init__(self, w: Workload, lengths: Lengths):
        self.path, self.lines, self.sets = "/v1/chat/completions", [], []
        if w.prompts_file:
            self.lines = read_prompts(w.prompts_file)
            if "prompt" in self.lines[0]:
                self.path = "/v1/completions"
        else:
            salt = f"{random.random()}"    # a rerun meets no cache of this one's requests
            self.sets = [PromptSet(PromptSpec(t, w.shared, seed=w.seed, salt=salt), lengths)
                         for t in w.tiers]

    def tier(self, i: int) -> str:
        return "file" if self.lines else str(self.sets[i % len(self.sets)].spec.tokens)

    def body(self, i: int) -> dict:
        if self.lines:
            return dict(self.lines[i % len(self.lines)])
        return self.sets[i % len(self.sets)].body(i)


def read_prompts(path: str) -> list[dict]:
    """`--prompts FILE.jsonl`: one request body per line, all `messages` (chat) or all
    `prompt` (completions); ValueError naming the line that is neither."""
    lines = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                body = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            kind = isinstance(body, dict) and ("messages" in body or "prompt" in body)
            if not kind:
                raise ValueError(f"{path}:{n}: a request body needs `messages` or `prompt`")
            lines.append({k: v for k, v in body.items() if k in ("messages", "tools", "prompt")})
    if not lines:
        raise ValueError(f"{path}: no prompts")
    if len({"prompt" in b for b in lines}) > 1:
        raise ValueError(f"{path}: mixes `messages` and `prompt` bodies; use one kind")
    return lines


class CommandEngine:
    """Any engine from a command template (`--engine-cmd`): `{port}`, `{flags}` and `{model}`
    filled in, ready when its /health answers 200 (the launcher: common/processes.py)."""

    def __init__(self, template: str, model: str, flags: list[str], timeout_s: float = 600):
        port = free_port()
        self.urls = [f"http://127.0.0.1:{port}"]
        argv = shlex.split(template.format(
            port=port, model=model, flags=" ".join(shlex.quote(f) for f in flags)))
        # own_port=False: a template may run a container whose port another process forwards
        self.process = ServerProcess(argv, self.urls[0], what=f"engine `{shlex.join(argv)}`",
                                     inherit_output=True, own_port=False)
        self.timeout_s = timeout_s

    async def start(self) -> None:
        await self.process.start().ready(self.timeout_s, interval=0.25)

    async def stop(self) -> None:
        await self.process.close(15)


async def start_engine(point: Point, w: Workload, model: str, engine_cmd: str | None):
    """The point's engine, started and ready (RuntimeError when it cannot start)."""
    if engine_cmd:
        engine = CommandEngine(engine_cmd, model, point.flags())
        try:
            await engine.start()
        except BaseException:
            await engine.stop()
            raise
        return engine
    return await target.start_engines(["both"], [*point.flags(), "--log-level", "warning"],
                                      w.threads, model=model)


async def measure_point(point: Point, w: Workload, prompts: Prompts, model: str,
                        engine_cmd: str | None, timeout: float) -> dict:
    """One point: its engine, the warm-up and measured requests, its figures (a point whose
    engine would not start or answer is a row with its error, and the sweep goes on)."""
    started = time.monotonic()
    try:
        engine = await start_engine(point, w, model, engine_cmd)
    except (RuntimeError, OSError) as e:
        return failed(point, f"the engine did not start: {e}")
    peak = KVPeak()
    try:
        async with target.client_session(timeout) as session:
            url = engine.urls[0]
            name, _ = await target.pick_model(session, url, {}, None)
            before = await archive_mod.snapshot(session, url, "/metrics", {})
            poller = asyncio.ensure_future(peak.poll(session, url))

            def body(i: int) -> dict:
                # (the body's own messages or prompt: "chat" adds it as it is)
                return target.request_body(prompts.body(i), name, w.max_tokens, True, "chat")
            try:
                samples = await target.measure(
                    session, url + prompts.path, {}, body, requests=w.requests,
                    warmup=w.warmup, concurrency=w.concurrency, think_s=w.think_ms / 1000.0,
                    seed=w.seed, label=point.label)
            finally:
                poller.cancel()
            after = await archive_mod.snapshot(session, url, "/metrics", {})
    except target.TargetError as e:
        return failed(point, str(e))
    finally:
        await engine.stop()
    cell = target.cell_record(point.label, {"point": dict(point.values),
                                            "flags": point.flags()}, samples,
                              w.slo_ttft_ms / 1000.0)
    cell["summary"].update(point_figures(samples, prompts, w, peak.value,
                                         preemptions(before, after)))
    cell["summary"]["point_s"] = round(time.monotonic() - started, 1)
    return cell


def failed(point: Point, error: str) -> dict:
    return {"label": point.label, "point": dict(point.values), "flags": point.flags(),
            "error": error, "samples": [], "summary": {}}


class KVPeak:
    """The highest KV cache use an engine's /metrics reported while polled (every 0.1 s: a
    small point on a fast engine is over between two slower polls)."""

    def __init__(self):
        self.value: float | None = None

    async def poll(self, session, url: str, every_s: float = 0.1) -> None:
        while True:
            text = await archive_mod.snapshot(session, url, "/metrics", {})
            got = pm.get(pm.parse(text), "kv_usage")
            if got is not None:
                self.value = max(self.value or 0.0, got[1])
            await asyncio.sleep(every_s)


def preemptions(before: str | None, after: str | None) -> float | None:
    a, b = (pm.get(pm.parse(t), "preemptions") for t in (after, before))
    return None if a is None else a[1] - (b[1] if b else 0.0)


def point_figures(samples: list[Sample], prompts: Prompts, w: Workload, kv_peak, preempted):
    """What a point adds to the bench summary: goodput under both SLOs, p95 TTFT per tier,
    p99 TPOT, KV use, preemptions, and whether its p99 TTFT met the SLO."""
    measured = [s for s in samples if not s.warmup]
    ok = [s for s in measured if s.ok]
    slo_ttft = w.slo_ttft_ms / 1000.0
    slo_tpot = w.slo_tpot_ms / 1000.0 if w.slo_tpot_ms else None
    good = [s for s in ok if s.ttft <= slo_ttft and (
        slo_tpot is None or s.tpot is None or s.tpot <= slo_tpot)]
    wall = summarize(samples, slo_ttft)["wall_s"]
    tiers: dict[str, list[float]] = {}
    for s in ok:
        tiers.setdefault(prompts.tier(s.index), []).append(s.ttft)
    tpot = [s.tpot for s in ok if s.tpot is not None]
    p99 = percentile([s.ttft for s in ok], 99)
    return {"goodput_req_per_s": round(len(good) / wall, 3) if wall else None,
            "goodput_frac": round(len(good) / len(measured), 4) if measured else None,
            "ttft_p95_ms_by_tier": {t: round(1000 * percentile(v, 95), 1)
                                    for t, v in tiers.items()},
            "tpot_p99_ms": round(1000 * percentile(tpot, 99), 2) if tpot else None,
            "kv_usage_peak": kv_peak, "preemptions": preempted,
            "meets_slo": bool(ok) and len(ok) == len(measured) and p99 is not None
            and p99 <= slo_ttft and (slo_tpot is None or not tpot
                                     or percentile(tpot, 99) <= slo_tpot)}


def recommend(cells: list[dict], gates: dict[str, dict]) -> dict | None:
    """The cell with the highest goodput among those that met the SLO and, when their
    numerics differ from the defaults', passed the quality gate; None: no point qualifies."""
    def eligible(c: dict) -> bool:
        gate = gates.get(c["label"])
        return (not c.get("error") and c["summary"].get("meets_slo")
                and (gate is None or gate.get("passed")))
    best = [c for c in cells if eligible(c)]
    if not best:
        return None
    return max(best, key=lambda c: (c["summary"]["goodput_req_per_s"] or 0.0,
                                    -(c["summary"]["ttft_p99_ms"] or 0.0)))


async def sweep(points: list[Point], w: Workload, lengths: Lengths, model: str, *,
                engine_cmd: str | None = None, budget_s: float | None = None,
                timeout: float = 600.0, gate=None) -> dict:
    """Measure every point (the defaults first) within the budget, gate those that change
    numerics (`gate(point) -> dict` with `passed`; None: no gate), recommend one."""
    prompts = Prompts(w, lengths)
    started, cells, skipped = time.monotonic(), [], []
    todo = [Point(), *(p for p in points if p.values)]
    for n, point in enumerate(todo, 1):
        spent = time.monotonic() - started
        pace = spent / len(cells) if cells else 0.0
        if budget_s is not None and cells and spent + pace > budget_s:
            skipped = [p.label for p in todo[n - 1:]]
            print(f"budget: {spent / 60:.1f} of {budget_s / 60:.1f} min spent; skipping "
                  f"{len(skipped)} point(s)", file=sys.stderr, flush=True)
            break
        print(f"[point {n}/{len(todo)}] {point.label}: starting the engine "
              f"({shlex.join(point.flags()) or 'its defaults'})", file=sys.stderr, flush=True)
        cells.append(await measure_point(point, w, prompts, model, engine_cmd, timeout))
    gates = {}
    if gate is not None:
        for cell, point in zip(cells, todo):
            if not point.numerics() or cell.get("error") or not cell["summary"].get("meets_slo"):
                continue            # (a point that missed the SLO is not recommended anyway)
            if budget_s is not None and time.monotonic() - started > budget_s:
                gates[cell["label"]] = {"passed": False, "note": "not gated: over the budget"}
                continue
            print(f"quality gate: {point.label}", file=sys.stderr, flush=True)
            gates[cell["label"]] = await gate(point)
    for cell in cells:
        cell["gate"] = gates.get(cell["label"])
    best = recommend(cells, gates)
    return {"schema": archive_mod.SCHEMA, "kind": "tune",
            "config": {"model": model, "engine_cmd": engine_cmd, "workload": asdict(w),
                       "grid": [p.label for p in points], "budget_s": budget_s,
                       "endpoint": prompts.path},
            "environment": archive_mod.environment(), "cells": cells, "skipped": skipped,
            "recommended": best and {"label": best["label"], "flags": best["flags"],
                                     "point": best["point"]},
            "wall_s": round(time.monotonic() - started, 1)}
