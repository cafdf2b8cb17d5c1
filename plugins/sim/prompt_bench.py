"""Benchmarks for prefix-stable prompts: normalize cost, prerender cache, TTFT end to end.

    python -m prefixgate.plugins.sim.prompt_bench                 # all three
    python -m prefixgate.plugins.sim.prompt_bench --skip-ttft --json out.json

1. normalize: per-request cost of the plugin on a 2k- and a 10k-token system prompt whose head
   carries a timestamp and a request id (new values every request: no text-cache help), and
   on a static prompt repeated; baseline = json.loads of the same request body.
   Budgets: <= 0.5 ms (2k) and <= 2 ms (10k).
2. prerender: render + tokenize each time (baseline) vs the warm prefix cache. Target >= 20x.
3. TTFT p50 with the bundled engine (demo model, CPU): a 1,200-token system prompt with a
   timestamp at its head, through the gateway with normalize off vs on.

Token counts use the demo model's tokenizer (a byte-level BPE trained on the bundled text);
`--model smollm2` (or a .gguf file, a model directory) runs all three on that model instead.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import time
import uuid

from prefixgate.common.percentiles import percentile
from prefixgate.common.runtime import run_on_uvloop

MINUTE_WORDS = ["orders", "refunds", "shipping", "accounts", "invoices", "warranty", "returns",
                "coupons", "billing", "security", "privacy", "delivery"]


def _sentence(rng: random.Random, i: int) -> str:
    topic = rng.choice(MINUTE_WORDS)
    forms = [
        f"Rule {i}: when a customer asks about {topic}, check the account first and answer in "
        f"at most {rng.randint(2, 6)} sentences.",
        f"For {topic}, quote plan prices exactly (Basic ${rng.randint(5, 20)}.99, Pro "
        f"${rng.randint(21, 90)}.00) and never promise dates you cannot verify.",
        f"Our app v{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)} supports "
        f"{topic}; older builds (before {rng.randint(1000, 9999)}) should be updated first.",
        f"关于{topic}的问题，请先确认用户身份，再给出不超过{rng.randint(100, 300)}字的回答。",
        f"Escalate {topic} cases above ${rng.randint(100, 5000)} to a human agent; the support "
        f"line is +1-800-555-{rng.randint(1000, 9999)}.",
        "Be polite, concise and accurate. If you are unsure, say so and offer to find out.",
    ]
    return rng.choice(forms)


def make_system_prompt(tokenizer, target_tokens: int, seed: int = 0) -> str:
    """A realistic rules-style system prompt of about `target_tokens` tokens (no dynamic value)."""
    rng = random.Random(seed)
    parts, i = ["You are Atlas, the support assistant of Northwind Cloud.\n"], 0
    while len(tokenizer.encode("".join(parts))) < target_tokens:
        for _ in range(10):
            i += 1
            parts.append(_sentence(rng, i) + ("\n" if i % 4 == 0 else " "))
    lo, hi = 1, len(parts)           # fewest sentences that reach the target
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.encode("".join(parts[:mid]))) >= target_tokens:
            hi = mid
        else:
            lo = mid + 1
    return "".join(parts[:lo])


def _head(i: int) -> str:
    t = time.gmtime(1773584551 + 7 * i)
    return (f"Current time: {time.strftime('%Y-%m-%d %H:%M:%S', t)}\n"
            f"Request ID: req_{uuid.UUID(int=i * 7919 + 1).hex[:12]}\n")


def _stats(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples) * 1e3,
            "p90_ms": percentile(samples, 90) * 1e3, "n": len(samples)}


def _run_sync(coro) -> None:
    """Drive a coroutine that never suspends (normalize's on_request) without an event loop."""
    try:
        coro.send(None)
    except StopIteration:
        return
    raise RuntimeError("on_request suspended")


class CharTokens:
    """Counts 4 characters as one token, as large-vocabulary tokenizers (Llama 3, Qwen) do on
    English: a stricter size for the normalize budget than the small demo tokenizer."""
    def encode(self, text: str) -> range:
        return range(len(text) // 4)


def bench_normalize(tokenizer, sizes, n: int) -> dict:
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.config.gateway import validate
    from prefixgate.proxy.context import RequestContext

    out = {}
    for name, size, tokenizer in sizes:
        system = make_system_prompt(tokenizer, size)
        gw = Gateway(validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                               "plugins": [{"normalize": {}}]}))
        plugin = gw.chain.plugins[0]
        res = {"tokens": len(tokenizer.encode(system)), "chars": len(system)}
        for scenario in ("dynamic", "static"):
            raws = [json.dumps({"model": "m", "messages": [
                {"role": "system", "content": (_head(i) if scenario == "dynamic" else "") + system},
                {"role": "user", "content": f"question {i}"}]}).encode() for i in range(n)]
            parse, cost = [], []
            for i, raw in enumerate(raws):
                t0 = time.perf_counter()
                body = json.loads(raw)
                t1 = time.perf_counter()
                ctx = RequestContext(request_id=str(i), path="/v1/chat/completions", body=body,
                                     headers={})
                t2 = time.perf_counter()
                _run_sync(plugin.on_request(ctx))
                t3 = time.perf_counter()
                if scenario == "dynamic" and i > 0:
                    assert len(ctx.moved) == 2, ctx.moved
                parse.append(t1 - t0)
                cost.append(t3 - t2)
            res[scenario] = {"normalize": _stats(cost[1:]), "json_parse": _stats(parse[1:])}
            res[scenario]["ratio_to_parse"] = (res[scenario]["normalize"]["median_ms"] /
                                               res[scenario]["json_parse"]["median_ms"])
        res["budget_ms"] = 0.5 if size <= 2000 else 2.0
        out[name] = res
    return out


