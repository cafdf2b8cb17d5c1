"""Anthropic's Messages API through the gateway, with the real `anthropic` SDK: streamed events
relayed unbuffered and as the upstream sent them, usage read from them (access log, metrics),
count_tokens, keys by `x-api-key`, and every error in Anthropic's shape — before the upstream,
from it, and in the middle of a stream."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import anthropic
import pytest

from prefixgate.common import sse
from prefixgate.common.runtime import free_port
from tests.plugins.helpers import metrics, sample

KEY = "sk-gateway-key-messages"
SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 20,
           "cache_control": {"type": "ephemeral"}}]
MESSAGES = [{"role": "user", "content": "List the files."}]


def client_for(gw, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


def gateway_config(standin, log=None, **extra) -> dict:
    cfg = {"upstreams": [{"name": "a", "url": standin.url}], "plugins": [{"metrics": {}}]}
    if log is not None:
        cfg["access_log"] = {"path": str(log)}
    return {**cfg, **extra}


async def test_a_streamed_message_arrives_event_by_event_with_its_usage(
        make_standin, make_gateway, tmp_path):
    standin = await make_standin(tokens=6, gap=0.15, prefix_cache=True)
    log = tmp_path / "access.log"
    gw = await make_gateway(gateway_config(standin, log))
    client = client_for(gw)
    for _ in range(2):                         # the second finds the system prompt cached
        started, arrivals, kinds = time.monotonic(), [], []
        async with client.messages.stream(model="standin-model", max_tokens=64, system=SYSTEM,
                                          messages=MESSAGES) as stream:
            async for event in stream:
                kinds.append(event.type)
                arrivals.append(time.monotonic() - started)
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    # unbuffered: the first delta reached the client long before the last
    first_delta = arrivals[kinds.index("content_block_delta")]
    assert first_delta < arrivals[-1] - 0.3, arrivals
    assert final.content[0].type == "text" and final.content[0].text
    assert final.usage.cache_read_input_tokens > 0
    await asyncio.sleep(0.2)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    last = lines[-1]
    assert last["path"] == "/v1/messages" and last["status"] == 200 and last["stream"] is True
    assert last["prompt_tokens"] == (final.usage.input_tokens + final.usage.cache_read_input_tokens
                                     + (final.usage.cache_creation_input_tokens or 0))
    assert last["cached_tokens"] == final.usage.cache_read_input_tokens
    async with aiohttp.ClientSession() as http:
        m = await metrics(http, gw)
    assert sample(m, "prefixgate_ttft_seconds_count", upstream="a") == 2


async def test_the_stream_is_relayed_as_the_upstream_sent_it(make_standin, make_gateway):
    standin = await make_standin(tokens=4)
    gw = await make_gateway(gateway_config(standin))
    body = {"model": "standin-model", "max_tokens": 16, "stream": True, "messages": MESSAGES}
    raw = {}
    async with aiohttp.ClientSession() as http:
        for name, url in (("direct", standin.url), ("gateway", gw.url)):
            async with http.post(url + "/v1/messages", json=body,
                                 headers={"anthropic-version": "2023-06-01"}) as r:
                assert r.status == 200 and r.content_type == "text/event-stream"
                raw[name] = await r.read()

    def shape(data: bytes) -> list:       # ids differ per answer; everything else is the same
        return [(sse.parse(e).event, sorted(json.loads(sse.parse(e).data)))
                for e in sse.events_in([data]) if sse.parse(e).data]
    assert shape(raw["gateway"]) == shape(raw["direct"])
    assert raw["gateway"].count(b"event: ") == raw["direct"].count(b"event: ")
    assert standin.requests[-1]["headers"]["anthropic-version"] == "2023-06-01"


async def test_a_whole_message_and_count_tokens(make_standin, make_gateway):
    standin = await make_standin(tokens=3)
    gw = await make_gateway(gateway_config(standin))
    client = client_for(gw)
    message = await client.messages.create(model="standin-model", max_tokens=32, system=SYSTEM,
                                           messages=MESSAGES)
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].text and message.usage.output_tokens == 3
    counted = await client.messages.count_tokens(model="standin-model", system=SYSTEM,
                                                 messages=MESSAGES)
    assert counted.input_tokens == message.usage.input_tokens + (
        message.usage.cache_read_input_tokens or 0)
    assert [r["path"] for r in standin.requests] == ["/v1/messages", "/v1/messages/count_tokens"]


async def test_keys_by_x_api_key_or_bearer_and_not_forwarded(make_standin, make_gateway):
    standin = await make_standin(tokens=2)
    gw = await make_gateway(gateway_config(standin, auth={"api_keys": [KEY]}))
    message = await client_for(gw, KEY).messages.create(       # the SDK sends x-api-key
        model="standin-model", max_tokens=8, messages=MESSAGES)
    assert message.content[0].text
    bearer = anthropic.AsyncAnthropic(base_url=gw.url, auth_token=KEY, max_retries=0)
    assert (await bearer.messages.create(model="standin-model", max_tokens=8,
                                         messages=MESSAGES)).content
    sent = [{k.lower() for k in r["headers"]} for r in standin.requests]
    assert all("x-api-key" not in h and "authorization" not in h for h in sent)
    with pytest.raises(anthropic.AuthenticationError) as e:
        await client_for(gw, "sk-wrong-key-0000").messages.create(
            model="standin-model", max_tokens=8, messages=MESSAGES)
    assert e.value.status_code == 401
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": "invalid API key"}}


@pytest.mark.parametrize("body,field", [
    ({"model": "standin-model", "messages": MESSAGES}, "max_tokens"),
    ({"model": "standin-model", "max_tokens": 8, "messages": []}, "messages"),
    ({"model": "standin-model", "max_tokens": 8, "messages": [{"role": "user"}]},
     "messages[0].content"),
])
async def test_a_bad_request_is_an_anthropic_error_before_any_upstream(
        standin, make_gateway, body, field):
    gw = await make_gateway(gateway_config(standin))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages", json=body) as r:
            payload = await r.json()
    assert r.status == 400 and set(payload) == {"type", "error"}, payload
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert f"'{field}'" in payload["error"]["message"]
    assert standin.requests == []


async def test_gateway_and_upstream_failures_keep_anthropics_shape(make_standin, make_gateway):
    failing = await make_standin(fail="status", status=503)
    gw = await make_gateway(gateway_config(failing, retries=0))
    with pytest.raises(anthropic.APIStatusError) as e:      # the upstream's own, as it came
        await client_for(gw).messages.create(model="standin-model", max_tokens=8,
                                             messages=MESSAGES)
    assert e.value.status_code == 503 and e.value.body["type"] == "error"
    gone = await make_gateway({"upstreams": [{"name": "a", "url": f"http://127.0.0.1:{free_port()}"}],
                               "retries": 0})
    with pytest.raises(anthropic.APIStatusError) as e:      # the gateway's own: no connection
        await client_for(gone).messages.create(model="standin-model", max_tokens=8,
                                               messages=MESSAGES)
    assert e.value.status_code in (502, 503)
    assert e.value.body["error"]["type"] in ("api_error", "overloaded_error")
    async with aiohttp.ClientSession() as http:       # aiohttp's own 405, on this path
        async with http.get(gw.url + "/v1/messages") as r:
            payload = await r.json()
    assert r.status == 405 and payload["error"]["type"] == "invalid_request_error"


async def test_a_stream_cut_mid_way_ends_with_an_anthropic_error_event(
        make_standin, make_gateway):
    standin = await make_standin(tokens=8, gap=0.05, fail="reset_after", fail_after=3)
    gw = await make_gateway(gateway_config(standin))
    body = {"model": "standin-model", "max_tokens": 16, "stream": True, "messages": MESSAGES}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages", json=body) as r:
            raw = await r.read()
    last = sse.parse(sse.events_in([raw])[-1])
    assert last.event == "error"
    assert json.loads(last.data)["error"]["type"] == "api_error"


async def test_messages_listed_as_passthrough_is_served_as_its_own_endpoint(
        make_standin, make_gateway):
    standin = await make_standin(tokens=2)
    gw = await make_gateway(gateway_config(standin, passthrough=["/v1/messages",
                                                                  "/generate"]))
    message = await client_for(gw).messages.create(model="standin-model", max_tokens=8,
                                                   messages=MESSAGES)
    assert message.content[0].text
