"""The second KV tier vs recomputing evicted prefixes: `python -m prefixgate.backend.bench.offload`.

A tenant set twice the size of the device KV cache: 16 tenants, each a 1,024-token prefix (its
system prompt), and a device cache with room for 6 of them. Every request is one tenant's
prefix plus 32 fresh tokens; tenants are visited in a shuffled order each round, so most
revisits find their prefix evicted from the device cache by the ones visited since. Two engines
on the same model serve the same requests, one after the other (alternating which goes first):
  off  no second tier: an evicted prefix is recomputed
  on   `--kv-offloading-size` large enough for every tenant: an evicted prefix is loaded back
       from the tier (on CPU a memory-mapped file, `--kv-offloading-path` or a temp dir)
Prints TTFT p50/p95 of the revisits for both, the ratio off/on (aim: >= 3x lower p50 on CPU),
where the prompt tokens came from (device cache, tier, computed), and the tier's counters.
`--out FILE` saves it all with the config as JSON.
"""
from __future__ import annotations

import argparse
import sys

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.backend.bench.completions import stream_completion
from prefixgate.backend.bench.script import THREADS_HELP, run_report_save
from prefixgate.backend.bench.token_prompts import Prompts
from prefixgate.backend.bench.vocab import MODEL_HELP, vocab_size
from prefixgate.backend.cli import parse_args as engine_server_args
from prefixgate.backend.server import start_server
from prefixgate.common.percentiles import percentile

TARGET_P50 = 3.0
TIER_COUNTERS = ("kv_offload_stored_blocks", "kv_offload_loaded_blocks", "kv_offload_hit_tokens",
                 "kv_offload_corrupted_blocks")