def bench_prerender(tokenizer, sizes, n: int) -> dict:
    from prefixgate.plugins.prerender import PromptCache

    out = {}
    for size in sizes:
        system = make_system_prompt(tokenizer, size, seed=1)
        convs = [[{"role": "system", "content": system},
                  {"role": "user", "content": f"Where is my order #{4000 + i}? It was due "
                                              f"yesterday."}] for i in range(n)]
        base = []
        for msgs in convs:
            t0 = time.perf_counter()
            tokenizer.encode(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
            base.append(time.perf_counter() - t0)
        cache = PromptCache(tokenizer)
        t0 = time.perf_counter()
        first = cache.render(convs[0])
        miss = time.perf_counter() - t0
        warm = []
        for msgs in convs[1:]:
            t0 = time.perf_counter()
            r = cache.render(msgs)
            warm.append(time.perf_counter() - t0)
            assert r.cache == "hit"
        b, w = _stats(base), _stats(warm)
        out[f"{size}"] = {"tokens": len(first.tokens), "render_and_tokenize": b,
                          "warm_cache": w, "first_miss_ms": miss * 1e3,
                          "speedup": b["median_ms"] / w["median_ms"]}
    return out


async def bench_loop_stall(model_dir, tokenizer, size: int, n: int) -> dict:
    """Longest event-loop stall while prerender handles cold (uncached) long prompts, with the
    work inline on the loop vs in a thread (`inline_chars`)."""
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.config.gateway import validate
    from prefixgate.proxy.context import RequestContext

    systems = [make_system_prompt(tokenizer, size, seed=100 + i) for i in range(2 * n)]
    out = {}
    for k, (mode, inline) in enumerate((("inline", 1 << 30), ("thread", 8192))):
        gw = Gateway(validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                               "model": {"tokenizer": str(model_dir)},
                               "plugins": [{"prerender": {"inline_chars": inline}}]}))
        plugin = gw.chain.plugins[0]
        stalls, stop = [], asyncio.Event()

        async def ticker(stalls=stalls, stop=stop):
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                stalls.append(now - last)
                last = now
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        for i in range(n):          # a new system prompt each time: always a cache miss
            system = systems[k * n + i]
            ctx = RequestContext(request_id=str(i), path="/v1/chat/completions", headers={},
                                 body={"model": "m", "messages": [
                                     {"role": "system", "content": system},
                                     {"role": "user", "content": "hi"}]})
            await plugin.on_request(ctx)
        stop.set()
        await task
        out[mode] = {"max_stall_ms": max(stalls) * 1e3,
                     "p99_stall_ms": percentile(stalls, 99) * 1e3}
    return out


