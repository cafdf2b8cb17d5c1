"""What every client of a target server shares (bench grid, seed scenario, doctor): its base
URL and auth, the client session, the request body, the model to ask for, and measuring one
cell of requests into an archive record."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from collections.abc import Callable

import aiohttp

from prefixgate.backend.config import resolve_model
from prefixgate.proxy.bench import archive as archive_mod
from prefixgate.proxy.bench.client import Sample, closed_loop, open_loop, stream_once
from prefixgate.proxy.bench.prompts import Lengths, load_tokenizer
from prefixgate.proxy.bench.stats import summarize
from prefixgate.proxy.bundled import BundledEngines


class TargetError(Exception):
    """The target cannot be benchmarked (unreachable, no model)."""


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def auth_headers(api_key: str | None) -> dict:
    key = api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def client_session(timeout_s: float, force_close: bool = False) -> aiohttp.ClientSession:
    """The load generator's client (`force_close`: a connection of its own per request)."""
    # no connection cap: the load generator must never be the queue being measured
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=force_close),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def pick_model(session, base: str, headers: dict, model: str | None) -> tuple[str, dict]:
    models = await archive_mod.snapshot(session, base, "/v1/models", headers)
    if model:
        return model, models
    try:
        return models["data"][0]["id"], models
    except (TypeError, KeyError, IndexError):
        raise TargetError(f"{base}/v1/models gave no model; is the server up? "
                          "(or pass --model)") from None


def request_body(messages_body: dict, model: str, max_tokens: int, ignore_eos: bool,
                 endpoint: str, lengths: Lengths | None = None) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "max_tokens": max_tokens, "temperature": 0.0}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "completions":
        body["prompt"] = render_prompt(messages_body, lengths)
    else:
        body.update(messages_body)
    return body


def render_prompt(messages_body: dict, lengths: Lengths | None) -> str:
    tok = lengths.tokenizer if lengths else None
    if tok is not None and getattr(tok, "chat_template", None):
        try:
            return tok.apply_chat_template(messages_body["messages"],
                                           tools=messages_body.get("tools"))
        except ValueError:
            pass
    return "\n\n".join(m["content"] for m in messages_body["messages"])


async def measure(session, url: str, headers: dict, make_body: Callable[[int], dict], *,
                  requests: int, warmup: int, concurrency: int | None = None,
                  rate: float | None = None, think_s: float = 0.0, seed: int = 0,
                  label: str = "") -> list[Sample]:
    """Warm-up, then the measured requests of one cell; returns every sample."""
    async def send(s: Sample) -> Sample:
        return await stream_once(session, url, make_body(s.index), headers, s)
    warm = [Sample(index=i, warmup=True) for i in range(warmup)]
    measured = [Sample(index=warmup + i) for i in range(requests)]
    progress = archive_mod.Progress(warmup + requests, label)

    def done(s: Sample) -> None:
        progress.step(s.ok)
    if rate is None:
        # one loop: the measured requests follow the warm-up ones without a pause, so they
        # meet the steady state the warm-up built (not a fresh start's burst or lull)
        await closed_loop(send, warm + measured, concurrency or 1, done, think_s, seed)
        return warm + measured
    if warm:
        await closed_loop(send, warm, concurrency or 1, done)
    await open_loop(send, measured, rate, seed, done)
    return warm + measured


def cell_record(label: str, params: dict, samples: list[Sample], slo_ttft_s: float) -> dict:
    origin = min((s.start for s in samples), default=0.0)
    return {"label": label, **params, "summary": summarize(samples, slo_ttft_s),
            "samples": [s.to_json(origin) for s in samples]}


# each engine publishes its KV events (vLLM's ZMQ format) on free ports of its own
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
             "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}


async def start_engines(roles: list[str], args: list[str], threads: int, launcher=None,
                        model: str = "demo", instance_args: list[list[str]] | None = None,
                        kv_events: bool = False):
    """Bundled engines on `model`, one per role (`launcher`: stand-ins, for tests), each with
    `threads` torch threads (engines x threads <= cores) and `args`, engine i also with
    `instance_args[i]`, publishing KV events if asked; started and ready."""
    cfg = {"model": model, "instances": len(roles), "roles": roles, "host": "127.0.0.1",
           "args": args, "instance_args": instance_args, "startup_timeout_s": 600}
    if kv_events:
        cfg["kv_events_config"] = KV_EVENTS
    engines = (launcher or BundledEngines)(cfg)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)     # inherited by the engines only
    try:
        await engines.start()
    except BaseException:
        await engines.stop()
        raise
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return engines


def engines_config(engines, roles: list[str], plugins: list, timeout: float) -> dict:
    """A gateway config in front of `engines` (P/D, `pd: prefixgate`, when a role asks)."""
    raw = {"upstreams": [{"name": f"engine{i}", "url": u, "role": role}
                         for i, (u, role) in enumerate(zip(engines.urls, roles))],
           "plugins": plugins, "timeouts": {"first_byte": timeout, "idle": timeout}}
    if "prefill" in roles:
        raw["pd"] = {"protocol": "prefixgate"}
    return raw


def given(workload, **flags):
    """`workload` (a dataclass) with the flags the user gave (not None) in place of its defaults."""
    return dataclasses.replace(workload, **{k: v for k, v in flags.items() if v is not None})


def first(values: list | None):
    """The first value of a flag that takes a list (`--concurrency 8,16`: 8); None: not given."""
    return values[0] if values else None


def scenario_model(args) -> str:
    """The model a built-in scenario's engines run: `--model` (a built-in name, a .gguf file or
    a model directory), else the demo, whose figures the documented ones are."""
    return args.model or "demo"


def run_scenario(args, run, report) -> int:
    """A built-in scenario on `scenario_model(args)`: `run(lengths)` (a coroutine) makes its
    archive, `report(archive)` prints it; then --out/--plot. Exit status 0, 1 (it failed),
    2 (no such model)."""
    model = scenario_model(args)
    try:
        lengths = Lengths(load_tokenizer(str(resolve_model(model))))
    except (OSError, ValueError) as e:
        print(f"prefixgate bench: cannot run the scenario on {model}: {e}", file=sys.stderr)
        return 2
    try:
        archive = asyncio.run(run(lengths))
    except RuntimeError as e:
        print(f"prefixgate bench: {e}", file=sys.stderr)
        return 1
    report(archive)
    archive_mod.save_outputs(archive, args.out, args.plot)
    return 0