def device_blocks(args) -> int:
    """Device KV blocks: `device_tenants` prefixes, plus the in-flight request's own blocks."""
    per_prefix = -(-args.prefix_tokens // args.block_size)
    own = -(-(args.suffix_tokens + 1) // args.block_size) + 1
    return args.device_tenants * per_prefix + own


def engine_flags(args, tier: bool) -> list[str]:
    flags = ["--model", args.model, "--device", args.device, "--block-size", str(args.block_size),
             "--num-kv-blocks", str(device_blocks(args)), "--log-level", "warning"]
    if tier:
        flags += ["--kv-offloading-size", str(args.kv_offloading_size)]
        if args.kv_offloading_path:
            flags += ["--kv-offloading-path", args.kv_offloading_path]
    return flags


async def tier_counters(session, url: str) -> dict[str, float]:
    """The tier's counters from the engine's /metrics (0 where it exposes none: tier off)."""
    async with session.get(url + "/metrics") as r:
        totals = counter_totals(await r.text())
    return {name: totals.get("prefixgate:" + name, 0.0) for name in TIER_COUNTERS}


def counter_totals(exposition: str) -> dict[str, float]:
    """Each counter of a Prometheus exposition (named without `_total`), summed over its
    labels."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        if family.type == "counter":
            totals[family.name] = sum(s.value for s in family.samples
                                      if s.name.endswith("_total"))
    return totals


async def run(args) -> dict:
    fresh = Prompts(vocab_size(args.model), args.seed)
    prefixes = [fresh(args.prefix_tokens) for _ in range(args.tenants)]
    servers = {arm: await start_server(engine_server_args(engine_flags(args, tier)),
                                       host="127.0.0.1", port=0)
               for arm, tier in (("off", False), ("on", True))}
    samples = {arm: [] for arm in servers}
    try:
        async with aiohttp.ClientSession() as s:
            for tenant in range(args.tenants):              # first visits: cold everywhere
                prompt = prefixes[tenant] + fresh(args.suffix_tokens)
                for srv in servers.values():
                    await stream_completion(s, srv.url, prompt)
            for r in range(args.rounds):
                order = list(range(args.tenants))
                fresh.rng.shuffle(order)
                for i, tenant in enumerate(order):
                    prompt = prefixes[tenant] + fresh(args.suffix_tokens)
                    arms = ["off", "on"] if (r + i) % 2 == 0 else ["on", "off"]
                    for arm in arms:
                        seen = await stream_completion(s, servers[arm].url, prompt)
                        samples[arm].append({"tenant": tenant, "ttft_s": seen.ttft_s,
                                             "cached_tokens": seen.cached})
            counters = {arm: await tier_counters(s, srv.url) for arm, srv in servers.items()}
    finally:
        for srv in servers.values():
            await srv.close()
    return summarize(args, samples, counters)


def summarize(args, samples: dict, counters: dict) -> dict:
    arms = {}
    prompt_tokens = args.prefix_tokens + args.suffix_tokens
    for arm, xs in samples.items():
        ttft = [x["ttft_s"] for x in xs]
        cached = sum(x["cached_tokens"] for x in xs)
        p50, p95 = percentile(ttft, 50), percentile(ttft, 95)
        arms[arm] = {"ttft_p50_ms": p50 * 1e3, "ttft_p95_ms": p95 * 1e3,
                     "revisits": len(xs), "cached_fraction": cached / (prompt_tokens * len(xs)),
                     "counters": counters[arm]}
    hit = counters["on"]["kv_offload_hit_tokens"]
    arms["on"]["tier_fraction"] = hit / (prompt_tokens * len(samples["on"]))
    off, on = arms["off"], arms["on"]
    return {"config": vars(args), "device_blocks": device_blocks(args), "arms": arms,
            "samples": samples, "target_p50": TARGET_P50,
            "p50_ratio": off["ttft_p50_ms"] / on["ttft_p50_ms"],
            "p95_ratio": off["ttft_p95_ms"] / on["ttft_p95_ms"]}


def report(r: dict) -> None:
    c, off, on = r["config"], r["arms"]["off"], r["arms"]["on"]
    print(f"second KV tier: {c['tenants']} tenants x {c['prefix_tokens']}-token prefixes + "
          f"{c['suffix_tokens']} fresh tokens, device cache {r['device_blocks']} blocks "
          f"(~{c['device_tenants']} prefixes), {off['revisits']} revisits each")
    print(f"  {'':<22}{'p50 ms':>9}{'p95 ms':>9}{'cached':>9}")
    print(f"  {'without the tier':<22}{off['ttft_p50_ms']:9.1f}{off['ttft_p95_ms']:9.1f}"
          f"{off['cached_fraction']:9.0%}")
    print(f"  {'with the tier':<22}{on['ttft_p50_ms']:9.1f}{on['ttft_p95_ms']:9.1f}"
          f"{on['cached_fraction']:9.0%}  (from the tier: {on['tier_fraction']:.0%})")
    k = on["counters"]
    print(f"  tier: {k['kv_offload_stored_blocks']:.0f} blocks stored, "
          f"{k['kv_offload_loaded_blocks']:.0f} loaded, "
          f"{k['kv_offload_hit_tokens']:.0f} hit tokens, "
          f"{k['kv_offload_corrupted_blocks']:.0f} corrupted")
    met = "met" if r["p50_ratio"] >= r["target_p50"] else "MISSED"
    print(f"  TTFT p50 without / with: {r['p50_ratio']:.2f}x "
          f"(target >= {r['target_p50']}x: {met}); p95: {r['p95_ratio']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.backend.bench.offload",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help=MODEL_HELP)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--device-tenants", type=int, default=6, help="prefixes the device cache holds")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="shuffled visits of every tenant")
    p.add_argument("--kv-offloading-size", type=float, default=1.0,
                   help="GiB (default %(default)s)")
    p.add_argument("--kv-offloading-path", default=None,
                   help="the tier's directory (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--quick", action="store_true",
                   help="4 tenants (device: 2), 1 round: a smoke run")
    p.add_argument("--out", default=None, help="save results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.tenants, args.device_tenants, args.rounds = 4, 2, 1
    return run_report_save(run, report, args)


if __name__ == "__main__":
    sys.exit(main())
