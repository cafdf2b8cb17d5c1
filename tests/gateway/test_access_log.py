"""The access log: one line per request, written whole, with the TTFT taken apart."""
from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from prefixgate.common.schema import ConfigError
from prefixgate.proxy.config import gateway as config_mod
from prefixgate.proxy.observe.access_log import FIELDS
from tests.helpers import CHAT

KEY = "sk-test-secret-key-123"


async def read_lines(path, n: int, timeout: float = 5.0) -> list[dict]:
    """The file's first `n` JSON lines, once the writer thread has written them."""
    async with asyncio.timeout(timeout):
        while True:
            text = path.read_text() if path.exists() else ""
            if text.count("\n") >= n:
                return [json.loads(line) for line in text.splitlines()]
            await asyncio.sleep(0.02)


@pytest.fixture
async def logged(make_gateway, make_standin, tmp_path):
    up = await make_standin(tokens=4, gap=0.005, models=["standin-model"], prefix_cache=True)
    path = tmp_path / "access.log"
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "auth": {"api_keys": [{"key": KEY, "name": "web"}]},
                             "access_log": {"path": str(path)},
                             "plugins": [{"metrics": {}}]})
    return gw, up, path


def auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


async def test_lines_for_streamed_whole_404_401_and_upstream_error(logged):
    gw, up, path = logged
    async with aiohttp.ClientSession() as client:
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with client.post(gw.url + "/v1/chat/completions", json=body, headers={
                **auth(), "X-Request-Id": "streamed-1"}) as r:
            assert r.status == 200
            await r.read()
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT,
                               headers=auth()) as r:
            raw = await r.read()
            whole = json.loads(raw)
        async with client.post(gw.url + "/v1/chat/completions",
                               json={**CHAT, "model": "nope"}, headers=auth()) as r:
            assert r.status == 404
        async with client.post(gw.url + "/v1/chat/completions", json=CHAT,
                               headers=auth("sk-wrong-key-456")) as r:
            assert r.status == 401
        body = {**CHAT, "x_standin": {"fail": "status", "status": 400}}
        async with client.post(gw.url + "/v1/chat/completions", json=body,
                               headers=auth()) as r:
            assert r.status == 400
    streamed, plain, missing, denied, refused = await read_lines(path, 5)
    for line in (streamed, plain, missing, denied, refused):
        assert list(line) == list(FIELDS)      # every key, always, in order
        assert line["ts"].endswith("Z") and line["client"] == "127.0.0.1"
        assert line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert streamed["request_id"] == "streamed-1" and streamed["stream"] is True
    assert streamed["status"] == 200 and streamed["upstream"] == "a"
    assert streamed["key"] == "web" and streamed["attempts"] == 1
    assert streamed["model"] == "standin-model" and streamed["error"] is None
    # token counts from the stream's usage chunk (its last event); the same prompt again
    # (whole) is a prefix-cache hit upstream, which the log shows too
    assert streamed["completion_tokens"] == 4 and streamed["cached_tokens"] == 0
    assert streamed["prompt_tokens"] == whole["usage"]["prompt_tokens"] > 0
    assert streamed["bytes_out"] > 0 and streamed["duration_ms"] >= streamed["ttft_ms"] > 0
    parts = [streamed[k] for k in ("gateway_ms", "queue_ms", "connect_ms", "upstream_ttft_ms")]
    assert all(p >= 0 for p in parts)
    assert abs(sum(parts) - streamed["ttft_ms"]) < 0.01      # the breakdown adds up
    assert streamed["route"] == "round_robin"                # the default scorer
    # the whole answer: its usage, read from the body
    assert plain["stream"] is False and plain["status"] == 200
    assert plain["completion_tokens"] == whole["usage"]["completion_tokens"] == 4
    assert plain["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert plain["cached_tokens"] == whole["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert plain["bytes_out"] == len(raw)
    assert missing["status"] == 404 and "nope" in missing["error"]
    assert missing["upstream"] is None and missing["ttft_ms"] is None
    assert denied["status"] == 401 and denied["key"] is None and denied["error"]
    assert refused["status"] == 400 and refused["upstream"] == "a" and refused["error"]
    text = path.read_text()
    assert KEY not in text and "sk-wrong-key-456" not in text    # never a key


async def test_mid_stream_failure_and_unproxied_paths(logged):
    gw, up, path = logged
    async with aiohttp.ClientSession() as client:
        body = {**CHAT, "stream": True, "x_standin": {"fail": "reset_after", "fail_after": 2}}
        async with client.post(gw.url + "/v1/chat/completions", json=body,
                               headers=auth()) as r:
            await r.read()
        async with client.get(gw.url + "/health") as r:
            assert r.status == 200
        async with client.get(gw.url + "/no/such/path") as r:
            assert r.status == 404
    broken, health, unknown = await read_lines(path, 3)
    assert broken["status"] == 502 and "mid-stream" in broken["error"]
    assert broken["bytes_out"] > 0 and broken["ttft_ms"] > 0
    assert health["path"] == "/health" and health["status"] == 200
    assert unknown["path"] == "/no/such/path" and unknown["status"] == 404


async def test_text_format_is_one_nginx_like_line(make_gateway, standin, tmp_path):
    path = tmp_path / "access.log"
    gw = await make_gateway({"upstreams": [{"name": "a", "url": standin.url}],
                             "access_log": {"path": str(path), "format": "text"}})
    async with aiohttp.ClientSession() as client:
        async with client.post(gw.url + "/v1/chat/completions",
                               json={**CHAT, "stream": True}) as r:
            await r.read()
    async with asyncio.timeout(5):
        while not path.exists() or not path.read_text().endswith("\n"):
            await asyncio.sleep(0.02)
    line = path.read_text().splitlines()[0]
    assert line.startswith('127.0.0.1 - - [')
    assert '"POST /v1/chat/completions" 200 ' in line
    assert " model=standin-model " in line and " upstream=a " in line
    assert " ttft_ms=" in line and " upstream_ttft_ms=" in line


async def test_sigusr1_reopens_after_logrotate_moved_the_file(make_gateway, standin, tmp_path):
    path = tmp_path / "access.log"
    gw = await make_gateway({"upstreams": [{"name": "a", "url": standin.url}],
                             "access_log": {"path": str(path)}})
    async with aiohttp.ClientSession() as client:
        async def one(rid):
            async with client.post(gw.url + "/v1/chat/completions", json=CHAT,
                                   headers={"X-Request-Id": rid}) as r:
                await r.read()
        await one("before")
        await read_lines(path, 1)
        os.rename(path, tmp_path / "access.log.1")          # what logrotate does
        await one("moved")                                  # still goes to the moved file
        await read_lines(tmp_path / "access.log.1", 2)
        gw.gateway.observer.reopen()                        # what SIGUSR1 calls
        await one("after")
    assert [x["request_id"] for x in await read_lines(path, 1)] == ["after"]
    assert [x["request_id"] for x in await read_lines(tmp_path / "access.log.1", 2)] == [
        "before", "moved"]


async def test_lines_are_whole_under_concurrency(make_gateway, standin, tmp_path):
    path = tmp_path / "access.log"
    gw = await make_gateway({"upstreams": [{"name": "a", "url": standin.url,
                                            "max_inflight": 256}],
                             "access_log": {"path": str(path)}})
    async with aiohttp.ClientSession() as client:
        async def one(i):
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={**CHAT, "stream": i % 2 == 0},
                                   headers={"X-Request-Id": f"r{i}"}) as r:
                await r.read()
        await asyncio.gather(*(one(i) for i in range(200)))
    lines = await read_lines(path, 200)
    assert sorted(x["request_id"] for x in lines) == sorted(f"r{i}" for i in range(200))


