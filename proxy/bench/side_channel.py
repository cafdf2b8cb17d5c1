"""The prompt-stealing timing side channel of a shared prefix cache, measured through the
gateway: `python -m prefixgate.proxy.bench.side_channel`.

One bundled engine (`prefixgate backend`, pinned to `--cores` with taskset, one torch thread)
behind one gateway (in this process, no plugins: nothing but the engine caches a prompt, and
with one upstream no routing decision can depend on one) with two API keys, tenant A and
tenant B, run once per isolation mode: `isolation: {cache: shared}` (no salt) and
`{cache: per_key}` (the default with keys: each tenant's `cache_salt`). Each mode gets a fresh
engine and runs the same trials. A trial:

  1. a secret document of `--doc-tokens` random words (exact, by the model's tokenizer), new
     for the trial, and a decoy of the same length;
  2. tenant A sends, as a chat request with max_tokens 1, the secret or the decoy (the
     trial's label, drawn at random, half each); the engine does the same work either way, so
     the only difference the probe can meet is whether the secret's blocks are in the cache;
  3. a pause of `--pause-ms` (the engine idle again);
  4. tenant B probes: a streamed chat request whose prompt is the secret document followed by
     a question, max_tokens 1; its TTFT (to the first content event, as `prefixgate bench`
     measures it) and the cached tokens the engine reports (`cached_tokens`).

Before the measured trials, `--warmup` trials of the same shape (not counted) warm the engine.
The KV cache holds `--kv-trials` trials' prompts: a trial's secret, sent last, is never evicted
before its probe; older trials' blocks, never asked for again, go in LRU order, the same work
whatever the label.

The classifier: one TTFT threshold and a direction (faster means "A sent it", or slower), the
pair with the best accuracy on the trials it is fitted on. The trials are split in two halves
(even and odd, each half balanced between the labels); the threshold fitted on one half judges
the other, both ways round, so every trial is judged once by a threshold fitted without it
(the held-out accuracy, with its one-sided binomial p-value against chance). The best
threshold fitted on all trials and judged on them too is an upper bound (biased upwards by
the fit). Target (issue #41): per_key held-out accuracy <= 55%.

Prints per mode and label the probes' TTFT p10/p50/p90 and cached tokens, and the accuracies;
`prefill acc %` is the held-out classifier on the engine's own prefill time instead (its
Server-Timing `prefill` entry, which the gateway relays to the client). `--out FILE` saves
them with every trial and the environment as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp

from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.backend.config import resolve_model
from prefixgate.common.percentiles import percentile
from prefixgate.common.runtime import start_app
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench.client import Sample, stream_once
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from prefixgate.proxy.bench.stats import fmt
from prefixgate.proxy.config import gateway as config_mod

SCHEMA = "prefixgate-side-channel/1"
SERVED = "bench"
MODES = ("shared", "per_key")
TENANTS = {"tenant-a": "sk-side-channel-tenant-a-0001", "tenant-b": "sk-side-channel-tenant-b-0002"}
QUESTION = "\n\nQuestion: what is this document about?"
TARGET_ACCURACY = 0.55          # per_key, held out (issue #41)
QUANTILES = (10, 50, 90)


@dataclass(frozen=True)
class Workload:
    trials: int = 200            # measured trials per mode
    doc_tokens: int = 512        # the secret document (and the decoy)
    warmup: int = 4              # trials per mode before the measured ones (not counted)
    pause_ms: float = 100.0      # between A's request and B's probe
    kv_trials: int = 16          # the KV cache holds this many trials' prompts
    block_size: int = 16
    cores: str = "0"             # taskset cores for the engine
    threads: int = 1             # the engine's torch threads
    seed: int = 0
    timeout_s: float = 120.0

    def kv_blocks(self) -> int:
        # two prompts a trial (A's and B's), each the document plus the template, the question
        # and a partial block
        per_prompt = math.ceil((self.doc_tokens + 64) / self.block_size) + 1
        return 2 * per_prompt * self.kv_trials + 16

    def engine_args(self) -> list[str]:
        return ["--served-model-name", SERVED, "--device", "cpu",
                "--block-size", str(self.block_size), "--num-kv-blocks", str(self.kv_blocks()),
                "--max-num-seqs", "4", "--log-level", "warning"]


def labels(trials: int, seed: int) -> list[bool]:
    """Whether A sends the secret in each trial: trials alternate between the two halves (even,
    odd), and each half is a shuffled list of as many True as False (one more of either, at
    random, when the half is odd), so chance is 50% in each."""
    rng = random.Random(f"{seed}:labels")
    out = [False] * trials
    for half in (0, 1):
        idx = list(range(half, trials, 2))
        sent = [True] * (len(idx) // 2) + [False] * (len(idx) // 2)
        if len(idx) % 2:
            sent.append(rng.random() < 0.5)
        rng.shuffle(sent)
        for i, s in zip(idx, sent):
            out[i] = s
    return out


# -- the classifier -----------------------------------------------------------------------

def fit_threshold(points: list[tuple[float, bool]]) -> dict:
    """The threshold and direction that classify `points` ((ttft, sent) pairs) best: "sent"
    when ttft < threshold (`faster_is_sent`) or when ttft > threshold; ties go to the first
    found (candidates: below every value, each midpoint, above every value)."""
    xs = sorted({x for x, _ in points})
    if not xs:
        return {"threshold_ms": None, "faster_is_sent": True, "accuracy": None}
    cands = [xs[0] - 1.0] + [(a + b) / 2 for a, b in zip(xs, xs[1:])] + [xs[-1] + 1.0]
    best = None
    for faster in (True, False):
        for t in cands:
            acc = accuracy(points, t, faster)
            if best is None or acc > best[0]:
                best = (acc, t, faster)
    return {"threshold_ms": round(best[1], 3), "faster_is_sent": best[2],
            "accuracy": round(best[0], 4)}


def correct(points: list[tuple[float, bool]], threshold: float, faster_is_sent: bool) -> int:
    """How many of `points` the threshold classifies right."""
    return sum(1 for x, sent in points if ((x < threshold) == faster_is_sent) == sent)


def accuracy(points: list[tuple[float, bool]], threshold: float, faster_is_sent: bool) -> float:
    return correct(points, threshold, faster_is_sent) / len(points) if points else 0.0


def binomial_p(right: int, n: int) -> float:
    """P(at least `right` of `n` correct by chance): the one-sided binomial test at 1/2."""
    return sum(math.comb(n, k) for k in range(right, n + 1)) / 2 ** n if n else 1.0


def classify(trials: list[dict]) -> dict:
    """Held-out accuracy (fit on one half, judge the other, both ways) and the best threshold
    on all trials (module doc)."""
    halves = [[(t["ttft_ms"], t["sent"]) for t in trials if t["half"] == h
               and t["ttft_ms"] is not None] for h in (0, 1)]
    folds, right, n = [], 0, 0
    for fit, judge in ((0, 1), (1, 0)):
        model = fit_threshold(halves[fit])
        if model["threshold_ms"] is None or not halves[judge]:
            continue
        hits = correct(halves[judge], model["threshold_ms"], model["faster_is_sent"])
        folds.append({"fitted_on": fit, "judged": judge, "threshold_ms": model["threshold_ms"],
                      "faster_is_sent": model["faster_is_sent"],
                      "fit_accuracy": model["accuracy"],
                      "held_out_accuracy": round(hits / len(halves[judge]), 4)})
        right += hits
        n += len(halves[judge])
    held = round(right / n, 4) if n else None
    best = fit_threshold(halves[0] + halves[1])
    return {"held_out_accuracy": held, "held_out_right": right, "held_out_n": n,
            "p_value": float(f"{binomial_p(right, n):.3g}") if n else None, "folds": folds,
            "best_threshold_accuracy": best["accuracy"], "best_threshold_ms": best["threshold_ms"],
            "best_faster_is_sent": best["faster_is_sent"]}


# -- one mode -----------------------------------------------------------------------------

class Documents:
    """Secret documents and decoys: `doc_tokens` random words each, exact by the tokenizer."""

    def __init__(self, lengths: Lengths, w: Workload):
        self.lengths, self.w = lengths, w

    def pair(self, trial: int) -> tuple[str, str]:
        # the same for every mode: each mode meets the same documents, labels and order
        rng = random.Random(f"{self.w.seed}:doc:{trial}")
        return (self.lengths.text(rng, self.w.doc_tokens),
                self.lengths.text(rng, self.w.doc_tokens))


def chat_body(content: str) -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": content}],
            "max_tokens": 1, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def gateway_config(engine_url: str, mode: str, timeout: float) -> dict:
    return {"upstreams": [{"name": "engine0", "url": engine_url}], "plugins": [],
            "auth": {"api_keys": [{"key": k, "name": n} for n, k in TENANTS.items()]},
            "isolation": {"cache": mode},
            "timeouts": {"first_byte": timeout, "idle": timeout}}


def headers(tenant: str) -> dict:
    return {"Authorization": f"Bearer {TENANTS[tenant]}"}


async def trial(session, url: str, docs: Documents, i: int, sent: bool, pause_s: float,
                warmup: bool) -> dict:
    secret, decoy = docs.pair(i)
    a = await stream_once(session, url, chat_body(secret if sent else decoy),
                          headers("tenant-a"), Sample(index=i, warmup=warmup))
    await asyncio.sleep(pause_s)
    b = await stream_once(session, url, chat_body(secret + QUESTION), headers("tenant-b"),
                          Sample(index=i, warmup=warmup))
    return {"trial": i, "sent": sent, "half": i % 2, "warmup": warmup,
            "ttft_ms": None if b.ttft is None else round(b.ttft * 1e3, 3),
            "cached_tokens": b.cached_tokens, "prompt_tokens": b.prompt_tokens,
            "a_ttft_ms": None if a.ttft is None else round(a.ttft * 1e3, 3),
            "a_cached_tokens": a.cached_tokens, "a_prompt_tokens": a.prompt_tokens,
            "server_timing": b.server_timing, "error": a.error or b.error}


async def run_mode(mode: str, w: Workload, model: str, lengths: Lengths) -> dict:
    """A fresh engine and a gateway in `mode`; the warm-up and measured trials."""
    env = {**os.environ, "OMP_NUM_THREADS": str(w.threads)}
    engine = engine_process(model, *w.engine_args(), cores=w.cores, env=env,
                            inherit_output=True)
    docs = Documents(lengths, w)
    sent = labels(w.trials, w.seed)
    warm_sent = [j % 2 == 0 for j in range(w.warmup)]
    out = []
    runner = None
    t0 = time.monotonic()
    try:
        await engine.start().ready(600)
        gw = Gateway(config_mod.validate(gateway_config(engine.url, mode, w.timeout_s)))
        runner, base = await start_app(gw.make_app(), "127.0.0.1", 0)
        url = base + "/v1/chat/completions"
        progress = archive_mod.Progress(w.warmup + w.trials, f"side channel {mode}")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=w.timeout_s)) as s:
            for j in range(w.warmup):
                out.append(await trial(s, url, docs, -1 - j, warm_sent[j], w.pause_ms / 1e3,
                                       True))
                progress.step(out[-1]["error"] is None)
            for i in range(w.trials):
                out.append(await trial(s, url, docs, i, sent[i], w.pause_ms / 1e3, False))
                progress.step(out[-1]["error"] is None)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engine.close()
    return mode_record(mode, out, time.monotonic() - t0)


def arm(trials: list[dict], sent: bool) -> dict:
    """The probes of one label: their count, TTFT percentiles (ms) and cached tokens."""
    xs = [t for t in trials if t["sent"] == sent]
    ttft = [t["ttft_ms"] for t in xs if t["ttft_ms"] is not None]
    cached = [t["cached_tokens"] or 0 for t in xs if t["error"] is None]
    out = {"n": len(xs)}
    for q in QUANTILES:
        v = percentile(ttft, q)
        out[f"ttft_p{q}_ms"] = None if v is None else round(v, 3)
    out["cached_tokens_min"] = min(cached, default=None)
    out["cached_tokens_p50"] = percentile(cached, 50)
    out["cached_tokens_max"] = max(cached, default=None)
    out["probes_with_cached_tokens"] = sum(1 for c in cached if c > 0)
    return out


def mode_record(mode: str, trials: list[dict], wall_s: float) -> dict:
    measured = [t for t in trials if not t["warmup"]]
    ok = [t for t in measured if t["error"] is None]
    errors = [t["error"] for t in measured if t["error"]]
    rec = {"mode": mode, "wall_s": round(wall_s, 1), "errors": len(errors),
           "sent": arm(ok, True), "not_sent": arm(ok, False), "classifier": classify(ok),
           "trials": trials}
    # the engine's own prefill time, which the gateway relays in Server-Timing: the same
    # channel, timed without the network and the client
    prefill = [{**t, "ttft_ms": t["server_timing"]["prefill"]} for t in ok
               if "prefill" in (t.get("server_timing") or {})]
    if prefill:
        rec["prefill_classifier"] = classify(prefill)
    if errors:
        rec["first_error"] = errors[0]
    if mode == "per_key":
        acc = rec["classifier"]["held_out_accuracy"]
        rec["target"] = {"held_out_accuracy_at_most": TARGET_ACCURACY,
                         "met": acc is not None and acc <= TARGET_ACCURACY}
    return rec


async def run(w: Workload, model: str, modes: list[str]) -> dict:
    tokenizer = load_tokenizer(str(resolve_model(model)))
    lengths = Lengths(tokenizer)
    records = [await run_mode(mode, w, model, lengths) for mode in modes]
    return {"schema": SCHEMA, "environment": archive_mod.environment(),
            "config": {"model": model, "modes": modes, "workload": asdict(w),
                       "kv_blocks": w.kv_blocks()},
            "modes": records}


# -- the report ---------------------------------------------------------------------------

def _pct(v: float | None) -> float | None:
    return None if v is None else 100.0 * v


def print_report(archive: dict) -> None:
    cfg, w = archive["config"], archive["config"]["workload"]
    print(f"\nside channel: tenant B probes tenant A's secret {w['doc_tokens']}-token document "
          f"through one gateway (two keys) in front of one bundled engine on {cfg['model']} "
          f"(taskset -c {w['cores']}, {w['threads']} thread); {w['trials']} trials per mode, "
          f"A sent the secret in half (else a decoy of the same length); TTFT of B's probe in "
          f"ms, cached = the engine's cached_tokens of the probe")
    head = (f"{'mode':<9}{'A sent?':<9}{'n':>5}{'p10':>9}{'p50':>9}{'p90':>9}"
            f"{'cached min':>12}{'p50':>6}{'max':>6}")
    print(head + "\n" + "-" * len(head))
    for m in archive["modes"]:
        for key, label in (("sent", "yes"), ("not_sent", "no")):
            a = m[key]
            print(f"{m['mode']:<9}{label:<9}{fmt(a['n'], 5)}"
                  + "".join(fmt(a[f"ttft_p{q}_ms"], 9, 1) for q in QUANTILES)
                  + fmt(a["cached_tokens_min"], 12) + fmt(a["cached_tokens_p50"], 6, 0)
                  + fmt(a["cached_tokens_max"], 6))
    head = (f"{'mode':<9}{'held-out acc %':>15}{'p (chance)':>12}{'best-threshold acc %':>22}"
            f"{'threshold ms':>14}{'prefill acc %':>15}{'errors':>8}")
    print("\n" + head + "\n" + "-" * len(head))
    for m in archive["modes"]:
        c = m["classifier"]
        p = c["p_value"]
        print(f"{m['mode']:<9}" + fmt(_pct(c["held_out_accuracy"]), 15, 1)
              + ("-".rjust(12) if p is None else f"{p:12.3g}")
              + fmt(_pct(c["best_threshold_accuracy"]), 22, 1)
              + fmt(c["best_threshold_ms"], 14, 1)
              + fmt(_pct((m.get("prefill_classifier") or {}).get("held_out_accuracy")), 15, 1)
              + fmt(m["errors"], 8))
    for m in archive["modes"]:
        if "target" in m:
            acc = m["classifier"]["held_out_accuracy"]
            print(f"\nper_key held-out accuracy {fmt(_pct(acc), 0, 1).strip()}% (target <= "
                  f"{100 * TARGET_ACCURACY:g}%: {'met' if m['target']['met'] else 'NOT met'})")
        if m.get("first_error"):
            print(f"{m['mode']}: first error: {m['first_error']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.proxy.bench.side_channel",
                                description=__doc__.split("\n")[0])
    d = Workload()
    p.add_argument("--model", default="demo",
                   help="the engine's model: demo (default), smollm2, a .gguf or a directory")
    p.add_argument("--trials", type=int, default=d.trials,
                   help="measured trials per mode (default %(default)s)")
    p.add_argument("--doc-tokens", type=int, default=d.doc_tokens,
                   help="the secret document's tokens (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="trials per mode before the measured ones (default %(default)s)")
    p.add_argument("--pause-ms", type=float, default=d.pause_ms,
                   help="pause between A's request and B's probe (default %(default)s)")
    p.add_argument("--kv-trials", type=int, default=d.kv_trials,
                   help="the KV cache holds this many trials' prompts (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="isolation modes to run, in order (default %(default)s)")
    p.add_argument("--cores", default=d.cores, help="taskset cores for the engine (default 0)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="the engine's torch threads (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=None, help="save the results with every trial as JSON here")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes: {', '.join(bad) or 'none'}: choose from {', '.join(MODES)}")
    if args.trials < 2 or args.doc_tokens < 1:
        p.error("--trials must be >= 2 and --doc-tokens >= 1")
    w = Workload(trials=args.trials, doc_tokens=args.doc_tokens, warmup=args.warmup,
                 pause_ms=args.pause_ms, kv_trials=max(args.kv_trials, 2), cores=args.cores,
                 threads=args.threads, seed=args.seed)
    try:
        archive = asyncio.run(run(w, args.model, modes))
    except (RuntimeError, OSError, ValueError) as e:
        print(f"side channel: {e}", file=sys.stderr)
        return 1
    print_report(archive)
    if args.out:
        archive_mod.write(args.out, archive)
        print(f"archive written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
