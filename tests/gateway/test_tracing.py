"""OpenTelemetry traces from the gateway, received by a real OTLP/HTTP receiver."""
from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.common.tracing import RateLimitedLog
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.testing.otlp import OtlpReceiver
from tests.helpers import CHAT, ServerThread

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
async def receiver():
    r = await OtlpReceiver().start()
    yield r
    await r.stop()


def traced(up_url: str, endpoint: str, **extra) -> dict:
    return {"upstreams": [{"name": "a", "url": up_url}],
            "tracing": {"otlp_endpoint": endpoint, **extra}, "plugins": [{"metrics": {}}]}


async def test_server_and_client_spans_continue_the_callers_trace(make_gateway, make_standin,
                                                                  receiver):
    up = await make_standin(tokens=3)
    gw = await make_gateway(traced(up.url, receiver.url))
    async with aiohttp.ClientSession() as client:
        body = {**CHAT, "stream": True, "max_tokens": 7,
                "stream_options": {"include_usage": True}}      # else vLLM sends no usage
        async with client.post(gw.url + "/v1/chat/completions", json=body, headers={
                "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01", "tracestate": "vendor=1",
                "X-Request-Id": "traced-1"}) as r:
            assert r.status == 200
            await r.read()
    spans = await receiver.wait_for(lambda s: len(s) >= 2)
    server = next(s for s in spans if s["kind"] == "SERVER")
    client_span = next(s for s in spans if s["kind"] == "CLIENT")
    assert server["name"] == "chat standin-model" and server["service"] == "prefixgate"
    assert server["trace_id"] == client_span["trace_id"] == TRACE_ID
    assert server["parent_span_id"] == CALLER_SPAN
    assert client_span["parent_span_id"] == server["span_id"]
    a = server["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "standin-model"
    assert a["gen_ai.response.model"] == "standin-model" and a["gen_ai.request.max_tokens"] == 7
    assert a["gen_ai.usage.output_tokens"] == 3 and a["gen_ai.usage.input_tokens"] > 0
    assert a["prefixgate.upstream"] == "a" and a["prefixgate.request_id"] == "traced-1"
    assert a["http.response.status_code"] == 200 and a["prefixgate.route"] == "round_robin"
    for key in ("ttft_ms", "gateway_ms", "queue_ms", "connect_ms", "upstream_ttft_ms"):
        assert a[f"prefixgate.{key}"] >= 0
    assert (server["start_ns"] <= client_span["start_ns"] <= client_span["end_ns"]
            <= server["end_ns"])
    c = client_span["attributes"]
    assert client_span["name"] == "POST /v1/chat/completions"
    assert c["prefixgate.upstream"] == "a" and c["http.response.status_code"] == 200
    assert c["server.address"] == "127.0.0.1" and c["url.full"] == up.url + "/v1/chat/completions"
    # the upstream got a traceparent of the same trace, whose parent is the attempt's span
    sent = up.requests[0]["headers"]
    assert sent["traceparent"] == f"00-{TRACE_ID}-{client_span['span_id']}-01"
    assert sent["tracestate"] == "vendor=1"


async def test_a_failed_attempt_and_the_retry_are_two_client_spans(make_gateway, make_standin,
                                                                   receiver):
    bad = await make_standin(fail="status", status=503)
    good = await make_standin()
    gw = await make_gateway({**traced(bad.url, receiver.url),
                             "upstreams": [{"name": "bad", "url": bad.url},
                                           {"name": "good", "url": good.url}],
                             "plugins": [{"prefix_route": {"policy": "chwbl"}}]})
    async with aiohttp.ClientSession() as client:
        for i in range(6):        # some requests hash to `bad` first, then retry on `good`
            async with client.post(gw.url + "/v1/chat/completions", json={
                    **CHAT, "messages": [{"role": "user", "content": f"q{i}" * 40}]}) as r:
                assert r.status == 200
    spans = await receiver.wait_for(lambda s: sum(x["kind"] == "SERVER" for x in s) >= 6)
    servers = {s["span_id"]: s for s in spans if s["kind"] == "SERVER"}
    retried = [s for s in servers.values() if s["attributes"]["prefixgate.attempts"] == 2]
    assert retried, "no request went to the failing upstream first"
    for server in retried:
        attempts = sorted((s for s in spans if s["parent_span_id"] == server["span_id"]),
                          key=lambda s: s["start_ns"])
        assert [a["attributes"]["prefixgate.upstream"] for a in attempts] == ["bad", "good"]
        assert attempts[0]["status"] == 2            # STATUS_CODE_ERROR
        assert attempts[0]["attributes"]["http.response.status_code"] == 503
        assert server["status"] == 0 and server["attributes"]["prefixgate.upstream"] == "good"


async def test_no_traceparent_starts_a_trace_and_errors_are_spans_too(make_gateway, standin,
                                                                      receiver):
    gw = await make_gateway(traced(standin.url, receiver.url))
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with client.post(gw.url + "/v1/chat/completions",
                               json={**CHAT, "model": "unknown"}) as r:
            assert r.status == 404
    spans = await receiver.wait_for(lambda s: sum(x["kind"] == "SERVER" for x in s) >= 2)
    ok, missing = sorted((s for s in spans if s["kind"] == "SERVER"),
                         key=lambda s: s["start_ns"])
    assert ok["parent_span_id"] is None and len(ok["trace_id"]) == 32
    assert standin.requests[0]["headers"]["traceparent"].split("-")[1] == ok["trace_id"]
    assert missing["attributes"]["http.response.status_code"] == 404
    assert missing["status"] == 0       # a client's error is not the server's (semconv)
    assert not [s for s in spans if s["parent_span_id"] == missing["span_id"]]


async def test_sampling_off_still_propagates_an_unsampled_context(make_gateway, standin,
                                                                  receiver):
    gw = await make_gateway(traced(standin.url, receiver.url, sample_ratio=0.0))
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        # a sampled caller is followed (parent-based sampling)
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT, headers={
                "traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}) as r:
            assert r.status == 200
    spans = await receiver.wait_for(lambda s: len(s) >= 2)
    assert {s["trace_id"] for s in spans} == {TRACE_ID}
    unsampled = standin.requests[0]["headers"]["traceparent"]
    assert unsampled.endswith("-00") and unsampled.split("-")[1] != TRACE_ID


async def test_an_unreachable_collector_costs_no_request(make_gateway, standin, caplog):
    gw = await make_gateway(traced(standin.url, "http://127.0.0.1:9", export_timeout_s=0.5))
    async with aiohttp.ClientSession() as client:
        t0 = time.monotonic()
        for _ in range(20):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 200
        assert time.monotonic() - t0 < 5
    await asyncio.sleep(0.3)
    t0 = time.monotonic()
    await asyncio.to_thread(gw.gateway.observer.close)
    assert time.monotonic() - t0 < 8            # shutdown is bounded too


def test_bad_tracing_config_names_the_key():
    base = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match=r"tracing\.otlp_endpoint: required"):
        config_mod.validate({**base, "tracing": {}})
    with pytest.raises(ConfigError, match=r"tracing\.otlp_endpoint: must be an http\(s\) URL"):
        config_mod.validate({**base, "tracing": {"otlp_endpoint": "grpc://x:4317"}})
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio: must be in 0\.\.1"):
        config_mod.validate({**base, "tracing": {"otlp_endpoint": "http://x:4318",
                                                 "sample_ratio": 2}})


def test_export_failures_are_one_log_line_a_minute():
    logger = logging.getLogger("test.export")
    quiet = RateLimitedLog(every_s=60)
    logger.addFilter(quiet)
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        for _ in range(50):
            logger.warning("export failed")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 1 and quiet.held == 49
    quiet.next_at = 0.0                       # a minute later: one more, with the count
    assert quiet.filter(logging.LogRecord("x", logging.WARNING, "", 0, "again", (), None))
    assert quiet.held == 0


async def test_engine_spans_join_the_gateways_trace_and_its_timing_reaches_the_log(
        make_gateway, receiver, tmp_path, monkeypatch):
    """gateway SERVER -> CLIENT attempt -> the engine's llm_request, one trace; the engine's
    Server-Timing is forwarded with the gateway's entries and fills the log's breakdown."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")      # the engine exports within ms
    path = tmp_path / "access.log"
    with ServerThread(["--model", "demo", "--otlp-traces-endpoint", receiver.url]) as engine:
        gw = await make_gateway({**traced(engine.url, receiver.url),
                                 "access_log": {"path": str(path)}})
        async with aiohttp.ClientSession() as client:
            body = {"model": "demo", "stream": True, "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hello there"}],
                    "stream_options": {"include_usage": True}}
            async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                timing = r.headers["Server-Timing"]
                await r.read()
        spans = await receiver.wait_for(lambda s: len(s) >= 3, timeout=15)
    by_kind = {s["name"]: s for s in spans}
    server, attempt, engine_span = (by_kind["chat demo"], by_kind["POST /v1/chat/completions"],
                                    by_kind["llm_request"])
    assert len({server["trace_id"], attempt["trace_id"], engine_span["trace_id"]}) == 1
    assert engine_span["parent_span_id"] == attempt["span_id"]
    assert attempt["parent_span_id"] == server["span_id"]
    assert engine_span["service"] != server["service"]
    names = [e.split(";")[0].strip() for e in timing.split(",")]
    assert names == ["tokenize", "queue", "prefill", "decode", "gw", "gw-queue", "connect",
                     "upstream"]
    async with asyncio.timeout(5):
        while not path.exists() or not path.read_text().endswith("\n"):
            await asyncio.sleep(0.02)
    line = json.loads(path.read_text().splitlines()[0])
    assert line["engine_queue_ms"] >= 0 and line["prefill_ms"] > 0
    assert line["first_decode_ms"] >= 0
    assert line["prefill_ms"] <= line["upstream_ttft_ms"] + 0.1   # the engine's part is inside
    assert line["completion_tokens"] == 4 and line["prompt_tokens"] > 0
    assert server["attributes"]["prefixgate.prefill_ms"] == line["prefill_ms"]


def test_the_export_encoding_is_what_opentelemetry_proto_decodes():
    from prefixgate.proxy.observe.span_export import CLIENT, SERVER, Encoder
    from prefixgate.proxy.testing.otlp import decode

    attrs = {"s": "ünïcode ✓", "t": True, "f": False, "i": 7, "neg": -3, "big": 2**62,
             "d": 12.5, "z": 0.0, "nd": -1e-9}
    batch = [("chat m", SERVER, 2**127 + 5, 2**63 + 1, None, 10, 20, attrs, None),
             ("POST /x", CLIENT, 2**127 + 5, 42, 2**63 + 1, 11, 19, {"s": "ünïcode ✓"}, "boom"),
             ("chat m", SERVER, 1, 2, 3, 1, 2, {**attrs, "d": 99.25}, None)]   # reused encodings
    encoder = Encoder("svc")
    spans = decode(encoder.encode(batch))
    assert decode(encoder.encode(batch)) == spans          # the same bytes' meaning, twice
    first, second, third = spans
    assert first["attributes"] == attrs and first["service"] == "svc"
    assert first["trace_id"] == f"{2**127 + 5:032x}" and first["span_id"] == f"{2**63 + 1:016x}"
    assert first["parent_span_id"] is None and first["kind"] == "SERVER"
    assert (first["start_ns"], first["end_ns"]) == (10, 20) and first["status"] == 0
    assert second["parent_span_id"] == f"{2**63 + 1:016x}" and second["kind"] == "CLIENT"
    assert second["status"] == 2 and second["name"] == "POST /x"
    assert third["attributes"]["d"] == 99.25 and third["attributes"]["neg"] == -3


def test_bundled_engines_trace_to_the_gateways_collector():
    from prefixgate.proxy.bundled import BundledEngines

    cfg = config_mod.validate({"bundled": {"args": ["--max-num-seqs", 8]},
                               "tracing": {"otlp_endpoint": "http://collector:4318"}})
    engines = BundledEngines(cfg["bundled"], cfg["tracing"])
    assert engines.engine_args() == ["--max-num-seqs", "8", "--otlp-traces-endpoint",
                                     "http://collector:4318", "--otlp-service-name",
                                     "prefixgate-engine"]
    own = config_mod.validate({"bundled": {"args": ["--otlp-traces-endpoint", "http://x:1"]},
                               "tracing": {"otlp_endpoint": "http://collector:4318"}})
    assert BundledEngines(own["bundled"], own["tracing"]).engine_args() == [
        "--otlp-traces-endpoint", "http://x:1"]                # the engines' own setting wins
    assert BundledEngines(cfg["bundled"]).engine_args() == ["--max-num-seqs", "8"]
