"""Token-for-token agreement with transformers' greedy generation, through the real server.

Tiny random Llama and Qwen2 checkpoints are built here, served by our engine on loopback
ports and queried over HTTP; every generated token must equal what transformers' `generate`
produces for the same prompt: single requests (whole and streamed), concurrent mixed-length
batches with chunked prefill on and off, prefix-cache hits, and preemption under a tiny KV
budget. A client that hangs up must get its blocks freed.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from tests.engine.helpers import complete_ids, hf_greedy, load_hf, metrics, prompt_of
from tests.helpers import ServerThread, make_tiny_model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    model_dir = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)
    hf = load_hf(model_dir)
    refs = {}

    def ref(prompt, n):
        key = (tuple(prompt), n)
        if key not in refs:
            refs[key] = hf_greedy(hf, prompt, n)
        return refs[key]

    return SimpleNamespace(dir=str(model_dir), kind=request.param, ref=ref)


def _serve(model, *flags):
    return ServerThread(["--model", model.dir, "--dtype", "float32", "--block-size", "16", *flags])


@pytest.fixture(scope="module")
def chunked(model):
    # A small step budget, so prompts over 16 tokens really are split into chunks.
    with _serve(model, "--max-num-batched-tokens", "64") as s:
        yield s


@pytest.fixture(scope="module")
def whole(model):
    with _serve(model, "--max-num-batched-tokens", "64", "--no-chunked-prefill",
                "--no-prefix-caching") as s:
        yield s


@pytest.fixture(scope="module")
def tiny_kv(model):
    # 12 blocks of 16 tokens: four 80-token sequences cannot all hold their KV at once.
    with _serve(model, "--num-kv-blocks", "12", "--max-num-batched-tokens", "64") as s:
        yield s


async def test_single_request_matches_transformers(model, chunked):
    prompt = prompt_of(37, seed=1)
    expected = model.ref(prompt, 16)
    async with aiohttp.ClientSession() as session:
        whole_resp = await complete_ids(session, chunked.url, prompt, 16)
        streamed = await complete_ids(session, chunked.url, prompt, 16, stream=True)
    assert whole_resp["token_ids"] == expected
    assert streamed["token_ids"] == expected
    assert (whole_resp["usage"]["completion_tokens"] == 16
            and whole_resp["finish_reason"] == "length")
    assert streamed["usage"]["prompt_tokens"] == 37


@pytest.mark.parametrize("server", ["chunked", "whole"])
async def test_concurrent_mixed_lengths_match(model, server, request):
    url = request.getfixturevalue(server).url
    lengths, budgets = [3, 17, 33, 64, 100, 150], [16, 8, 12, 16, 5, 10]
    prompts = [prompt_of(n, seed=100 + n) for n in lengths]
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(complete_ids(session, url, p, m, stream=(i % 2 == 0))
                                         for i, (p, m) in enumerate(zip(prompts, budgets))))
    for p, m, r in zip(prompts, budgets, results):
        assert r["token_ids"] == model.ref(p, m), f"prompt of {len(p)} tokens diverged"


async def test_prefix_cache_hits_give_the_same_tokens(model, chunked):
    base = prompt_of(96, seed=7)
    variant = base[:80] + prompt_of(20, seed=8)          # shares 5 full blocks with base
    async with aiohttp.ClientSession() as session:
        before = await metrics(session, chunked.url)
        first = await complete_ids(session, chunked.url, base, 8)
        second = await complete_ids(session, chunked.url, variant, 8)
        after = await metrics(session, chunked.url)
    assert first["token_ids"] == model.ref(base, 8)
    assert second["token_ids"] == model.ref(variant, 8)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 80

    def grew(name):
        return after[name] - before[name]

    hits = grew("prefixgate:prefix_cache_hits_total")
    queries = grew("prefixgate:prefix_cache_queries_total")
    assert hits >= 80 and queries == 96 + 100


async def test_preemption_keeps_tokens_exact(model, tiny_kv):
    prompts = [prompt_of(40, seed=200 + i) for i in range(4)]
    async with aiohttp.ClientSession() as session:
        before = await metrics(session, tiny_kv.url)
        results = await asyncio.gather(*(complete_ids(session, tiny_kv.url, p, 40)
                                         for p in prompts))
        after = await metrics(session, tiny_kv.url)
    for p, r in zip(prompts, results):
        assert r["token_ids"] == model.ref(p, 40)
    assert after["prefixgate:num_preemptions_total"] > before["prefixgate:num_preemptions_total"]
    assert after["prefixgate:kv_cache_usage_perc"] == 0.0


async def test_client_disconnect_frees_blocks(model, chunked):
    body = {"prompt": prompt_of(50, seed=9), "max_tokens": 1000, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(chunked.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: ")
                if seen == 3:
                    break
            during = await metrics(session, chunked.url)
            r.connection.transport.abort()                # hang up mid-stream
        assert during["prefixgate:kv_cache_usage_perc"] > 0
        for _ in range(100):
            now = await metrics(session, chunked.url)
            if now["prefixgate:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.05)
    assert now["prefixgate:num_requests_running"] == 0
    assert now["prefixgate:kv_cache_usage_perc"] == 0.0
