"""The engine's OpenAI-compatible server as clients see it: the openai SDK (chat, streaming,
usage), text prompts, stop strings, seeds, errors in OpenAI's shape, /v1/models, /health and
the Prometheus names."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys

import aiohttp
import openai
import pytest
import torch

from prefixgate.common.procfs import held_by
from prefixgate.common.runtime import listening_socket, wait_ready
from prefixgate.common.tokenizer import Tokenizer
from tests.engine.helpers import complete_ids, hf_greedy, load_hf, metrics
from tests.helpers import ServerThread

MAX_LEN = 1024
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerThread(["--model", str(model_dir), "--max-model-len", str(MAX_LEN),
                       "--served-model-name", "tiny"]) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_ids(model_dir) -> list[int]:
    tok = Tokenizer.from_dir(model_dir)
    return tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True))


async def test_chat_completion_matches_transformers(client, model_dir):
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})
    ids = chat_prompt_ids(model_dir)
    expected = Tokenizer.from_dir(model_dir).decode(hf_greedy(load_hf(model_dir), ids, 12))
    assert resp.model == "tiny" and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "length"
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 12)


async def test_chat_stream_equals_whole_and_ends_with_usage(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(**kwargs, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


async def test_text_prompt_completion(client):
    resp = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 5
    assert isinstance(resp.choices[0].text, str)


async def test_stop_string_cuts_the_text(client):
    kwargs = dict(model="tiny", prompt="Hello there!", temperature=0,
                  extra_body={"ignore_eos": True})
    full = (await client.completions.create(**kwargs, max_tokens=30)).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    cut = full[:full.find(stop)]
    resp = await client.completions.create(**kwargs, max_tokens=30, stop=[stop])
    assert resp.choices[0].text == cut and resp.choices[0].finish_reason == "stop"
    streamed = await client.completions.create(**kwargs, max_tokens=30, stop=stop, stream=True)
    parts = [c async for c in streamed]
    assert "".join(c.choices[0].text for c in parts if c.choices) == cut
    assert [c.choices[0].finish_reason for c in parts if c.choices][-1] == "stop"


async def test_seed_makes_sampling_repeatable(client):
    async def draw(seed):
        r = await client.completions.create(model="tiny", prompt="Hello", max_tokens=16,
                                            temperature=1.0, seed=seed,
                                            extra_body={"ignore_eos": True})
        return r.choices[0].text

    first, again = await draw(42), await draw(42)
    assert first == again
    assert {await draw(s) for s in (1, 2, 3)} != {first}


async def test_models_and_health(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/health") as r:
            assert r.status == 200
        async with s.get(server.url + "/v1/models") as r:
            data = await r.json()
    assert data["data"][0]["id"] == "tiny" and data["data"][0]["max_model_len"] == MAX_LEN


async def post(url, data=None, json_body=None):
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=data, json=json_body) as r:
            return r.status, await r.json()


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", b"[1, 2]", "JSON object"),
    ("/v1/chat/completions", {"model": "tiny"}, "'messages'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "ten"}, "'max_tokens'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, "'temperature'"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, "'n'"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
    ("/v1/completions", {"prompt": []}, "'prompt'"),
    ("/v1/completions", {"prompt": [1, 99999]}, "99999"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "'stop'"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "'seed'"),
])
async def test_bad_requests_get_openai_errors(server, path, body, needle):
    raw = body if isinstance(body, bytes) else None
    status, data = await post(server.url + path, data=raw, json_body=None if raw else body)
    assert status == 400
    assert set(data["error"]) == {"message", "type", "code"}
    assert needle in data["error"]["message"]


async def test_prompt_longer_than_the_context_names_both_lengths(server):
    status, data = await post(server.url + "/v1/completions", json_body={"prompt": [5] * 1500})
    assert status == 400 and data["error"]["code"] == "context_length_exceeded"
    assert str(MAX_LEN) in data["error"]["message"] and "1500" in data["error"]["message"]


async def test_unknown_route_is_an_openai_404(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/nope") as r:
            assert r.status == 404
            assert "error" in await r.json()


async def test_a_request_that_does_not_parse_gets_a_json_400(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ?\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split()[1] == b"400" and json.loads(body)["error"]["code"] == "bad_request"


async def test_metrics_names_and_latency_histograms(server):
    async with aiohttp.ClientSession() as s:
        before = await metrics(s, server.url)
        await complete_ids(s, server.url, [5, 6, 7, 8], 4, stream=True)
        after = await metrics(s, server.url)
    for name in ("prefixgate:num_requests_running", "prefixgate:num_requests_waiting",
                 "prefixgate:kv_cache_usage_perc", "prefixgate:prefix_cache_queries_total",
                 "prefixgate:prefix_cache_hits_total", "prefixgate:num_preemptions_total"):
        assert name in after
    for hist in ("time_to_first_token_seconds", "request_queue_time_seconds"):
        key = f"prefixgate:{hist}_count"
        assert after[key] == before.get(key, 0) + 1
    key = "prefixgate:time_per_output_token_seconds_count"
    assert after[key] >= before.get(key, 0) + 3
    key = "prefixgate:prefix_cache_queries_total"
    assert after[key] == before[key] + 4


async def test_non_streaming_client_that_hangs_up_is_aborted(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 100_000, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(server.url + "/v1/completions", json=body,
                              timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        for _ in range(100):
            now = await metrics(s, server.url)
            if now["prefixgate:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.05)
    assert now["prefixgate:num_requests_running"] == 0
    assert now["prefixgate:kv_cache_usage_perc"] == 0.0


async def test_fp8_kv_cache_serves(model_dir):
    """An e4m3 KV cache (quantized on write) serves; rounding may change later greedy picks,
    so only the first token, computed from barely-rounded KV, must match transformers."""
    prompt = [5, 17, 33, 61, 90, 120, 150, 200]
    expected = hf_greedy(load_hf(model_dir), prompt, 4)
    with ServerThread(["--model", str(model_dir), "--kv-cache-dtype", "fp8"]) as fp8:
        async with aiohttp.ClientSession() as s:
            got = await complete_ids(s, fp8.url, prompt, 4)
        assert fp8.server.engine.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert len(got["token_ids"]) == 4 and got["token_ids"][0] == expected[0]


async def test_module_entry_point_serves_and_stops_on_sigterm(model_dir):
    """`python -m prefixgate.backend`, as the gateway's standalone mode launches it: on a
    listening socket handed down (--listen-fd), so its port is held from the moment it is
    chosen: no other process can take it, and a request sent at once waits in the backlog
    (answered, not refused)."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixgate.backend", "--model", str(model_dir),
        "--listen-fd", str(sock.fileno()), "--log-level", "warning", pass_fds=(sock.fileno(),),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    sock.close()                                # the child's alone now
    try:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", port))     # still starting, and the port is taken
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:     # sent before it serves
                assert r.status in (200, 503)           # 503: warming up
            await wait_ready(url, "/health", 60, proc)
            got = await complete_ids(s, url, [5, 6, 7], 3)
        assert len(got["token_ids"]) == 3
        assert held_by(proc.pid, port)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out.decode()
    assert f"at {url}" in out.decode()


@pytest.mark.parametrize("flags,needle", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--kv-cache-memory", "12XB"], "not a memory size"),
    (["--kv-cache-dtype", "int3"], "kv_cache_dtype"),
    (["--listen-fd", "987"], "--listen-fd 987: not an open socket"),
])
def test_cli_reports_bad_settings_without_a_traceback(model_dir, flags, needle, capsys):
    from prefixgate.backend.cli import main

    argv = ["--model", str(model_dir), *flags] if flags[0] != "--model" else flags
    assert main([*argv, "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
