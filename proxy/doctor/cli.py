"""`prefixgate doctor URL`: the TTFT troubleshooting order, automated.

    prefixgate doctor http://127.0.0.1:8000 [--request body.json [--request other.json]]
                      [--metrics-url http://engine:8000] [--tokenizer DIR] [--json]

(a) client vs server timing, where the TTFT went by the response's Server-Timing header, and
the inter-chunk arrival pattern (buffering, compression);
(b) the same request twice: does the prefix cache work? (c) per-request values in the
prompt's head and where two requests diverge; (d) KV usage and preemptions from /metrics;
(r) behind a prefixgate gateway, the upstream whose reported cached tokens disagree with the
router's predictions (route_parity.py); (e) a verdict per finding, with the fix. Exit status: 0
clean, 1 problems found, 2 could not run (unreachable URL, unreadable request file).

Everything is judged for one model at a time: the probes go to `--model`, else the first
request's `model`, else the first of /v1/models; the engine's metrics are read for that model
where the server labels them by model; each request's prompt is analysed as its model's
(`--model` when given, else its own `model`), with `--tokenizer` — the tokenizer of the
probed model — only for requests to that model.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time

import aiohttp

from prefixgate.proxy.bench.archive import snapshot
from prefixgate.proxy.bench.prompts import load_tokenizer, words
from prefixgate.proxy.bench.target import TargetError, auth_headers, base_url, pick_model
from prefixgate.proxy.doctor import checks as checks
from prefixgate.proxy.doctor import scrape as pm
from prefixgate.proxy.doctor.prompt import divergence, dynamic_fields
from prefixgate.proxy.doctor.route_parity import route_parity
from prefixgate.proxy.doctor.trace import trace_stream

MARK = {"PASS": "ok  ", "INFO": "info", "WARN": "warn", "FAIL": "FAIL", "SKIP": "skip"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixgate doctor", description="Diagnose what adds to "
                                "the TTFT of an OpenAI-compatible server (or a proxy in front "
                                "of one). Exit 0: clean, 1: problems found, 2: could not run.")
    p.add_argument("url", help="base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--request", action="append", default=[], metavar="FILE.json",
                   help="a real chat request body to probe and check (twice: also compare the "
                        "two); default: a built-in probe")
    p.add_argument("--model", help="model to use (default: the request's, else /v1/models)")
    p.add_argument("--metrics-url", help="where the engine's /metrics is (default: URL)")
    p.add_argument("--tokenizer", help="the model's tokenizer: a dir, a .gguf file, or "
                   "`smollm2` / `demo`: offsets in tokens")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens for the streaming check")
    p.add_argument("--api-key", help="Bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if len(args.request) > 2:
        print("prefixgate doctor: give --request at most twice", file=sys.stderr)
        return 2
    try:
        bodies = [load_request(path) for path in args.request]
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as e:
        print(f"prefixgate doctor: {e}", file=sys.stderr)
        return 2
    try:
        findings = asyncio.run(diagnose(args, bodies, tokenizer))
    except TargetError as e:
        print(f"prefixgate doctor: {e}", file=sys.stderr)
        return 2
    print_findings(findings, args)
    return 1 if any(f.status == "FAIL" for f in findings) else 0


def load_request(path: str) -> dict:
    with open(path) as f:
        try:
            body = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        raise ValueError(f"{path}: expected a chat completion request body with `messages`")
    return body


def probe_body() -> dict:
    """A ~1500-token system prompt and a short question: long enough for prefill to show."""
    system = "You are a careful assistant. Follow these rules. " + words(random.Random(7), 1400)
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Summarize the rules in one sentence."}]}


def cold(body: dict) -> dict:
    """`body` with a fresh marker at its very head, so its first send cannot hit the cache."""
    body = json.loads(json.dumps(body))
    first = body["messages"][0]
    if isinstance(first.get("content"), str):
        first["content"] = f"[doctor {secrets.token_hex(6)}] " + first["content"]
    return body


async def diagnose(args, bodies: list[dict], tokenizer) -> list[checks.Finding]:
    base, headers = base_url(args.url), auth_headers(args.api_key)
    metrics_base = base_url(args.metrics_url) if args.metrics_url else base
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        async def metrics():
            return pm.parse(text, model) if (text := await snapshot(
                session, metrics_base, "/metrics", headers)) is not None else None
        model, _ = await pick_model(session, base, headers, probed_model(args, bodies))
        url = base + "/v1/chat/completions"
        m_start = await metrics()
        probe = cold(bodies[0] if bodies else probe_body())
        short = {**probe, "model": model, "max_tokens": 1, "stream": True}
        first = await trace_stream(session, url, short, headers)
        m_mid = await metrics()
        second = await trace_stream(session, url, short, headers)
        m_after = await metrics()
        errors = [t.error for t in (first, second) if t.error]
        found = [checks.prefix_cache(first.ttft, second.ttft, m_mid, m_after, errors)]
        # greedy: a sampled answer may end after a token or two, too few events to judge
        streamed = {**probe, "model": model, "temperature": 0, "max_tokens": args.max_tokens}
        stream, bursts = await trace_stream(session, url, streamed, headers), 0
        while checks.burst(stream) and bursts < checks.BURST_RETRIES:
            bursts += 1                 # a buffering hop does it again; a stalled client not
            stream = await trace_stream(session, url, streamed, headers)
        m_end = await metrics()
        found.insert(0, checks.streaming(stream, bursts))
        server = pm.mean_delta(m_after or {}, m_end or {}, "server_ttft")
        hist = pm.histogram(m_end or {}, "server_ttft")
        found.insert(1, checks.client_vs_server(stream.ttft, server, hist and hist[0]))
        found.insert(2, checks.ttft_breakdown(stream.ttft, stream.server_timing))
        # the gateway's own /metrics (URL's, whatever --metrics-url says): its parity metrics
        found += route_parity(await snapshot(session, base, "/metrics", headers))
    found += prompt_findings(bodies, tokenizer, args.model, model)
    found += checks.engine_state(m_start, m_end)
    return found


def probed_model(args, bodies: list[dict]) -> str | None:
    """The model asked for: --model, else the first request's (None: ask /v1/models)."""
    asked = bodies[0].get("model") if bodies else None
    return args.model or (asked if isinstance(asked, str) and asked else None)