def test_bad_access_log_config_names_the_key(tmp_path):
    base = {"upstreams": [{"name": "a", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(ConfigError, match=r"access_log\.format: must be one of json, text"):
        config_mod.validate({**base, "access_log": {"format": "xml"}})
    with pytest.raises(ConfigError, match=r"access_log\.path: folder .* does not exist"):
        config_mod.validate({**base, "access_log": {"path": str(tmp_path / "no" / "a.log")}})
    with pytest.raises(ConfigError, match=r"access_log\.colour: unknown key"):
        config_mod.validate({**base, "access_log": {"colour": True}})
    assert config_mod.validate({**base, "access_log": {}})["access_log"] == {
        "path": "-", "format": "json"}


async def test_a_request_the_router_refuses_logs_why(logged):
    gw, _, path = logged
    async with aiohttp.ClientSession() as client:
        async with client.get(gw.url + "/nope") as r:
            assert r.status == 404
        async with client.delete(gw.url + "/v1/chat/completions") as r:
            assert r.status == 405
    unknown, wrong_method = await read_lines(path, 2)
    assert unknown["status"] == 404 and unknown["error"] == "no route for GET /nope"
    assert wrong_method["status"] == 405
    assert wrong_method["error"] == "method DELETE not allowed on /v1/chat/completions"
