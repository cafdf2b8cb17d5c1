"""`prefixgate bench --scenario mixed`: long prompts arriving while other requests decode,
with and without prefill/decode disaggregation.

Two bundled engines behind the gateway (on the demo model unless `--model` names another), in
two layouts on the same cores:

    mixed   both engines prefill and decode (least in flight)
    pd      one prefill engine and one decode engine (`pd: {protocol: prefixgate}`)

and two kinds of requests at once: `--concurrency` users streaming long answers to short
prompts (their inter-token latency is what a prefill stalls), and long prompts with short
answers arriving open-loop at `--rate` per second (their TTFT is what disaggregation may
cost or save). PD's promise is that decodes never stall behind a prefill: in `pd` the ITL
p99 of the decoding users should stay near their ITL p50.
"""
from __future__ import annotations

import asyncio
import sys
from dataclasses import asdict, dataclass

from prefixgate.backend.config import served_name
from prefixgate.common.runtime import start_app
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench import target
from prefixgate.proxy.bench.client import Sample, stream_once
from prefixgate.proxy.bench.prompts import Lengths, PromptSet, PromptSpec
from prefixgate.proxy.bench.stats import fmt
from prefixgate.proxy.config import gateway as config_mod

LAYOUTS = {"mixed": ["both", "both"], "pd": ["prefill", "decode"]}


@dataclass
class MixedWorkload:
    decoders: int = 4                # users streaming long answers, back to back
    decoder_prompt_tokens: int = 64
    decoder_tokens: int = 96
    long_prompt_tokens: int = 1536
    long_tokens: int = 4
    long_requests: int = 12          # measured long prompts per layout and round
    rate: float = 0.5                # long prompts per second (Poisson)
    rounds: int = 1                  # runs of each layout, interleaved, samples pooled
    engine_threads: int = 1          # torch threads per engine: engines x threads <= cores
    batched_tokens: int = 512        # engine step budget (chunked prefill)
    seed: int = 0

    def engine_args(self) -> list[str]:
        return ["--max-num-seqs", str(self.decoders + 8), "--max-num-batched-tokens",
                str(self.batched_tokens), "--log-level", "warning"]


def parse_workload(args) -> MixedWorkload:
    return target.given(MixedWorkload(), long_requests=args.requests, seed=args.seed,
                        rounds=args.rounds, decoders=target.first(args.concurrency),
                        rate=target.first(args.rate), long_prompt_tokens=target.first(args.tiers),
                        decoder_tokens=args.max_tokens or None)


def run_mixed(args) -> int:
    w = parse_workload(args)
    model = target.scenario_model(args)
    return target.run_scenario(
        args, lambda lengths: run_layouts(w, lengths, args.timeout, args.slo_ttft_ms,
                                          model=model), print_mixed)


async def run_layouts(w: MixedWorkload, lengths: Lengths, timeout: float,
                      slo_ttft_ms: float, layouts=tuple(LAYOUTS), launcher=None,
                      model: str = "demo") -> dict:
    decode_prompts = PromptSet(PromptSpec(w.decoder_prompt_tokens, seed=w.seed), lengths)
    long_prompts = PromptSet(PromptSpec(w.long_prompt_tokens, seed=w.seed + 1), lengths)
    runs: dict[str, list[tuple[list, list]]] = {name: [] for name in layouts}
    for r in range(w.rounds):
        for name in layouts:
            print(f"[round {r + 1}/{w.rounds}] {name}: starting engines "
                  f"({', '.join(LAYOUTS[name])})", file=sys.stderr, flush=True)
            runs[name].append(await run_layout(name, w, decode_prompts, long_prompts, timeout,
                                               offset=r * 100_000, launcher=launcher,
                                               model=model))
    slo_s = slo_ttft_ms / 1000.0
    cells = []
    for name in layouts:
        longs = [s for run in runs[name] for s in run[0]]
        decodes = [s for run in runs[name] for s in run[1]]
        cells.append(target.cell_record(f"{name}: long prompts",
                                        {"layout": name, "kind": "long"}, longs, slo_s))
        cells.append(target.cell_record(f"{name}: decoders",
                                        {"layout": name, "kind": "decode"}, decodes, slo_s))
    return {"schema": archive_mod.SCHEMA, "kind": "mixed",
            "config": {"scenario": "mixed", "model": model, "workload": asdict(w),
                       "engine_args": w.engine_args(), "layouts": {k: LAYOUTS[k] for k in layouts},
                       "slo_ttft_ms": slo_ttft_ms, "max_tokens": w.decoder_tokens},
            "environment": archive_mod.environment(), "cells": cells}