def request_model(body: dict, model: str | None = None) -> str | None:
    """The model a request is analysed as: `model` (--model) when given, else its own."""
    own = body.get("model")
    return model or (own if isinstance(own, str) and own else None)


def prompt_findings(bodies: list[dict], tokenizer, model: str | None = None,
                    tokenizer_model: str | None = None) -> list[checks.Finding]:
    """(c) for each request, as its model's (`request_model`). `tokenizer` is
    `tokenizer_model`'s (the probed model; None: the first request's): a request for
    another model is rendered without it (offsets in characters only)."""
    if not bodies:
        return [checks.Finding("c", "dynamic fields", "SKIP", "no --request given: pass a real "
                               "request body (twice to compare two) to check your prompts")]
    models = [request_model(b, model) for b in bodies]
    tokenizer_model = tokenizer_model or models[0]
    toks = [tokenizer if m is None or tokenizer_model is None or m == tokenizer_model else None
            for m in models]
    out = [dynamic_fields(f"request {i + 1}", b, toks[i], models[i])
           for i, b in enumerate(bodies)]
    if len(bodies) == 2:
        out.append(divergence(bodies[0], bodies[1], toks[0] if toks[0] is toks[1] else None,
                              models))
    return out


def print_findings(findings: list[checks.Finding], args) -> None:
    problems = [f for f in findings if f.status == "FAIL"]
    if args.json:
        print(json.dumps({"url": args.url, "problems": len(problems), "findings": [
            {"check": f.check, "title": f.title, "status": f.status, "detail": f.detail,
             "fix": f.fix, "data": f.data} for f in findings]}, indent=1, default=str))
        return
    print(f"prefixgate doctor {args.url}  ({time.strftime('%Y-%m-%d %H:%M:%S')})")
    for f in sorted(findings, key=lambda f: f.check):
        print(f"[{MARK[f.status]}] ({f.check}) {f.title}: {f.detail}")
        if f.fix and f.status in ("FAIL", "WARN"):
            print(f"        fix: {f.fix}")
    warns = sum(f.status == "WARN" for f in findings)
    print(f"verdict: {len(problems)} problem(s), {warns} warning(s)" if problems or warns
          else "verdict: healthy, nothing found that adds to TTFT")


if __name__ == "__main__":
    raise SystemExit(main())
