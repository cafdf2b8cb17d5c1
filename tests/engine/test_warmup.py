"""Warm-up before ready: `/health` is 503 and generation is refused with an
OpenAI-shaped 503 until the warm-up has run; afterwards nothing of it shows (counters, metrics,
prefix cache, KV blocks, the speculator's step-cost fit); `--skip-server-warmup` serves at once;
`prefixgate serve` says it listens only after its bundled engine has warmed up.

How the warm-up window is observed without a race: the server is started in this event loop
with `start_server(..., wait_for_warmup=False)`, which returns as soon as it listens. Its
status turns "ok" only when this same loop handles the end of the warm-up, which runs on the
engine's thread and, with the demo model and a 2,048-token budget (a deliberately long chunk),
takes over a second on CPU; the probes are sent at once, each a loopback round trip of about
a millisecond served by this loop, so they are answered long before that end is, however
loaded the machine (a loaded machine slows the warm-up as much). The test ends by checking
that the status was still "warming up" after the last probe.
"""
from __future__ import annotations

import json
import re

import aiohttp
import openai
import pytest

from prefixgate.backend import warmup
from prefixgate.backend.cli import parse_args
from prefixgate.backend.server import start_server
from tests.engine.helpers import metrics
from tests.helpers import Serving, assert_openai_error, make_tiny_model

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
ZEROED = ("prefixgate:prefix_cache_queries_total", "prefixgate:prefix_cache_hits_total",
          "prefixgate:num_preemptions_total", "prefixgate:time_to_first_token_seconds_count",
          "prefixgate:request_queue_time_seconds_count", "prefixgate:num_requests_running",
          "prefixgate:num_requests_waiting", "prefixgate:kv_cache_usage_perc",
          "prefixgate:spec_decode_num_drafts_total")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("warm") / "llama", "llama")


async def completion(session, url, prompt, max_tokens=1):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, r.headers, await r.json()


def warmup_chunk_prompt(server) -> list[int]:
    """The token ids of the warm-up's long prompt (its prefix and chunk)."""
    report, core = server.engine.warmup_report, server.engine.engine
    return warmup._prompt(core, 0, report.prefix_tokens + report.chunk_tokens)


async def test_health_and_generation_answer_503_until_the_warmup_has_run():
    # the SDK client is made first (tens of ms), so the window holds nothing but the probes
    client = openai.AsyncOpenAI(base_url="http://unset", api_key="none", max_retries=0)
    server = await start_server(parse_args(["--model", "demo", "--max-num-batched-tokens", "2048"]),
                                host="127.0.0.1", port=0, wait_for_warmup=False)
    client = client.with_options(base_url=server.url + "/v1")
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert (r.status, await r.json()) == (503, {"status": "warming up"})
            status, headers, body = await completion(s, server.url, [20, 21, 22])
            assert_openai_error(body, 503, status)
            assert body["error"]["code"] == "warming_up" and headers["Retry-After"] == "1"
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model="demo", max_tokens=2,
                                                     messages=[{"role": "user", "content": "hi"}])
            assert refused.value.status_code == 503
            async with s.get(server.url + "/v1/models") as r:     # needs no engine step: served
                assert r.status == 200
            assert server.engine.status == "warming up"           # all of that was in the window

            await server.engine.wait_ready()
            async with s.get(server.url + "/health") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok"})
            report = server.engine.warmup_report
            assert (report.batch_sizes == [1, 64]
                    and (report.chunk_tokens, report.prefix_tokens) == (2048, 64))
            chat = await client.chat.completions.create(
                model="demo", max_tokens=2, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "hi"}])
            assert chat.usage.completion_tokens == 2
            await client.close()
    finally:
        await server.close()


async def test_the_warmup_leaves_no_trace(model_dir):
    """Counters, metrics, KV blocks and prefix cache as at start; the speculator has no step-cost
    sample. A KV cache of 8 blocks is too small for 16 warm-up sequences: that size is skipped."""
    server = await start_server(parse_args(["--model", str(model_dir), "--num-kv-blocks", "8",
                                            "--max-num-seqs", "16", "--speculative-config", SPEC]),
                                host="127.0.0.1", port=0)
    try:
        report, core = server.engine.warmup_report, server.engine.engine
        assert report.batch_sizes == [1] and report.chunk_tokens > 0
        bm = core.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.cached == {}
        assert core.speculator.cost.sums == [0.0] * 5 and core.speculator.num_drafts == 0
        async with aiohttp.ClientSession() as s:
            before = await metrics(s, server.url)
            assert {name: before[name] for name in ZEROED} == dict.fromkeys(ZEROED, 0.0)
            prompt = warmup_chunk_prompt(server)
            full_blocks = (len(prompt) - 1) // 16 * 16      # what a prefix hit can serve
            for cached in (0, full_blocks):  # not cached by the warm-up; cached by a real request
                status, _, body = await completion(s, server.url, prompt)
                assert status == 200, body
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
            after = await metrics(s, server.url)
        assert after["prefixgate:prefix_cache_queries_total"] == 2 * len(prompt)
        assert after["prefixgate:prefix_cache_hits_total"] == full_blocks
        assert after["prefixgate:time_to_first_token_seconds_count"] == 2
    finally:
        await server.close()


async def test_skip_server_warmup_is_ready_at_once(model_dir):
    server = await start_server(parse_args(["--model", str(model_dir), "--skip-server-warmup"]),
                                host="127.0.0.1", port=0, wait_for_warmup=False)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok"})
            status, _, body = await completion(s, server.url, [20, 21, 22], max_tokens=2)
        assert status == 200 and body["usage"]["completion_tokens"] == 2
        assert server.engine.warmup_report is None
    finally:
        await server.close()


async def test_serve_says_it_listens_only_after_its_bundled_engine_warmed_up(model_dir, tmp_path):
    """`prefixgate serve` polls its engine's /health, which says 503 until the warm-up has run:
    the engine logs the warm-up before its /health can say 200, so that line comes first. The
    engine also gets `bundled.load_format`."""
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"listen": {"host": "127.0.0.1", "port": 0},
                               "bundled": {"model": str(model_dir), "load_format": "eager"}}))
    async with Serving("--config", str(cfg), timeout=60) as gw:
        lines = "".join(gw.output).splitlines()
        at = {key: next(i for i, line in enumerate(lines) if key in line)
              for key in ("(weights: eager)", "warm-up took", "gateway listening")}
        assert at["(weights: eager)"] < at["warm-up took"] < at["gateway listening"], lines
        engine_url = re.search(r"engine0=(http://\S+)", gw.line).group(1)
        async with aiohttp.ClientSession() as s:
            async with s.get(engine_url + "/health") as r:
                assert r.status == 200
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
        chat = await client.chat.completions.create(model=model_dir.name, max_tokens=3,
                                                    temperature=0,
                                                    extra_body={"ignore_eos": True},
                                                    messages=[{"role": "user", "content": "hello"}])
        assert chat.usage.completion_tokens == 3
        await client.close()
