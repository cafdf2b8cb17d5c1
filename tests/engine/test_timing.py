"""The bundled engine's TTFT breakdown as clients and collectors see it: the `Server-Timing`
header (tokenize, queue, prefill, decode) on streamed and whole answers, its agreement with
the latency histograms, and one `llm_request` span per request over OTLP/HTTP."""
from __future__ import annotations

import asyncio
import json
import re
import secrets
import subprocess
import sys
import uuid

import aiohttp
import pytest

from prefixgate.common import server_timing
from prefixgate.common.runtime import free_port
from prefixgate.proxy.testing.otlp import OtlpReceiver
from tests.engine.helpers import metrics
from tests.helpers import ServerThread

ENTRIES = ["tokenize", "queue", "prefill", "decode"]
HISTOGRAMS = {"queue": "request_queue_time_seconds", "prefill": "request_prefill_time_seconds",
              "ttft": "time_to_first_token_seconds"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def server():
    """One sequence at a time, so a running request makes the next one queue."""
    with ServerThread(["--model", "demo", "--max-num-seqs", "1"]) as s:
        yield s


@pytest.fixture(scope="module")
def traced():
    """An engine exporting spans to a loopback port; `collector` listens there for a test."""
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")      # export within ms, not the SDK's 5 s
        mp.delenv("OTEL_SERVICE_NAME", raising=False)
        argv = ["--model", "demo", "--otlp-traces-endpoint", f"http://127.0.0.1:{port}"]
        with ServerThread(argv) as s:
            s.collector_port = port
            yield s


@pytest.fixture
async def collector(traced):
    rx = await OtlpReceiver().start(port=traced.collector_port)
    yield rx
    await rx.stop()


def body_for(path: str, stream: bool, text: str = "Hello there!", max_tokens: int = 4) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if path == "/v1/chat/completions":
        return {**body, "messages": [*MESSAGES[:1], {"role": "user", "content": text}]}
    return {**body, "prompt": text}


async def ask(session, url: str, path: str, body: dict, headers=None) -> tuple[str, dict]:
    """(the Server-Timing value, usage) of one answer, streamed or whole."""
    async with session.post(url + path, json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        timing = r.headers[server_timing.HEADER]
        if not body.get("stream"):
            return timing, (await r.json())["usage"]
        usage = None
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return timing, usage


def breakdown(value: str) -> tuple[dict[str, float], int, int]:
    """({entry: ms}, computed, cached), checking the entries and their order."""
    assert [e.split(";")[0].strip() for e in value.split(",")] == ENTRIES, value
    durs = server_timing.parse(value)
    m = re.search(r'prefill;dur=[\d.]+;desc="computed=(\d+) cached=(\d+)"', value)
    assert m, value
    return durs, int(m.group(1)), int(m.group(2))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_answers_carry_the_ttft_breakdown(server, path, stream):
    async with aiohttp.ClientSession() as s:
        value, usage = await ask(s, server.url, path, body_for(path, stream))
    durs, computed, cached = breakdown(value)
    assert all(durs[name] >= 0 for name in ENTRIES), value
    assert computed + cached == usage["prompt_tokens"]
    assert cached == usage["prompt_tokens_details"]["cached_tokens"]


async def test_a_repeated_long_prompt_is_mostly_cached(server):
    text = f"{uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 12
    async with aiohttp.ClientSession() as s:
        first, _ = await ask(s, server.url, "/v1/completions",
                             body_for("/v1/completions", False, text))
        again, usage = await ask(s, server.url, "/v1/completions",
                                 body_for("/v1/completions", True, text))
    _, computed, cached = breakdown(first)
    assert cached == 0 and computed > 64
    _, computed, cached = breakdown(again)
    assert cached > 0 and computed < cached, again
    assert cached == usage["prompt_tokens_details"]["cached_tokens"]


async def test_the_header_agrees_with_the_histograms(server):
    """One request at a time: each histogram's _sum grows by exactly what the header says."""
    async with aiohttp.ClientSession() as s:
        for i, (path, stream) in enumerate([("/v1/completions", True), ("/v1/completions", False),
                                            ("/v1/chat/completions", True)]):
            before = await metrics(s, server.url)
            value, _ = await ask(s, server.url, path, body_for(path, stream, f"request {i} " * 20))
            after = await metrics(s, server.url)
            durs, _, _ = breakdown(value)
            header = {"queue": durs["queue"], "prefill": durs["prefill"],
                      "ttft": durs["queue"] + durs["prefill"]}
            for key, hist in HISTOGRAMS.items():
                name = f"prefixgate:{hist}"
                assert after[name + "_count"] == before[name + "_count"] + 1
                grew_ms = (after[name + "_sum"] - before[name + "_sum"]) * 1e3
                assert abs(grew_ms - header[key]) <= 0.15, (key, grew_ms, value)


async def test_a_busy_engine_shows_up_as_queue_time(server):
    """--max-num-seqs 1: a second request waits for the running one, and the header says so."""
    long = body_for("/v1/completions", True, "keep going", max_tokens=4000)
    async with aiohttp.ClientSession() as s:
        running = await s.post(server.url + "/v1/completions", json=long)
        await running.content.readline()            # its first token: it holds the only seat
        second = asyncio.create_task(ask(s, server.url, "/v1/completions",
                                         body_for("/v1/completions", False)))
        await asyncio.sleep(0.3)
        running.close()                             # hang up: the engine aborts it
        value, _ = await second
    durs, _, _ = breakdown(value)
    assert durs["queue"] >= 150, value          # it waited ~300 ms for the seat
    assert durs["queue"] > durs["tokenize"] + durs["prefill"] + durs["decode"], value


async def test_llm_request_span_continues_the_callers_trace(traced, collector):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "caller-42"}
    async with aiohttp.ClientSession() as s:
        value, usage = await ask(s, traced.url, "/v1/chat/completions",
                                 body_for("/v1/chat/completions", True), headers)
        _, root_usage = await ask(s, traced.url, "/v1/completions",
                                  body_for("/v1/completions", False))
    spans = await collector.wait_for(
        lambda got: len([x for x in got if x["name"] == "llm_request"]) >= 2)
    child = next(x for x in spans if x["attributes"].get("gen_ai.request.id") == "caller-42")
    root = next(x for x in spans if x is not child and x["name"] == "llm_request")

    assert (child["trace_id"], child["parent_span_id"]) == (trace_id, parent_id)
    assert child["kind"] == "SERVER" and child["service"] == "prefixgate-engine"
    assert child["status"] == 0                     # unset: it went well
    a = child["attributes"]
    assert a["gen_ai.response.model"] == "demo"
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.request.top_p"]) == (4, 0, 1)
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 4
    assert a["prefixgate.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    durs, _, _ = breakdown(value)                   # the span and the header: the same stamps
    assert abs(a["gen_ai.latency.time_in_queue"] * 1e3 - durs["queue"]) <= 0.06
    assert abs(a["gen_ai.latency.time_in_model_prefill"] * 1e3 - durs["prefill"]) <= 0.06
    assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(
        a["gen_ai.latency.time_in_queue"] + a["gen_ai.latency.time_in_model_prefill"])
    assert a["gen_ai.latency.e2e"] >= (a["gen_ai.latency.time_to_first_token"]
                                       + a["gen_ai.latency.time_in_model_decode"] - 1e-9)
    assert a["gen_ai.latency.time_in_model_decode"] > 0
    events = child["events"]
    assert [e["name"] for e in events] == ["scheduled", "first_token"]
    assert child["start_ns"] <= events[0]["time_ns"] <= events[1]["time_ns"] <= child["end_ns"]

    assert root["parent_span_id"] is None and root["trace_id"] != trace_id
    assert root["attributes"]["gen_ai.request.id"].startswith("cmpl-")
    assert root["attributes"]["gen_ai.usage.input_tokens"] == root_usage["prompt_tokens"]


async def test_failed_and_aborted_requests_end_their_span_with_an_error(traced, collector):
    async with aiohttp.ClientSession() as s:
        async with s.post(traced.url + "/v1/completions", json={"prompt": []},
                          headers={"X-Request-Id": "bad"}) as r:
            assert r.status == 400
        r = await s.post(traced.url + "/v1/completions", headers={"X-Request-Id": "gone"},
                         json=body_for("/v1/completions", True, max_tokens=4000))
        await r.content.readline()
        r.close()
    spans = await collector.wait_for(
        lambda got: {x["attributes"].get("gen_ai.request.id") for x in got} >= {"gone"}
        and len(got) >= 2)
    bad = next(x for x in spans if "gen_ai.request.id" not in x["attributes"])
    gone = next(x for x in spans if x["attributes"].get("gen_ai.request.id") == "gone")
    assert bad["status"] == gone["status"] == 2     # ERROR
    assert [e["name"] for e in gone["events"]] == ["scheduled", "first_token"]


async def test_an_unreachable_collector_costs_no_request(traced):
    """No collector listens (this runs after the ones that start one): every request is served."""
    async with aiohttp.ClientSession() as s:
        results = await asyncio.gather(*(ask(s, traced.url, "/v1/completions",
                                             body_for("/v1/completions", i % 2 == 0))
                                         for i in range(6)))
    for value, usage in results:
        breakdown(value)
        assert usage["completion_tokens"] == 4


@pytest.mark.parametrize("flag,needle", [("http://127.0.0.1:4318", "needs the OpenTelemetry SDK"),
                                         ("ftp://collector", "must be an http(s) URL")])
def test_a_tracing_flag_that_cannot_work_is_one_line_at_start(flag, needle, monkeypatch, capsys):
    from prefixgate.backend.cli import main

    if "SDK" in needle:     # as if the `otel` extra were not installed
        monkeypatch.setitem(sys.modules,
                            "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    assert main(["--model", "demo", "--port", "0", "--otlp-traces-endpoint", flag]) == 1
    err = capsys.readouterr().err
    assert needle in err and "--otlp-traces-endpoint" in err and "Traceback" not in err


def test_without_the_flag_nothing_of_opentelemetry_is_imported():
    code = ("import sys; from prefixgate.backend import cli; "
            "ns = cli.build_parser().parse_args([]); assert cli.tracing_config(ns) is None; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
