"""Engine-to-engine KV transfer vs recomputing: `python -m prefixgate.backend.bench.kv_handover`.

Two engine processes on loopback (the demo model on CPU unless told otherwise): a prefill engine
and a decode engine. Each repeat takes a fresh random prompt (no prefix-cache hits anywhere):
  recompute  the decode engine computes the prompt itself: its Server-Timing `prefill` (ms)
  pull       leg 1 on the prefill engine, then leg 2 on the decode engine: its `kv_pull` (ms; the
             KV bytes over that time give MB/s), and leg 2's `queue + prefill` (the pull plus the
             one-token step that samples the first token: what replaces the recompute)
Prints medians and the ratio recompute / leg 2; `--out FILE` saves them with the config as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys

import aiohttp

from prefixgate.backend.bench.engine_process import engine_process
from prefixgate.backend.bench.script import run_report_save
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.vocab import MODEL_HELP, vocab_size
from prefixgate.common import server_timing
from prefixgate.common.processes import ServerProcess

LEG1 = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def _engine(role: str, args) -> ServerProcess:
    engine = engine_process(
        args.model, "--role", role, "--num-kv-blocks", str(args.num_kv_blocks),
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "warning",
        inherit_output=True)
    try:
        await engine.start().ready(180)
    except BaseException:
        await engine.close()
        raise
    return engine


async def _post(s, url: str, body: dict) -> tuple[dict, dict]:
    async with s.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data}")
        return data, server_timing.parse(r.headers.get(server_timing.HEADER))


async def _received_bytes(s, url: str) -> float:
    async with s.get(url + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("prefixgate:kv_transfer_received_bytes_total "):
                return float(line.split()[1])
    return 0.0


async def run(args) -> dict:
    prompt = Prompts(vocab_size(args.model), args.seed)
    prefill = await _engine("prefill", args)
    engines = [prefill]
    samples = {"recompute_ms": [], "pull_ms": [], "leg2_ttft_ms": [], "leg1_prefill_ms": [],
               "mb_per_s": []}
    nbytes = 0.0
    try:
        engines.append(decode := await _engine("decode", args))
        p_url, d_url = prefill.url, decode.url
        async with aiohttp.ClientSession() as s:
            for i in range(args.repeats + 1):           # the first round warms both engines up
                base = {"max_tokens": 1, "temperature": 0, "ignore_eos": True}
                _, t = await _post(s, d_url, {**base, "prompt": prompt(args.prompt_tokens)})
                recompute = t["prefill"]
                p = prompt(args.prompt_tokens)
                leg1, t1 = await _post(s, p_url, {**base, "prompt": p, "kv_transfer_params": LEG1})
                before = await _received_bytes(s, d_url)
                leg2 = {**base, "prompt": p, "kv_transfer_params": leg1["kv_transfer_params"]}
                _, t2 = await _post(s, d_url, leg2)
                nbytes = await _received_bytes(s, d_url) - before
                if i == 0:
                    continue
                samples["recompute_ms"].append(recompute)
                samples["leg1_prefill_ms"].append(t1["prefill"])
                samples["pull_ms"].append(t2["kv_pull"])
                samples["leg2_ttft_ms"].append(t2["kv_pull"] + t2["queue"] + t2["prefill"])
                samples["mb_per_s"].append(nbytes / 1e6 / (t2["kv_pull"] / 1e3))
                await asyncio.sleep(0.05)
    finally:
        for engine in engines:
            await engine.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"config": vars(args), "kv_bytes": nbytes, "median": med, "samples": samples,
            "recompute_over_leg2": med["recompute_ms"] / med["leg2_ttft_ms"]}


def report(r: dict) -> None:
    c, m = r["config"], r["median"]
    print(f"KV transfer on loopback: {c['model']} model, {c['prompt_tokens']}-token prompt, "
          f"{c['kv_cache_dtype']} KV = {r['kv_bytes'] / 1e6:.1f} MB, median of {c['repeats']}")
    rows = [("recompute the prompt (decode engine's prefill)", m["recompute_ms"], ""),
            ("pull its KV from the prefill engine (kv_pull)", m["pull_ms"],
             f"{m['mb_per_s']:.0f} MB/s"),
            ("leg 2 to first token (pull + 1-token step)", m["leg2_ttft_ms"], ""),
            ("(leg 1: the prefill engine's prefill)", m["leg1_prefill_ms"], "")]
    for name, ms, extra in rows:
        print(f"  {name:<50} {ms:8.1f} ms  {extra}")
    print(f"  recompute / leg 2: {r['recompute_over_leg2']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.kv_handover",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="the engines' step budget (default: a whole 2k prompt in one step)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save results as JSON here")
    args = p.parse_args(argv)
    return run_report_save(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
