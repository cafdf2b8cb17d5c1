"""`prefixgate doctor` finds each planted fault and passes a clean setup."""
from __future__ import annotations

import gzip
import json

import aiohttp
import pytest
from aiohttp import web

from prefixgate.common.runtime import start_app
from prefixgate.proxy.doctor import scrape as pm
from prefixgate.proxy.doctor.checks import engine_state
from prefixgate.proxy.doctor.prompt import divergence, dynamic_fields
from tests.helpers import ServerThread
from tests.tools.helpers import by_title, doctor

SYSTEM = ("You are the support assistant of ACME Corp. Answer in two sentences at most, "
          "cite the policy section you rely on, and never promise refunds. ") * 8
CLEAN = {"model": "m", "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": "Where is my parcel?"}]}


def with_head(head: str, question: str = "Where is my parcel?") -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": head + SYSTEM},
                                       {"role": "user", "content": question}]}


def write(tmp_path, name: str, body: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return str(path)


@pytest.fixture
async def healthy(make_standin):
    """A streaming backend with a working prefix cache and a visible prefill cost."""
    return await make_standin(tokens=12, gap=0.01, prefix_cache=True, prefill_per_token=0.0002)


async def test_clean_setup_passes(healthy, tmp_path):
    rc, report, err = await doctor(healthy.url, "--request", write(tmp_path, "r.json", CLEAN))
    assert rc == 0, (report, err)
    f = by_title(report)
    assert f["streaming"]["status"] == "PASS"
    assert f["streaming"]["data"]["content_reads"] >= 8
    # the streamed probe is greedy whatever the request samples with: a sampled answer can
    # stop after a token or two (SmolLM2 did, once in 30 at temperature 1), too few to judge
    streamed, = [r["json"] for r in healthy.requests if r["json"].get("max_tokens", 0) > 1]
    assert streamed["temperature"] == 0 and streamed["stream"] is True
    assert f["prefix cache"]["status"] == "PASS" and f["prefix cache"]["data"]["hit_ratio"] > 0.9
    assert f["dynamic fields (request 1)"]["status"] == "PASS"
    assert f["KV cache usage"]["status"] == "PASS"
    assert report["problems"] == 0


async def test_timestamp_at_the_head_of_the_system_prompt_is_found(healthy, tmp_path):
    body = with_head("Current time: 2026-11-29 16:40:01 UTC\n")
    rc, report, err = await doctor(healthy.url, "--request", write(tmp_path, "r.json", body))
    assert rc == 1, (report, err)
    found = by_title(report)["dynamic fields (request 1)"]
    assert found["status"] == "FAIL"
    assert found["data"]["moved"][0]["value"] == "2026-11-29 16:40:01 UTC"
    assert found["data"]["offset"]["chars"] < 20           # right at the head
    assert "normalize" in found["fix"]
    # the rest of the setup is healthy
    assert by_title(report)["streaming"]["status"] == "PASS"


async def test_prefix_cache_off_is_found(make_standin):
    up = await make_standin(tokens=12, gap=0.01, prefix_cache=False, prefill_per_token=0.0002)
    rc, report, err = await doctor(up.url)
    assert rc == 1, (report, err)
    found = by_title(report)["prefix cache"]
    assert found["status"] == "FAIL" and found["data"]["hits"] == 0
    assert "--enable-prefix-caching" in found["fix"]


async def buffering_proxy(upstream: str, compress: bool = False, bursts: int | None = None):
    """What a misconfigured nginx/CDN does: read the upstream's whole stream, then send it.
    `bursts`: only the first this many answers of more than one token are sent whole (as a
    client short of CPU would read them), the rest relayed as they come."""
    session = aiohttp.ClientSession(auto_decompress=False)
    whole = {"left": bursts}

    async def post(request):
        body = await request.read()
        if whole["left"] is not None and json.loads(body).get("max_tokens", 0) > 1:
            if whole["left"] == 0:
                return await relay(request, body)
            whole["left"] -= 1
        async with session.post(upstream + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as r:
            data, status, ctype = await r.read(), r.status, r.headers["Content-Type"]
        resp = web.StreamResponse(status=status, headers={"Content-Type": ctype})
        if compress:
            data = gzip.compress(data)
            resp.headers["Content-Encoding"] = "gzip"
        await resp.prepare(request)
        await resp.write(data)          # chunked, no Content-Length: only timing gives it away
        await resp.write_eof()
        return resp

    async def relay(request, body: bytes):
        async with session.post(upstream + request.path, data=body,
                                headers={"Content-Type": "application/json"}) as r:
            resp = web.StreamResponse(status=r.status,
                                      headers={"Content-Type": r.headers["Content-Type"]})
            await resp.prepare(request)
            async for chunk in r.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    async def get(request):
        async with session.get(upstream + request.path) as r:
            return web.Response(body=await r.read(), status=r.status,
                                content_type=r.content_type)
    app = web.Application()
    app.router.add_post("/v1/chat/completions", post)
    app.router.add_get("/v1/models", get)
    app.router.add_get("/metrics", get)
    app.on_cleanup.append(lambda _: session.close())
    return await start_app(app)


@pytest.mark.parametrize("compress", [False, True], ids=["buffering", "gzip"])
async def test_buffering_proxy_in_front_is_found(healthy, compress):
    runner, url = await buffering_proxy(healthy.url, compress)
    try:
        rc, report, err = await doctor(url)
    finally:
        await runner.cleanup()
    assert rc == 1, (report, err)
    found = by_title(report)["streaming"]
    assert found["status"] == "FAIL"
    assert ("compressed" if compress else "buffered") in found["detail"]
    assert "proxy_buffering off" in found["fix"]
    assert by_title(report)["prefix cache"]["status"] == "PASS"   # only the proxy is at fault
    if not compress:        # checked again, and buffered every time
        assert "in 3 stream(s) of 3" in found["detail"]
        assert found["data"]["bursts_before"] == 2


async def test_a_burst_that_does_not_repeat_is_no_buffering(healthy):
    # a client short of CPU (CI's two test processes) reads a stream's events in one go too;
    # the doctor checks again before blaming the route
    runner, url = await buffering_proxy(healthy.url, bursts=1)
    try:
        rc, report, err = await doctor(url)
    finally:
        await runner.cleanup()
    found = by_title(report)["streaming"]
    assert found["status"] == "PASS", found
    assert found["data"]["bursts_before"] == 1 and found["data"]["content_reads"] >= 8


async def test_through_the_gateway_timing_decides_and_server_ttft_compares(healthy,
                                                                           make_gateway):
    gw = await make_gateway({"upstreams": [{"name": "a", "url": healthy.url}],
                             "plugins": [{"metrics": {}}]})
    rc, report, err = await doctor(gw.url)
    assert rc == 0, (report, err)
    f = by_title(report)
    # the gateway's /metrics has no cache counters: judged by timing (~380 ms, then ~0)
    assert f["prefix cache"]["status"] == "PASS" and "timing" in f["prefix cache"]["detail"]
    # ... but it has its TTFT histogram, so client and gateway timings are compared
    assert f["client vs server TTFT"]["status"] == "PASS"
    assert f["client vs server TTFT"]["data"]["metric"] == "prefixgate_ttft_seconds"
    assert f["KV cache and preemptions"]["status"] == "SKIP"
    rc, report, _ = await doctor(gw.url, "--metrics-url", healthy.url)
    assert "queries" in by_title(report)["prefix cache"]["data"]


async def test_bad_input_exits_2(tmp_path):
    rc, out, err = await doctor("http://127.0.0.1:9", "--request", str(tmp_path / "nope.json"))
    assert rc == 2 and "nope.json" in err
    rc, out, err = await doctor("http://127.0.0.1:9")
    assert rc == 2 and "/v1/models" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt": "x"}')
    rc, out, err = await doctor("http://127.0.0.1:9", "--request", str(bad))
    assert rc == 2 and "messages" in err


def test_two_requests_diverge_at_their_timestamps_until_normalized():
    a = with_head("Current time: 2026-11-29 16:40:01\n", "first question")
    b = with_head("Current time: 2026-11-29 16:41:17\n", "first question, again")
    found = divergence(a, b)
    before, after = found.data["before"], found.data["after_normalize"]
    assert found.status == "WARN" and "inside the system prompt" in found.detail
    assert before["chars"] == len("<|system|>\nCurrent time: 2026-11-29 16:4")
    assert after["chars"] > len(SYSTEM)                # normalized: the system prompt is shared
    clean = divergence(CLEAN, {**CLEAN, "messages": [CLEAN["messages"][0], {
        "role": "user", "content": "Another question"}]})
    assert clean.status == "PASS"


def test_request_ids_are_found_too():
    body = with_head("Request ID: 7f3c9a2e-4b1d-4e8a-9c6f-2d5b8e1a0c47\n")
    found = dynamic_fields("r", body)
    assert found.status == "FAIL" and found.data["moved"][0]["type"] == "uuid"


VLLM_METRICS = """# HELP vllm:num_preemptions_total Cumulative number of preemption.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{model_name="m"}} {pre}
vllm:kv_cache_usage_perc{{model_name="m"}} {kv}
vllm:num_requests_waiting{{model_name="m"}} {waiting}
"""


def test_engine_state_from_vllm_metrics():
    start = pm.parse(VLLM_METRICS.format(pre=3, kv=0.2, waiting=0))
    end = pm.parse(VLLM_METRICS.format(pre=5, kv=0.97, waiting=4))
    found = {f.title: f for f in engine_state(start, end)}
    assert found["preemptions"].status == "FAIL" and found["preemptions"].data["during"] == 2
    assert found["KV cache usage"].status == "WARN"
    assert found["queue"].status == "WARN"
    quiet = {f.title: f for f in engine_state(start, start)}
    assert quiet["preemptions"].status == "WARN"       # some happened before this check
    assert quiet["KV cache usage"].status == "PASS" and "queue" not in quiet


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
async def test_real_engine_prefix_cache_on_and_off(caching, tmp_path):
    argv = ["--model", "demo", "--max-num-batched-tokens", "2048"]
    with ServerThread(argv + ([] if caching else ["--no-prefix-caching"])) as engine:
        rc, report, err = await doctor(engine.url, "--max-tokens", "8", "--request",
                                       write(tmp_path, "r.json", {**CLEAN, "model": "demo"}))
    found = by_title(report)["prefix cache"]
    assert found["data"]["metric"] == "prefixgate:prefix_cache_queries"
    if caching:
        assert rc == 0, (report, err)
        assert found["status"] == "PASS" and found["data"]["hit_ratio"] > 0.8
    else:
        assert rc == 1, (report, err)
        assert found["status"] == "FAIL" and found["data"]["hits"] == 0
    f = by_title(report)
    assert f["streaming"]["status"] == "PASS"
    # the engine's own TTFT histogram is there to compare the client's with
    assert f["client vs server TTFT"]["data"]["metric"] == "prefixgate:time_to_first_token_seconds"
    # ... and its Server-Timing header to break the client's TTFT down with
    assert f["TTFT breakdown"]["status"] != "SKIP", f["TTFT breakdown"]
    assert {"engine_queue", "prefill", "transfer"} <= set(f["TTFT breakdown"]["data"]["segments"])
    assert f["preemptions"]["status"] == "PASS"