async def _ttft(client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    async with client.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for _ in r.content.iter_any():
            dt = time.perf_counter() - t0
            break
        await r.read()
    return dt


async def bench_ttft(model_dir, tokenizer, n: int) -> dict:
    import aiohttp

    from prefixgate.backend.cli import parse_args
    from prefixgate.backend.server import start_server
    from prefixgate.common.runtime import start_app
    from prefixgate.proxy.app import Gateway
    from prefixgate.proxy.config.gateway import validate

    engine = await start_server(parse_args(["--model", str(model_dir), "--served-model-name",
                                            "m"]), host="127.0.0.1", port=0)
    out = {}
    try:
        async with aiohttp.ClientSession() as client:
            for phase, plugins in (("normalize_off", []), ("normalize_on", [{"normalize": {}}])):
                gw = Gateway(validate({"upstreams": [{"name": "e", "url": engine.url}],
                                       "plugins": plugins}))
                runner, url = await start_app(gw.make_app(), "127.0.0.1", 0)
                # each phase gets its own prompt, so one cannot warm the engine for the other
                system = make_system_prompt(tokenizer, 1200, seed=hash(phase) & 0xffff)
                times = []
                for i in range(n):
                    body = {"model": "m", "stream": True, "max_tokens": 1, "messages": [
                        {"role": "system", "content": _head(i) + system},
                        {"role": "user", "content": "Where is my refund?"}]}
                    times.append(await _ttft(client, url, body))
                await runner.cleanup()          # also closes the gateway
                out[phase] = {"first_ms": times[0] * 1e3, **_stats(times[1:])}
        out["speedup_p50"] = out["normalize_off"]["median_ms"] / out["normalize_on"]["median_ms"]
        out["system_tokens"] = len(tokenizer.encode(system))
    finally:
        await engine.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m prefixgate.plugins.sim.prompt_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=200, help="requests per normalize/prerender case")
    p.add_argument("--ttft-n", type=int, default=6, help="requests per TTFT phase")
    p.add_argument("--skip-ttft", action="store_true", help="skip the engine TTFT benchmark")
    p.add_argument("--model", default="demo",
                   help="demo (default), smollm2, a .gguf file or a model directory")
    p.add_argument("--json", help="save results (and the config used) to this file")
    args = p.parse_args(argv)

    from prefixgate.backend.config import resolve_model
    from prefixgate.common.tokenizer import Tokenizer

    model_dir = resolve_model(args.model)
    tok = Tokenizer.load(model_dir)
    results = {"config": vars(args), "python": platform.python_version(),
               "machine": platform.machine(), "tokenizer": str(model_dir)}

    sizes = (("2k", 2000, tok), ("10k", 10000, tok), ("10k_at_4_chars", 10000, CharTokens()))
    results["normalize"] = norm = bench_normalize(tok, sizes, args.n)
    print("normalize (per request; baseline: json.loads of the same body)")
    for name, r in norm.items():
        for sc in ("dynamic", "static"):
            x = r[sc]
            print(f"  {name:>14}: {r['tokens']:>6} tok, {r['chars']:>6} chars, {sc:>7}: median "
                  f"{x['normalize']['median_ms']:.3f} ms (p90 {x['normalize']['p90_ms']:.3f}), "
                  f"json.loads {x['json_parse']['median_ms']:.3f} ms, ratio "
                  f"{x['ratio_to_parse']:.1f}x   budget {r['budget_ms']} ms")

    results["prerender"] = pre = bench_prerender(tok, (2000, 10000), max(20, args.n // 4))
    print("prerender (baseline: render + tokenize every request)")
    for r in pre.values():
        print(f"  {r['tokens']:>6} tok: baseline {r['render_and_tokenize']['median_ms']:.3f} ms, "
              f"warm cache {r['warm_cache']['median_ms']:.3f} ms, speedup {r['speedup']:.1f}x "
              f"(first miss {r['first_miss_ms']:.2f} ms)   target >= 20x")

    run = run_on_uvloop                 # same loop as the gateway uses in production
    results["loop_stall"] = st = run(bench_loop_stall(model_dir, tok, 10000, 5))
    print("event-loop stall while prerender tokenizes cold 10k-token prompts")
    for mode in ("inline", "thread"):
        print(f"  {mode:>6}: longest stall {st[mode]['max_stall_ms']:.1f} ms "
              f"(p99 {st[mode]['p99_stall_ms']:.1f} ms)")

    if not args.skip_ttft:
        results["ttft"] = t = run(bench_ttft(model_dir, tok, args.ttft_n))
        print(f"TTFT through the gateway, bundled engine ({args.model} model, "
              f"{t['system_tokens']}-token system prompt, timestamp at its head)")
        for phase in ("normalize_off", "normalize_on"):
            print(f"  {phase:>13}: p50 {t[phase]['median_ms']:.1f} ms (first request "
                  f"{t[phase]['first_ms']:.1f} ms)")
        print(f"  p50 speedup {t['speedup_p50']:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