async def run_layout(name: str, w: MixedWorkload, decode_prompts: PromptSet,
                     long_prompts: PromptSet, timeout: float, offset: int = 0, launcher=None,
                     model: str = "demo"):
    """One run: engines on `model` in this layout (`launcher`, default: bundled engine
    processes), the gateway in front, both loads at once; returns (long-prompt samples,
    decoder samples)."""
    roles = LAYOUTS[name]
    engines = await target.start_engines(roles, w.engine_args(), w.engine_threads, launcher,
                                         model)
    name_sent = served_name(model)
    raw = target.engines_config(engines, roles, [{"least_inflight": {}}, {"metrics": {}}], timeout)
    runner = None
    try:
        gateway = Gateway(config_mod.validate(raw))
        runner, url = await start_app(gateway.make_app(), "127.0.0.1", 0)
        chat = url + "/v1/chat/completions"
        async with target.client_session(timeout) as session:
            decodes: list[Sample] = []
            stop = asyncio.Event()

            async def decoder(user: int) -> None:
                i = 0
                while not stop.is_set():
                    n = offset + user * 10_000 + i
                    body = target.request_body(decode_prompts.body(n), name_sent,
                                               w.decoder_tokens, True, "chat")
                    decodes.append(await stream_once(session, chat, body, {}, Sample(index=n)))
                    i += 1
            users = [asyncio.ensure_future(decoder(u)) for u in range(w.decoders)]
            await asyncio.sleep(1.0)            # the decoders are mid-stream when longs come
            longs = await target.measure(
                session, chat, {}, lambda i: target.request_body(
                    long_prompts.body(offset + i), name_sent, w.long_tokens, True, "chat"),
                requests=w.long_requests, warmup=0, rate=w.rate, seed=w.seed,
                label=f"{name} (long prompts)")
            stop.set()
            await asyncio.gather(*users)
    finally:
        if runner is not None:
            await runner.cleanup()
        await engines.stop()
    return longs, decodes


def print_mixed(archive: dict) -> None:
    w = archive["config"]["workload"]
    print(f"\nmixed workload: {w['decoders']} users streaming {w['decoder_tokens']} tokens "
          f"while {w['long_prompt_tokens']}-token prompts arrive at {w['rate']}/s "
          f"({w['long_requests'] * w['rounds']} per layout); ms")
    head = (f"{'layout':<8}{'long ttft p50':>14}{'p95':>8}{'p99':>8}"
            f"{'decode itl p50':>16}{'itl p99':>9}{'decode ttft p99':>16}{'err':>5}")
    print(head + "\n" + "-" * len(head))
    by = {(c["layout"], c["kind"]): c["summary"] for c in archive["cells"]}
    for layout in archive["config"]["layouts"]:
        long_s, dec_s = by[(layout, "long")], by[(layout, "decode")]
        print(f"{layout:<8}" + fmt(long_s["ttft_p50_ms"], 14, 0)
              + fmt(long_s["ttft_p95_ms"], 8, 0) + fmt(long_s["ttft_p99_ms"], 8, 0)
              + fmt(dec_s["itl_p50_ms"], 16, 1) + fmt(dec_s["itl_p99_ms"], 9, 1)
              + fmt(dec_s["ttft_p99_ms"], 16, 0)
              + fmt(long_s["errors"] + dec_s["errors"], 5))

