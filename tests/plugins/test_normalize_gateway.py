"""normalize through the real gateway to a recording stand-in upstream."""
from __future__ import annotations

import json

import aiohttp
import openai
import yaml

from prefixgate.plugins.normalize.plugin import CLOSE, OPEN
from tests.helpers import DATA

CORPUS = yaml.safe_load((DATA / "prompts.yaml").read_text("utf-8"))
DYN = {e["id"]: e for e in CORPUS["dynamic"]}


def chat(system: str, user: str = "hi", **extra) -> dict:
    return {"model": "standin-model", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}], **extra}


async def _setup(make_standin, make_gateway, **cfg):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"normalize": cfg}]})
    return up, gw


async def _post(client, gw, body, headers=None):
    async with client.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status, r.headers


async def test_dynamic_values_reach_the_upstream_at_the_tail(make_standin, make_gateway):
    up, gw = await _setup(make_standin, make_gateway)
    e = DYN["zh-today-and-session"]
    other = e["text"]
    for v, alt in zip(e["values"], e["alt"]):
        other = other.replace(v, alt)
    async with aiohttp.ClientSession() as client:
        for text in (e["text"], other):
            status, headers = await _post(client, gw, chat(text, stream=True))
            assert status == 200 and headers["x-prefixgate-moved"] == "2"
    a, b = (r["json"]["messages"] for r in up.requests)
    assert a[0] == b[0]                                     # system prompt: identical
    assert a[1]["content"].split(OPEN)[0] == b[1]["content"].split(OPEN)[0] == "hi\n\n"
    sent = json.dumps(a, ensure_ascii=False)
    for v in e["values"]:
        assert sent.count(v) == 1 and v in a[1]["content"]
    assert a[1]["content"].endswith(CLOSE)


async def test_static_prompt_and_opt_out_pass_unchanged(make_standin, make_gateway):
    up, gw = await _setup(make_standin, make_gateway)
    static = chat(CORPUS["static"][0]["text"])
    dynamic = chat(DYN["en-current-time-line"]["text"])
    async with aiohttp.ClientSession() as client:
        status, headers = await _post(client, gw, static)
        assert status == 200 and headers["x-prefixgate-moved"] == "0"
        status, headers = await _post(client, gw, dynamic, {"X-Prefixgate-Normalize": "off"})
        assert status == 200 and "x-prefixgate-moved" not in headers
    assert up.requests[0]["json"] == static
    assert up.requests[1]["json"] == dynamic


async def test_learned_after_a_few_varying_requests(make_standin, make_gateway):
    up, gw = await _setup(make_standin, make_gateway, learn_after=3)
    template = "You are the assistant of shop 88 for order {} (policy v1.2). Be polite."
    async with aiohttp.ClientSession() as client:
        moved = [(await _post(client, gw, chat(template.format(f"A{n}7"))))[1]
                 ["x-prefixgate-moved"] for n in (101, 202, 303, 404)]
        metrics = await (await client.get(gw.url + "/metrics")).text()
    assert moved == ["0", "0", "1", "1"]
    systems = [r["json"]["messages"][0]["content"] for r in up.requests]
    assert systems[2] == systems[3] == ("You are the assistant of shop 88 for order ⟨1⟩ "
                                        "(policy v1.2). Be polite.")
    assert 'prefixgate_normalize_moved_values_total{type="learned"} 2.0' in metrics
    assert 'prefixgate_normalize_requests_total{result="unchanged"} 2.0' in metrics


async def test_openai_sdk_sees_the_moved_header(make_standin, make_gateway):
    up, gw = await _setup(make_standin, make_gateway, move_to="system_tail")
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    raw = await client.chat.completions.with_raw_response.create(
        model="standin-model", messages=chat(DYN["en-many-fields"]["text"])["messages"])
    assert raw.headers["x-prefixgate-moved"] == "3"
    assert raw.parse().choices[0].message.content
    msgs = up.requests[0]["json"]["messages"]
    assert msgs[-1]["role"] == "system" and msgs[-1]["content"].startswith(OPEN)
    assert msgs[1] == {"role": "user", "content": "hi"}
    await client.close()


async def test_canonical_tools_serialise_equal_tool_sets_equally(make_standin, make_gateway):
    up, gw = await _setup(make_standin, make_gateway, canonical_tools=True)
    a = {"type": "function", "function": {"name": "a_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}
    b = {"function": {"parameters": {"properties": {"q": {"type": "string"}}, "type": "object"},
                      "name": "b_search"}, "type": "function"}
    b_again = {"type": "function", "function": {"name": "b_search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}
    async with aiohttp.ClientSession() as client:
        await _post(client, gw, chat("Be brief.", tools=[a, b]))
        await _post(client, gw, chat("Be brief.", tools=[b_again, a]))
    sent = [json.dumps(r["json"]["tools"]) for r in up.requests]
    assert sent[0] == sent[1]
    tools = up.requests[0]["json"]["tools"]
    assert [t["function"]["name"] for t in tools] == ["a_time", "b_search"]
