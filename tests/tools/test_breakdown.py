"""The TTFT breakdown from the `Server-Timing` header: in `prefixgate bench` archives and
summaries, and as `prefixgate doctor`'s "TTFT breakdown" finding."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from prefixgate.common.runtime import start_app
from prefixgate.proxy.bench.client import Sample
from prefixgate.proxy.bench.stats import server_timing_p50, summarize
from prefixgate.proxy.doctor.checks import SEGMENTS, breakdown_segments, ttft_breakdown
from tests.helpers import ServerThread
from tests.tools.helpers import by_title, doctor, run_cli

ENGINE = {"tokenize": 2.0, "queue": 10.0, "prefill": 30.0, "decode": 1.0}


# --- the check, from given headers ---------------------------------------------------------
def test_gateway_shaped_header_names_engine_queueing():
    timing = {"gw": 0.4, "gw-queue": 0.1, "connect": 0.0, "upstream": 900.0,
              "tokenize": 2.0, "queue": 780.0, "prefill": 100.0, "decode": 1.0}
    f = ttft_breakdown(1.0, timing)
    assert (f.check, f.title, f.status) == ("a", "TTFT breakdown", "WARN")
    assert f.detail.startswith("78% of TTFT is engine queueing")
    assert "max_num_seqs" in f.fix and "replicas" in f.fix
    seg = f.data["segments"]
    assert seg == {"gateway": 0.4, "gateway_queue": 0.1, "connect": 0.0, "engine_tokenize": 2.0,
                   "engine_queue": 780.0, "prefill": 100.0, "first_decode": 1.0,
                   "upstream_other": 17.0, "transfer": 99.5}
    assert f.data["dominant"] == "engine_queue" and f.data["share"] == 0.78
    assert f.data["client_ms"] == 1000.0
    for label in ("gateway 0.4 ms", "engine queue 780.0 ms (78%)", "upstream other 17.0 ms",
                  "transfer/unaccounted 99.5 ms (10%)"):
        assert label in f.detail


def test_engine_shaped_header_rest_is_transfer():
    seg = breakdown_segments(100.0, ENGINE)
    assert seg == {"engine_tokenize": 2.0, "engine_queue": 10.0, "prefill": 30.0,
                   "first_decode": 1.0, "transfer": 57.0}
    assert "upstream_other" not in seg
    f = ttft_breakdown(0.1, ENGINE)
    assert f.status == "WARN" and f.data["dominant"] == "transfer"
    assert "buffering proxy" in f.fix
    # a gateway in front of vLLM: no engine entries, so all of `upstream` is "upstream other"
    seg = breakdown_segments(100.0, {"gw": 1.0, "connect": 0.0, "upstream": 90.0})
    assert seg == {"gateway": 1.0, "connect": 0.0, "upstream_other": 90.0, "transfer": 9.0}


@pytest.mark.parametrize("timing,client_ms,dominant,status,fix", [
    ({"gw": 700.0, "upstream": 250.0, "queue": 200.0, "prefill": 40.0}, 1000, "gateway",
     "WARN", "prerender"),
    ({"gw": 1.0, "gw-queue": 800.0, "upstream": 150.0}, 1000, "gateway_queue", "WARN",
     "raise max_inflight"),
    ({"gw": 1.0, "connect": 600.0, "upstream": 300.0}, 1000, "connect", "WARN", "keep-alive"),
    ({"gw": 1.0, "upstream": 950.0, "queue": 1.0, "prefill": 20.0}, 1000, "upstream_other",
     "WARN", "slow HTTP layer"),
    ({"gw": 1.0, "upstream": 100.0}, 1000, "transfer", "WARN", "buffering proxy"),
    ({**ENGINE, "tokenize": 700.0}, 1000, "engine_tokenize", "WARN", "forward tokens"),
    ({**ENGINE, "queue": 700.0}, 1000, "engine_queue", "WARN", "cap concurrency"),
    ({**ENGINE, "prefill": 900.0}, 1000, "prefill", "INFO", "see (b) prefix cache"),
    ({**ENGINE, "decode": 600.0}, 1000, "first_decode", "WARN", "event loop"),
], ids=lambda v: v if isinstance(v, str) and v in SEGMENTS else None)
def test_each_dominant_segment_gets_its_fix(timing, client_ms, dominant, status, fix):
    f = ttft_breakdown(client_ms / 1000.0, timing)
    assert f.data["dominant"] == dominant and f.data["share"] >= 0.5
    assert f.status == status and fix in f.fix
    assert f"of TTFT is {SEGMENTS[dominant][1]}" in f.detail
    if status == "INFO":                 # the CLI prints fixes for WARN/FAIL only
        assert fix in f.detail


def test_no_dominant_segment_or_a_short_ttft_passes():
    f = ttft_breakdown(0.1, {"queue": 40.0, "prefill": 40.0, "decode": 1.0})
    assert f.status == "PASS" and f.data["dominant"] is None and "no segment dominates" in f.detail
    f = ttft_breakdown(0.008, {"queue": 6.0, "prefill": 1.0})       # 75%, but of 8 ms
    assert f.status == "PASS" and f.data["dominant"] is None and "too short" in f.detail


def test_no_header_is_skipped():
    for timing in (None, {}):
        f = ttft_breakdown(0.2, timing)
        assert f.status == "SKIP" and "no Server-Timing" in f.detail and "vLLM" in f.detail
    f = ttft_breakdown(0.2, {"db": 3.0})
    assert f.status == "SKIP" and "none of the entries" in f.detail
    assert ttft_breakdown(None, ENGINE).status == "SKIP"


# --- bench: samples and summaries ----------------------------------------------------------
TIMED_GATEWAY = 'gw;dur=0.3, upstream;dur=50.0'


async def timed_server(ttft_s: float = 0.0, probe_ttft_s: float | None = None,
                       queue_ms=None, gateway: bool = True, tokens: int = 6, gap: float = 0.005):
    """An SSE server that sends a known Server-Timing (an engine's entries, then, with
    `gateway`, a second header line with a gateway's) after `ttft_s` (`probe_ttft_s` for
    max_tokens=1 requests); request i (from 1) reports queue = queue_ms(i)."""
    count = 0

    async def chat(request):
        nonlocal count
        body = await request.json()
        count += 1
        queue = queue_ms(count) if queue_ms else 10.0
        short = body.get("max_tokens") == 1 and probe_ttft_s is not None
        await asyncio.sleep(probe_ttft_s if short else ttft_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        resp.headers.add("Server-Timing", f'tokenize;dur=1.5, queue;dur={queue}, '
                                          f'prefill;dur=30.0;desc="computed=96 cached=64", '
                                          f'decode;dur=0.5')
        if gateway:
            resp.headers.add("Server-Timing", TIMED_GATEWAY)
        await resp.prepare(request)
        n = 1 if body.get("max_tokens") == 1 else tokens
        for i in range(n):
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "},
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await asyncio.sleep(gap)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "timed", "object": "model"}]})
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return await start_app(app)


async def test_bench_archives_server_timing_and_its_medians(tmp_path, make_standin):
    runner, url = await timed_server(queue_ms=lambda i: 10.0 * i)
    out = tmp_path / "run.json"
    try:
        rc, stdout, stderr = await run_cli(
            "bench", "--url", url, "--tiers", "32", "--concurrency", "1", "--requests", "5",
            "--warmup", "1", "--max-tokens", "3", "--out", str(out))
    finally:
        await runner.cleanup()
    assert rc == 0, stderr
    cell = json.loads(out.read_text())["cells"][0]
    samples = cell["samples"]
    assert [s["server_timing"]["queue"] for s in samples] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert samples[0]["server_timing"] == {"tokenize": 1.5, "queue": 10.0, "prefill": 30.0,
                                           "decode": 0.5, "gw": 0.3, "upstream": 50.0}
    # medians over the 5 measured requests (the warm-up one, queue=10, is left out)
    assert cell["summary"]["server_timing_p50"] == {"gw": 0.3, "upstream": 50.0, "tokenize": 1.5,
                                                    "queue": 40.0, "prefill": 30.0, "decode": 0.5}
    line = next(x for x in stdout.splitlines() if "server-timing p50 ms:" in x)
    assert line.startswith("tier=32 c=1") and "queue 40.0" in line and "prefill 30.0" in line

    # a server without the header (vLLM, the stand-in): None per sample, no summary field
    up = await make_standin(tokens=3)
    rc, stdout, stderr = await run_cli(
        "bench", "--url", up.url, "--tiers", "32", "--concurrency", "1", "--requests", "2",
        "--warmup", "0", "--max-tokens", "3", "--out", str(out))
    assert rc == 0, stderr
    cell = json.loads(out.read_text())["cells"][0]
    assert all(s["server_timing"] is None for s in cell["samples"])
    assert "server_timing_p50" not in cell["summary"] and "server-timing" not in stdout


def test_archives_from_before_the_field_still_load():
    old = {"index": 0, "warmup": False, "start": 0.0, "ttft": 0.1, "latency": 0.2, "itl": [],
           "output_tokens": 1, "content_events": 1, "prompt_tokens": None,
           "cached_tokens": None, "status": 200, "error": None}
    assert Sample(**old).server_timing is None
    assert server_timing_p50([old, {**old, "server_timing": {"queue": 4.0}}]) == {"queue": 4.0}
    assert "server_timing_p50" not in summarize([Sample(**old)], 0.5)


# --- doctor ----------------------------------------------------------------------------------
async def test_doctor_names_the_dominant_segment_from_the_header():
    # the streamed probe's first token comes after ~150 ms, 120 of them engine queue by the
    # header (the max_tokens=1 cache probes are answered at once)
    runner, url = await timed_server(ttft_s=0.15, probe_ttft_s=0.002, gateway=False,
                                     queue_ms=lambda i: 120.0)
    try:
        rc, report, err = await doctor(url, "--max-tokens", "8")
    finally:
        await runner.cleanup()
    f = by_title(report)["TTFT breakdown"]
    assert f["check"] == "a" and f["data"]["server_timing"]["queue"] == 120.0
    assert f["status"] == "WARN" and f["data"]["dominant"] == "engine_queue", f
    assert "% of TTFT is engine queueing" in f["detail"] and "max_num_seqs" in f["fix"]
    assert set(f["data"]["segments"]) == {"engine_tokenize", "engine_queue", "prefill",
                                          "first_decode", "transfer"}
    assert rc == 0, (report, err)        # a WARN does not fail the doctor
    titles = [x["title"] for x in report["findings"]]
    assert titles.index("TTFT breakdown") == titles.index("client vs server TTFT") + 1


async def test_doctor_skips_the_breakdown_without_the_header(make_standin):
    up = await make_standin(tokens=8, gap=0.005)
    rc, report, err = await doctor(up.url, "--max-tokens", "8")
    f = by_title(report)["TTFT breakdown"]
    assert f["status"] == "SKIP" and "no Server-Timing" in f["detail"], (f, err)


async def test_doctor_names_engine_queueing_against_a_busy_engine():
    """One sequence at a time, kept busy by long streams back to back: every probe waits."""
    with ServerThread(["--model", "demo", "--max-num-seqs", "1"]) as engine:
        stop = asyncio.Event()

        async def hog(session):
            body = {"model": "demo", "messages": [{"role": "user", "content": "count"}],
                    "max_tokens": 40, "ignore_eos": True, "stream": True}
            while not stop.is_set():
                async with session.post(engine.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    async for _ in r.content.iter_any():
                        pass
        async with aiohttp.ClientSession() as session:
            # two of them: while one runs the other waits, so a probe always queues behind
            # the rest of one and the whole of another
            hogs = [asyncio.ensure_future(hog(session)) for _ in range(2)]
            await asyncio.sleep(0.3)
            try:
                rc, report, err = await doctor(engine.url, "--max-tokens", "4")
            finally:
                stop.set()
                await asyncio.gather(*hogs)
    f = by_title(report)["TTFT breakdown"]
    assert f["status"] == "WARN", f
    assert f["data"]["dominant"] == "engine_queue" and "engine queueing" in f["detail"], f
    assert "max_num_seqs" in f["fix"]
    assert rc in (0, 1), (report, err)
