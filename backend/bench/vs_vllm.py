"""The bundled engine beside vLLM: `python -m prefixgate.backend.bench.vs_vllm`.

The same model (`--model`, smollm2 by default: the GGUF for ours, its Hugging Face export for
vLLM, with the same weights and token ids), the same dtype, prompts (seeded random token ids),
step budget and KV cache size; each engine a server on loopback whose whole process tree runs
on the same cores (`--cores`: one, or a set such as `0,1`, one thread per core each) from its
launch (bench/pinned_servers.py); the engines measured one after the other, never at once,
client-side over HTTP streaming from another core (`--client-core`: this process and vLLM's
client; with every core the engines', the client shares them); vLLM compiled, as it runs by default
(`--vllm-mode eager`: `--enforce-eager`); a warm-up request first, fixed output lengths
(`ignore_eos`), medians over `--repeats`.
First, the machine's limits on those cores (bench/limits.py, in a process of its own under
`taskset`, one thread per core): each engine's TTFT and decode figures are also reported as
fractions of their floors (floor / measured: 1.0 is the machine's limit).
  agree    greedy agreement: a few chats, `return_token_ids`: per chat, are the prompt's and
           the answer's token ids the same, and where does the answer first differ.
  ttft     TTFT at each of `--tiers` prompt tokens, cold, and with a cached prefix: 80% of the
           prompt in whole 128-token blocks (vLLM's CPU block, so both can keep all of it)
           served just before, then that prefix with a new suffix.
  decode   `--batches` concurrent 128-token generations of 32-token prompts; tok/s = batch /
           the median request's time per output token.
  chunked  a 4,000-token prompt sent just before 16 short ones: the short ones' p95 TTFT, with
           chunked prefill on both (`--max-num-batched-tokens`, the step budget of both).
  vllm_client  vLLM's own benchmark client against each engine (bench/vllm_client.py):
           `random` 1,024 -> 64 tokens at 0.5 and 0.25 requests/s, `prefix_repetition`;
           request throughput, TTFT p50/p95, TPOT p50.
Then the memory of each server's process tree. Ratios are ours over vLLM in speed (>1: ours is
faster) and in memory (<1: ours holds less). Targets: TTFT with a cached prefix >= 1.0x,
decode tok/s >= 0.8x.
Fairness, checked: each tree's CPU seconds are read before and after every part (and every
tier, batch and client run); a tree on N cores that used more CPU seconds than N times the wall
seconds is a pinning failure: the run says so, saves what it has and exits with 1. The JSON records
`lscpu`, and each tree's processes with their thread counts and cores once ready and at the
end.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from prefixgate.backend.bench import pinned_servers, vllm_client
from prefixgate.backend.bench.completions import stream_completion
from prefixgate.backend.bench.limits import Floors
from prefixgate.backend.bench.measures import decode_rate, shorts_behind_long
from prefixgate.backend.bench.script import int_list, run_report_save, save_json
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.vocab import vocab_size
from prefixgate.proxy.testing.vllm_install import VLLM_VERSION

SERVED_NAME = pinned_servers.SERVED_NAME
ENGINES = {"ours": pinned_servers.ours, "vllm": pinned_servers.vllm}
PARTS = ("agree", "ttft", "decode", "chunked", "vllm_client")
TARGETS = {"ttft_cached": 1.0, "decode": 0.8}
BLOCK = 128                 # vLLM's CPU KV block: cached prefixes are whole ones
SHARE = 0.8
CHATS = ("What is the capital of France?", "Write a haiku about the sea.",
         "Explain what a hash table is in two sentences.",
         "Give me three tips for learning to cook.")


class Sizes:
    """How big each part is: a full run's sizes, or `--quick`'s tiny ones."""

    def __init__(self, quick: bool):
        self.chats = CHATS[:1] if quick else CHATS
        self.answer_tokens = 8 if quick else 48
        self.new_tokens = 8 if quick else 128
        self.long_tokens = 512 if quick else 4000
        self.shorts = 4 if quick else 16
        self.decode_context = 32 + self.new_tokens // 2     # decode's mean context, in tokens


async def request(session, url: str, prompt: list[int], max_tokens: int = 1):
    """One streamed greedy completion of token ids (bench/completions.py) by the name both
    engines serve the model under."""
    return await stream_completion(session, url, prompt, max_tokens, SERVED_NAME)


async def chat_token_ids(session, url: str, question: str, max_tokens: int) -> dict:
    body = {"model": SERVED_NAME, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}], "return_token_ids": True}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        answer = await r.json()
    choice = answer["choices"][0]
    return {"prompt_ids": answer["prompt_token_ids"], "ids": choice["token_ids"],
            "text": choice["message"]["content"]}


async def ttft_tier(session, url: str, prompts: Prompts, tokens: int, repeats: int) -> dict:
    prefix_tokens = max(BLOCK, round(tokens * SHARE) // BLOCK * BLOCK)
    cold, warm, cached = [], [], []
    for _ in range(repeats):
        cold.append((await request(session, url, prompts(tokens))).ttft_s)
        prefix = prompts(prefix_tokens)
        await request(session, url, prefix)                          # served before
        hit = await request(session, url, prefix + prompts(tokens - prefix_tokens))
        warm.append(hit.ttft_s)
        cached.append(hit.cached)
    return {"prefix_tokens": prefix_tokens, "cold_s": statistics.median(cold),
            "cached_prefix_s": statistics.median(warm), "cached_tokens_reported": cached,
            "samples_s": {"cold": cold, "cached_prefix": warm}}


async def measure(server: pinned_servers.Running, args, sizes: Sizes,
                  meter: pinned_servers.CpuMeter, clients=None) -> dict:
    """Every part of `args.parts` against one running engine, each inside `meter.part` (its
    tree's CPU and wall seconds), then its memory; vLLM's client runs on `clients`
    (vllm_client.start_clients) when given."""
    prompts = Prompts(vocab_size(args.model), args.seed)     # the same prompts for each engine
    out = {}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        with meter.part("warm-up"):
            await request(s, server.url, prompts(64), max_tokens=8)
        if "agree" in args.parts:
            with meter.part("agree"):
                out["agree"] = [await chat_token_ids(s, server.url, q, sizes.answer_tokens)
                                for q in sizes.chats]
        if "ttft" in args.parts:
            out["ttft"] = {}
            for t in args.tiers:
                with meter.part(f"ttft {t}"):
                    out["ttft"][str(t)] = await ttft_tier(s, server.url, prompts, t,
                                                          args.repeats)
        if "decode" in args.parts:
            out["decode"] = {}
            for b in args.batches:
                with meter.part(f"decode {b}"):
                    out["decode"][str(b)] = await decode_rate(
                        s, server.url, prompts, b, args.repeats, sizes.new_tokens, SERVED_NAME)
        if "chunked" in args.parts:
            with meter.part("chunked"):
                out["chunked"] = await shorts_behind_long(
                    s, server.url, prompts, args.repeats, long_tokens=sizes.long_tokens,
                    shorts=sizes.shorts, head_start_s=0.1,  # the long prompt's prefill has begun
                    model=SERVED_NAME)
        if "vllm_client" in args.parts:
            out["vllm_client"] = await vllm_client.measure(
                server.url, args.model, args.dtype, SERVED_NAME, args.seed, args.quick, meter,
                clients)
    out["memory"] = pinned_servers.tree_memory(server.pid)
    return out


def of_floor(figures: dict, floors: Floors, dtype: str, sizes: Sizes) -> dict:
    """An engine's TTFT and decode figures as fractions of their floors (floor / measured)."""
    out = {}
    for t, tier in figures.get("ttft", {}).items():
        n, cached = int(t), tier["prefix_tokens"]
        out.setdefault("ttft", {})[t] = {
            "cold": floors.prefill_fraction(n, tier["cold_s"], dtype),
            "cached_prefix": floors.prefill_fraction(n - cached, tier["cached_prefix_s"], dtype,
                                                     cached)}
    for b, d in figures.get("decode", {}).items():
        out.setdefault("decode", {})[b] = floors.decode_fraction(
            int(b), d["tpot_p50_s"], dtype, sizes.decode_context)
    return out


def floor_values(floors: Floors, args, sizes: Sizes) -> dict:
    """The floors of the figures measured: TTFT (s) per tier, cold and after its cached prefix
    (the prefix ttft_tier uses), and decode tok/s per batch (batch / the step's floor)."""
    out: dict = {"ttft": {}, "decode": {}}
    for t in args.tiers:
        prefix = max(BLOCK, round(t * SHARE) // BLOCK * BLOCK)
        out["ttft"][str(t)] = {"cold_s": floors.prefill_s(t, args.dtype),
                               "cached_prefix_s": floors.prefill_s(t - prefix, args.dtype,
                                                                   prefix)}
    for b in args.batches:
        step = floors.decode_step(b, args.dtype, sizes.decode_context)
        out["decode"][str(b)] = {"tok_per_s": b / step["s"], "step_s": step["s"],
                                 "bound": step["bound"]}
    return out


def agreement(ours: list[dict], vllm: list[dict], chats) -> list[dict]:
    """Per chat: same prompt ids, same answer ids, and the first answer position that
    differs (None when one answer is the other's prefix or both are equal)."""
    rows = []
    for question, a, b in zip(chats, ours, vllm):
        first = next((i for i, (x, y) in enumerate(zip(a["ids"], b["ids"])) if x != y), None)
        rows.append({"chat": question, "same_prompt_ids": a["prompt_ids"] == b["prompt_ids"],
                     "identical": a["ids"] == b["ids"], "first_divergence": first,
                     "tokens": [len(a["ids"]), len(b["ids"])],
                     "texts": [a["text"], b["text"]]})
    return rows


def table_rows(engines: dict, floors: dict | None = None) -> list[dict]:
    """One row per figure both engines have: label, kind (time: lower is better, rate: higher
    is better, size: MiB), each engine's value, the target key where one applies, and for TTFT
    and decode the floor (floor_values) and each engine's fraction of it; then vLLM's client's
    rows (bench/vllm_client.py)."""
    ours, vllm = engines["ours"], engines["vllm"]
    floors = floors or {}
    rows = []

    def add(label, kind, get, target=None, floor=None, fraction=None):
        row = {"label": label, "kind": kind, "ours": get(ours), "vllm": get(vllm),
               "target": target}
        if floor is not None:
            row["floor"] = floor
            row["of_floor"] = {name: fraction(e["of_floor"]) for name, e in
                               (("ours", ours), ("vllm", vllm)) if "of_floor" in e}
        rows.append(row)
    for t in ours.get("ttft", {}):
        floor = floors.get("ttft", {}).get(t, {})
        add(f"TTFT cold, {int(t):,} tokens", "time", lambda e, t=t: e["ttft"][t]["cold_s"],
            floor=floor.get("cold_s"), fraction=lambda f, t=t: f["ttft"][t]["cold"])
        add(f"TTFT cached prefix, {int(t):,} tokens ({ours['ttft'][t]['prefix_tokens']:,} "
            f"cached)", "time", lambda e, t=t: e["ttft"][t]["cached_prefix_s"], "ttft_cached",
            floor=floor.get("cached_prefix_s"),
            fraction=lambda f, t=t: f["ttft"][t]["cached_prefix"])
    for b in ours.get("decode", {}):
        add(f"decode tok/s, batch {b}", "rate", lambda e, b=b: e["decode"][b]["tok_per_s"],
            "decode", floor=floors.get("decode", {}).get(b, {}).get("tok_per_s"),
            fraction=lambda f, b=b: f["decode"][b])
    if "chunked" in ours:
        add("short-request p95 TTFT behind a long prompt", "time",
            lambda e: e["chunked"]["short_p95_ttft_s"])
    add("memory, process tree PSS", "size", lambda e: e["memory"]["pss_mib"])
    add("memory, process tree RSS", "size", lambda e: e["memory"]["rss_mib"])
    if "vllm_client" in ours and "vllm_client" in vllm:
        rows += vllm_client.table_rows(ours["vllm_client"], vllm["vllm_client"])
    for row in rows:
        row["ratio"] = ratio(row)
    return rows


def ratio(row: dict) -> float | None:
    """Speed ours/vLLM for times and rates (>1: ours faster); size ours/vLLM for memory; None
    where a figure is missing (a client run that answered nothing)."""
    a, b = row["ours"], row["vllm"]
    if not a or not b:
        return None
    return b / a if row["kind"] == "time" else a / b


def _value(kind: str, x: float) -> str:
    return {"time": f"{x * 1e3:,.0f} ms", "rate": f"{x:,.1f}", "size": f"{x:,.0f} MiB"}[kind]


def report(result: dict) -> None:
    cfg = result["config"]
    client, cores = result.get("client_core"), _cores(cfg)
    print(f"\nbundled engine vs vLLM {result.get('vllm_version', '')} "
          f"({cfg.get('vllm_mode', 'eager')}): {cfg['model']}, "
          f"{cfg['dtype']}, both on {cores} from launch (client on "
          f"{'core ' + str(client) if client is not None else 'the same cores'}), step budget "
          f"{cfg['max_num_batched_tokens']} tokens, medians of {cfg['repeats']}")
    if "limits" in result:
        lim = result["limits"]["limits"]
        print(f"  limits of {cores} ({lim['cpu']['model_name']}): GEMM "
              + ", ".join(f"{d} {g:,.0f} GFLOP/s" for d, g in lim["gemm_gflops"].items())
              + f"; memory read {lim['bandwidth_gbs']:.1f} GB/s")
    for name, figures in result["engines"].items():
        parts = figures.get("cpu", {})
        cpu = sum(p["cpu_s"] for p in parts.values())
        wall = sum(p["wall_s"] for p in parts.values())
        threads = sum(p["threads"] for p in figures.get("threads", {}).get("end", []))
        print(f"  {name}: {cpu:,.1f} CPU-s in {wall:,.1f} wall-s over its parts; "
              f"{threads} threads at the end; of floor: " + _fractions(figures))
    for line in result.get("pinning_failures", []):
        print("  " + line)
    for row in result.get("agreement", []):
        verdict = ("identical" if row["identical"] else
                   f"first divergence at token {row['first_divergence']}"
                   if row["first_divergence"] is not None else "one stops earlier")
        print(f"  greedy: {row['chat']!r}: {verdict} ({row['tokens'][0]} vs "
              f"{row['tokens'][1]} tokens; same prompt ids: {row['same_prompt_ids']})")
    if not result.get("rows"):
        return
    print("  ratio: ours/vLLM in speed (>1: ours faster); memory: ours/vLLM (<1: ours smaller);"
          " of floor: floor / measured (1.0: this core's limit)")
    print(f"  {'':52} {'ours':>11} {'vLLM':>11} {'ratio':>7} {'floor':>11} {'of floor':>13}")
    for row in result["rows"]:
        goal = row["target"] and TARGETS[row["target"]]
        r = row["ratio"]
        verdict = (f"  target >= {goal}x: {'met' if r is not None and r >= goal else 'MISSED'}"
                   if goal else "")
        floor = ""
        if row.get("floor") is not None:
            fr = row.get("of_floor", {})
            floor = (f" {_value(row['kind'], row['floor']):>11} "
                     f"{_percent(fr.get('ours')):>6} {_percent(fr.get('vllm')):>6}")
        ratio_text = f"{r:6.2f}x" if r is not None else "     - "
        print(f"  {row['label']:52} {_value(row['kind'], row['ours']):>11} "
              f"{_value(row['kind'], row['vllm']):>11} {ratio_text}{floor}{verdict}")


def _cores(cfg: dict) -> str:
    """`core 0`, or `cores 0,1 (2 threads each)` (`core` in JSON saved before `--cores`)."""
    cores = cfg.get("cores", [cfg.get("core")])
    if len(cores) == 1:
        return f"core {cores[0]}"
    return f"cores {','.join(map(str, cores))} ({len(cores)} threads each)"


def _value(kind: str, x: float | None) -> str:
    if x is None:
        return "-"
    return {"time": f"{x * 1e3:,.0f} ms", "rate": f"{x:,.2f}", "size": f"{x:,.0f} MiB"}[kind]


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _fractions(figures: dict) -> str:
    fr = figures.get("of_floor", {})
    items = [f"TTFT {int(t):,} cold {_percent(f['cold'])}, cached {_percent(f['cached_prefix'])}"
             for t, f in fr.get("ttft", {}).items()]
    items += [f"decode batch {b} {_percent(f)}" for b, f in fr.get("decode", {}).items()]
    return "; ".join(items) or "-"


def machine_limits(args, sizes: Sizes) -> dict:
    """The limits probe (bench/limits.py) on the engines' cores, in a process of its own under
    `taskset`, at one thread per core as the engines run: its JSON (Floors.from_dict reads
    it)."""
    with tempfile.TemporaryDirectory(prefix="prefixgate-limits-") as tmp:
        out = Path(tmp) / "limits.json"
        cmd = ["taskset", "-c", ",".join(map(str, args.cores)), sys.executable, "-m",
               "prefixgate.backend.bench.limits", "--model", args.model,
               "--threads", str(len(args.cores)),
               "--prefill-tokens", ",".join(map(str, args.tiers)),
               "--batches", ",".join(map(str, args.batches)),
               "--context", str(sizes.decode_context), "--out", str(out)]
        subprocess.run(cmd + (["--quick"] if args.quick else []), check=True)
        return json.loads(out.read_text())


def client_core(args) -> int | None:
    """The core this process (our client, vLLM's client) runs on: `--client-core`, else the
    first core this process may use that is not the engines'; None (wherever it runs) when
    the engines have every one."""
    if args.client_core is not None:
        pinned_servers.check_cores((args.client_core,))
        return args.client_core
    others = sorted(os.sched_getaffinity(0) - set(args.cores))
    return others[0] if others else None


@contextlib.contextmanager
def this_process_on(core: int | None):
    """Every thread of this process on `core` while the block runs (threads started in it
    inherit it), then back on its own cores; nothing when `core` is None."""
    if core is None:
        yield
        return
    before = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    try:
        for tid in before:
            os.sched_setaffinity(tid, {core})
    except OSError as e:
        raise pinned_servers.PinningError(f"cannot pin the client to core {core}: {e}") from e
    try:
        yield
    finally:
        for tid, cores in before.items():
            with contextlib.suppress(ProcessLookupError):       # a thread that has ended
                os.sched_setaffinity(tid, cores)


def run(args) -> dict:
    sizes = Sizes(args.quick)
    settings = pinned_servers.Settings(
        args.model, args.dtype, args.cores, args.max_num_batched_tokens, args.max_model_len,
        args.kvcache_gib, Path(args.log_dir) if args.log_dir else None,
        vllm_compiled=args.vllm_mode == "compiled")
    pinned_servers.check_cores(args.cores)
    for folder in (settings.log_dir, args.profile):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    core = client_core(args)
    if core is None or core in args.cores:
        print(f"warning: the client shares the engines' {_cores(vars(args))}", file=sys.stderr)
    result = {"config": dict(vars(args)), "vllm_version": VLLM_VERSION, "targets": TARGETS,
              "client_core": core, "engines": {}}
    with this_process_on(core):
        result["limits"] = machine_limits(args, sizes)
        result["cpu"] = result["limits"]["limits"]["cpu"]               # lscpu
        floors = Floors.from_dict(result["limits"])
        result["floors"] = floor_values(floors, args, sizes)
        for name in args.engines:
            measure_engine(name, settings, args, sizes, floors, result)
    engines = result["engines"]
    if "ours" in engines and "vllm" in engines:
        if "agree" in args.parts:
            result["agreement"] = agreement(engines["ours"]["agree"], engines["vllm"]["agree"],
                                            sizes.chats)
        result["rows"] = table_rows(engines, result["floors"])
    return result


def measure_engine(name: str, settings: pinned_servers.Settings, args, sizes: Sizes,
                   floors: Floors, result: dict) -> None:
    """One engine started, measured (its tree's CPU seconds per part, its threads once ready
    and at the end) and stopped, into `result["engines"][name]`; PinningError (after saving
    what was measured) when it used more than its cores."""
    # vLLM's client imports vLLM (~10 s a run, on this process's core) while the engine starts
    clients = vllm_client.start_clients(args.quick) if "vllm_client" in args.parts else []
    t0 = time.monotonic()
    profile = Path(args.profile) / f"{name}.txt" if args.profile else None
    try:
        with ENGINES[name](settings) as server:
            ready, load = time.monotonic() - t0, os.getloadavg()[0]
            for client in clients:
                client.wait_imported()          # done before anything is measured
            threads = {"ready": pinned_servers.tree_threads(server.pid)}
            meter = pinned_servers.CpuMeter(server.pid, cores=len(args.cores))
            with pinned_servers.profiled(server.pid, profile):
                figures = result["engines"][name] = asyncio.run(
                    measure(server, args, sizes, meter, clients))
            threads["end"] = pinned_servers.tree_threads(server.pid)
    finally:
        for client in clients:
            client.close()
    # the machine's 1-minute load average as the engine's measurements began and ended
    figures.update(load_average=[load, os.getloadavg()[0]], cpu=meter.parts, threads=threads,
                   of_floor=of_floor(figures, floors, args.dtype, sizes))
    print(f"{name}: ready in {ready:.0f} s, measured in {time.monotonic() - t0 - ready:.0f} s "
          f"(load average {load:.1f} -> {figures['load_average'][1]:.1f})", flush=True)
    failures = meter.failures(name)
    if failures:
        result.setdefault("pinning_failures", []).extend(failures)
    save_json(result, args.out)                # what is measured survives a later failure
    if failures:
        raise pinned_servers.PinningError("\n".join(failures))


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.vs_vllm",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or a .gguf file")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--parts", default=",".join(PARTS), type=lambda s: s.split(","),
                   help=f"any of {','.join(PARTS)} (default: all)")
    p.add_argument("--engines", default="ours,vllm", type=lambda s: s.split(","),
                   help="which to run, in this order (default ours,vllm; the table needs both)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes, one repeat: to see that it works, not to measure")
    p.add_argument("--tiers", type=int_list, default=None,
                   help="ttft: prompt lengths (default 512,2400,8000; --quick 256)")
    p.add_argument("--batches", type=int_list, default=None,
                   help="decode: concurrent generations (default 1,8,32; --quick 1,4)")
    p.add_argument("--cores", "--core", type=pinned_servers.cpu_list, default=(1,),
                   help="the CPUs both engines run on, one thread per core each: 0, or 0,1 "
                        "(default 1)")
    p.add_argument("--client-core", type=int, default=None,
                   help="the CPU the clients run on (default: one not in --cores; none "
                        "left: the clients share the engines' cores)")
    p.add_argument("--vllm-mode", choices=("compiled", "eager"), default=None,
                   help="vLLM compiled (its default: torch.compile) or --enforce-eager "
                        "(default: compiled; eager with --quick, which starts 1-2 min sooner)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="both engines' step budget (chunked prefill), default 512")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kvcache-gib", type=int, default=1, help="both engines' KV cache")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="the servers' logs go here")
    p.add_argument("--out", default=None, help="save the results as JSON here")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="sample each engine's process tree with py-spy while it is measured "
                        "(collapsed stacks: DIR/ours.txt, DIR/vllm.txt; needs py-spy)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats = 1
    args.tiers = args.tiers or ([256] if args.quick else [512, 2400, 8000])
    args.batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    args.vllm_mode = args.vllm_mode or ("eager" if args.quick else "compiled")
    unknown = set(args.parts) - set(PARTS) | set(args.engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown part or engine: {', '.join(sorted(unknown))}")
    if args.profile and shutil.which("py-spy") is None:
        p.error("--profile needs py-spy on PATH (pip install py-spy)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # a SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so the servers are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run_report_save(run, report, args)
    except pinned_servers.PinningError as e:        # the JSON has what was measured
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
