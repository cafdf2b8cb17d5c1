"""What the gateway learns from real vLLM and sends it: load polled from vLLM's own /metrics
(num_requests_running/waiting) steering requests away from a busy server, and normalize +
prerender + `forward: tokens` (the prompt as token ids, rendered and tokenized by the gateway)
accepted by vLLM, which then reports the prefix it found cached."""
from __future__ import annotations

import json
import random
import time

import aiohttp
import pytest

from prefixgate.plugins.prefix_route.plugin import PrefixRoute
from prefixgate.proxy.testing.real_vllm import BLOCK_SIZE
from prefixgate.proxy.testing.vllm_install import prepare_model
from tests.vllm.conftest import SERVED_NAME
from tests.vllm.helpers import CHAT, QUESTION, send, upstreams, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def poller_of(gw):
    return next(p for _, p in gw.gateway.plugin_keys if isinstance(p, PrefixRoute)).poller


def sampled_since(poller, since: float, **running: int):
    """Has a sample taken after `since` found each named upstream running that many?"""
    def sampled() -> bool:
        return all((s := poller.samples.get(name)) is not None and s.t > since
                   and s.running == n for name, n in running.items())
    return sampled


def ages(poller) -> dict:
    return {name: (s.running, s.waiting, round(time.monotonic() - s.t, 2))
            for name, s in poller.samples.items()}


async def test_load_is_polled_from_vllm_metrics(vllm_pair, make_gateway):
    # least_inflight decides; prefix_route only polls (its own say made negligible)
    gw = await make_gateway({"upstreams": upstreams(vllm_pair, max_inflight=4), "plugins": [
        {"prefix_route": {"poll_metrics_s": 0.5, "weight": 0.001}}, {"least_inflight": {}}]})
    poller = poller_of(gw)
    busy = {"model": SERVED_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as client:
        # a long generation straight to vllm0: only vLLM's metrics can tell the gateway
        async with client.post(vllm_pair[0].url + "/v1/completions", json=busy) as long_run:
            await long_run.content.readline()
            await wait_for(lambda: "vllm0" in poller.samples and
                           poller.samples["vllm0"].running == 1, what="vllm0 running 1")
            assert poller.samples["vllm1"].running == poller.samples["vllm1"].waiting == 0
            assert gw.gateway.upstreams[0].load == 1
            for _ in range(3):
                # vLLM's gauges come from its last step, and a starved CPU server may answer
                # no poll for a while: route each request on samples of both servers taken
                # after the last one ended
                await wait_for(sampled_since(poller, time.monotonic(), vllm0=1, vllm1=0),
                               timeout=60, what="fresh samples of both servers")
                at_send = ages(poller)
                answer = await send(client, gw.url, "/v1/chat/completions",
                                    {**CHAT, "max_tokens": 1})
                assert answer.status == 200
                assert answer.headers["x-prefixgate-upstream"] == "vllm1", (at_send,
                                                                             ages(poller))
        # the client went away: vLLM aborts the generation, and its metrics say so
        await wait_for(sampled_since(poller, time.monotonic(), vllm0=0), what="vllm0 idle")


def system_prompt(now: str) -> str:
    """A long system prompt that opens with the current time (so its every block would
    differ from one request to the next, but for normalize)."""
    rng = random.Random("normalize")
    rules = " ".join(f"Rule {i}: {rng.choice(['be brief', 'cite sources', 'stay kind'])}."
                     for i in range(80))
    return f"Current time: {now}\nYou are the assistant of the prompt-path test. {rules}"


async def test_normalized_prerendered_token_ids_hit_vllm_prefix_cache(vllm_pair,
                                                                     make_gateway):
    gw = await make_gateway({
        "upstreams": [{"name": "vllm0", "url": vllm_pair[0].url, "forward": "tokens"}],
        "model": {"tokenizer": str(prepare_model())},
        "plugins": [{"normalize": {}}, {"prerender": {"block_tokens": BLOCK_SIZE}}]})
    async with aiohttp.ClientSession() as client:
        # the same chat both ways: vLLM renders it, or gets the gateway's token ids
        direct = json.loads((await send(client, vllm_pair[0].url, "/v1/chat/completions",
                                        CHAT)).raw)
        proxied = json.loads((await send(client, gw.url, "/v1/chat/completions", CHAT)).raw)
        assert proxied["object"] == "chat.completion"
        assert "refusal" not in proxied["choices"][0]["message"]    # /v1/completions answered
        assert proxied["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert proxied["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        usages = []
        for now in ("2026-12-03 10:00:00", "2026-12-03 10:05:07"):
            chat = {**CHAT, "messages": [{"role": "system", "content": system_prompt(now)},
                                         *QUESTION]}
            answer = await send(client, gw.url, "/v1/chat/completions", chat)
            assert answer.status == 200, answer.raw
            usages.append(json.loads(answer.raw)["usage"])
        # vLLM itself, asked with the time at the head, finds nothing of it cached
        raw_chat = {**chat, "messages": [{"role": "system",
                                          "content": system_prompt("2026-12-03 10:09:59")},
                                         *QUESTION]}
        unnormalized = json.loads((await send(client, vllm_pair[0].url,
                                              "/v1/chat/completions", raw_chat)).raw)
        streamed = await send(client, gw.url, "/v1/chat/completions", {**chat, "stream": True})
    assert usages[1]["prompt_tokens"] > 3 * BLOCK_SIZE
    cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= usages[1]["prompt_tokens"] - 2 * BLOCK_SIZE and cached % BLOCK_SIZE == 0
    assert unnormalized["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    events = [json.loads(e[6:]) for e in streamed.raw.split(b"\n\n")[:-2]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert streamed.raw.endswith(b"data: [DONE]\n\n")
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

