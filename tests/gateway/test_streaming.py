"""The gateway forwards what the upstream sends, as it is sent, over pooled connections."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai

from tests.helpers import CHAT, event_json, read_events


async def test_events_reach_the_client_as_they_are_produced(make_standin, make_gateway):
    up = await make_standin(tokens=4, gap=0.3)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    async with aiohttp.ClientSession() as client:
        t0 = time.monotonic()
        async with client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = (await read_events(r))[1:]       # after vLLM's opening role event
    arrivals = [t - t0 for t, _ in events]
    # tok0 at ~0 s, tok3 (+ [DONE]) at ~0.9 s: the first is not held back for the rest
    assert arrivals[0] < 0.25, arrivals
    assert arrivals[-1] > 0.8, arrivals
    assert arrivals[1] - arrivals[0] > 0.2 and arrivals[2] - arrivals[1] > 0.2, arrivals
    contents = [event_json(e) for _, e in events]
    assert contents[-1] == "[DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in contents[:4]] == [
        "tok0 ", "tok1 ", "tok2 ", "tok3 "]


async def test_stream_bytes_are_identical_to_the_upstreams(make_standin, make_gateway):
    up = await make_standin(tokens=6)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    body = {**CHAT, "stream": True}
    async with aiohttp.ClientSession() as client:
        async with client.post(up.url + "/v1/chat/completions", json=body) as r:
            direct = await r.read()
        async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
            proxied = await r.read()
    assert proxied == direct
    assert proxied.count(b"data: ") == 6 + 2      # 6 tokens, the usage chunk, [DONE]


async def test_streams_are_never_compressed(make_standin, make_gateway):
    up = await make_standin(tokens=20)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        async with client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"Accept-Encoding": "gzip, deflate, br"}) as r:
            raw = await r.read()
            assert "Content-Encoding" not in r.headers
    assert raw.startswith(b"data: {") and raw.endswith(b"data: [DONE]\n\n")
    assert up.requests[-1]["headers"].get("Accept-Encoding") == "identity"


async def test_sequential_requests_reuse_keepalive_connections(make_standin, make_gateway):
    up = await make_standin(tokens=3)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    async with aiohttp.ClientSession() as client:
        for i in range(20):
            body = {**CHAT, "stream": i % 2 == 0}
            async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
    assert len(up.requests) == 20
    assert up.connections <= 2, up.connections


async def test_request_fields_pass_through_untouched(make_standin, make_gateway):
    up = await make_standin()
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    body = {
        "model": "standin-model", "messages": [{"role": "user", "content": "天气? ☀"}],
        "stream": False,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}],
        "response_format": {"type": "json_object"}, "logprobs": True, "top_logprobs": 3,
        "temperature": 0.7, "seed": 1234567890123, "chat_template_kwargs": {"x": 1.5},
        "guided_json": {"type": "object"},
    }
    raw = json.dumps(body, separators=(",", ":")).encode()
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", data=raw,
                               headers={"Content-Type": "application/json",
                                        "Authorization": "Bearer sk-test",
                                        "X-Custom": "kept", "TE": "trailers",
                                        "Proxy-Authorization": "secret"}) as r:
            assert r.status == 200
            assert r.headers["x-prefixgate-upstream"] == "a"
            assert len(r.headers["x-prefixgate-request-id"]) >= 16
    got = up.requests[-1]
    assert got["json"] == body
    assert got["headers"]["X-Custom"] == "kept"
    assert got["headers"]["Authorization"] == "Bearer sk-test"
    assert "TE" not in got["headers"] and "Proxy-Authorization" not in got["headers"]
    assert got["headers"]["X-Request-Id"] == r.headers["x-prefixgate-request-id"]


async def test_client_request_id_is_kept(gateway, standin):
    async with aiohttp.ClientSession() as client:
        async with client.post(gateway.url + "/v1/completions", json={"prompt": "x"},
                               headers={"X-Request-Id": "abc-123"}) as r:
            assert r.headers["x-prefixgate-request-id"] == "abc-123"
    assert standin.requests[-1]["headers"]["X-Request-Id"] == "abc-123"


async def test_openai_sdk_through_the_gateway(gateway):
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-none", max_retries=0)
    try:
        chat = await client.chat.completions.create(model="standin-model", messages=[
            {"role": "user", "content": "hi"}])
        assert chat.choices[0].message.content.startswith("tok0 tok1")
        assert chat.usage.completion_tokens == 8

        parts = []
        stream = await client.chat.completions.create(
            model="standin-model", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        assert "".join(parts) == "".join(f"tok{i} " for i in range(8))

        comp = await client.completions.create(model="standin-model", prompt="say", max_tokens=4)
        assert comp.choices[0].text.startswith("tok0")
        texts = [c.choices[0].text async for c in
                 await client.completions.create(model="standin-model", prompt="say", stream=True)]
        assert "".join(texts).startswith("tok0 tok1")
        models = await client.models.list()
        assert [m.id for m in models.data] == ["standin-model"]
    finally:
        await client.close()


async def test_client_disconnect_closes_the_upstream_stream(make_standin, make_gateway):
    up = await make_standin(tokens=100, gap=0.1)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    async with aiohttp.ClientSession() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await r.content.readline()
        r.close()                          # the client goes away mid-stream
        t0 = time.monotonic()
        while up.aborted == 0 and time.monotonic() - t0 < 2:
            await asyncio.sleep(0.02)
    assert up.aborted == 1, "upstream kept generating after the client left"
    assert time.monotonic() - t0 < 1.0
    assert gw.gateway.upstreams[0].inflight == 0


async def test_mid_stream_upstream_failure_ends_with_an_sse_error(make_standin, make_gateway):
    up = await make_standin(tokens=10, fail="reset_after", fail_after=3)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}]})
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            events = [event_json(e) for _, e in await read_events(r)][1:]   # after the role's
    assert len(events) == 4
    assert [e["choices"][0]["delta"]["content"] for e in events[:3]] == ["tok0 ", "tok1 ", "tok2 "]
    assert events[3]["error"]["code"] == "upstream_error"
    # the gateway is fine afterwards
    async with aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/health") as r:
            assert r.status == 200
