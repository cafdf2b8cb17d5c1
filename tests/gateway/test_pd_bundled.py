"""P/D through the real gateway with two bundled engines (`pd: {protocol: prefixgate}`): a
prefill engine and a decode engine give the tokens one engine gives; failures fall back or
fail clearly, and every block comes back on both engines."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from prefixgate.proxy.config import gateway as config_mod
from tests.helpers import ServerThread, make_tiny_model

BLOCKS = 128
SYSTEM = "You are brief and you answer in English. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def engine(model_dir, *flags):
    return ServerThread(["--model", str(model_dir), "--num-kv-blocks", str(BLOCKS), *flags])


@pytest.fixture(scope="module")
def pair(model_dir):
    with engine(model_dir, "--role", "prefill") as p, engine(model_dir, "--role", "decode") as d:
        yield p, d


@pytest.fixture(scope="module")
def single(model_dir):
    with engine(model_dir) as s:
        yield s


def free_blocks(server: ServerThread) -> int:
    return server.server.engine.engine.block_manager.num_free_blocks


async def settled(*servers, timeout=5.0):
    """Every block free again on each engine (holds released, sequences finished)."""
    async with asyncio.timeout(timeout):
        while any(free_blocks(s) != BLOCKS for s in servers):
            await asyncio.sleep(0.02)


def pd_gateway(prefill_url: str, decode_url: str, **extra) -> dict:
    return {"upstreams": [{"name": "p", "url": prefill_url, "role": "prefill"},
                          {"name": "d", "url": decode_url, "role": "decode"}],
            "pd": {"protocol": "prefixgate"}, "health": {"interval_s": 0},
            "plugins": [{"metrics": {}}], **extra}


def body(chat: bool, text: str, stream: bool) -> dict:
    b = {"model": None, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
         "stream": stream, "return_token_ids": True}
    if chat:
        b["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    else:
        b["prompt"] = SYSTEM + text
    return b


async def token_ids(client, url: str, b: dict) -> tuple[list[int], dict]:
    path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
    async with client.post(url + path, json=b) as r:
        assert r.status == 200, await r.text()
        if not b["stream"]:
            answer = await r.json()
            return answer["choices"][0]["token_ids"], dict(r.headers)
        ids = []
        async for line in r.content:
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids") or []
        return ids, dict(r.headers)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_prefill_and_a_decode_engine_give_the_tokens_of_one(
        pair, single, make_gateway, chat, stream, model_dir):
    prefill, decode = pair
    gw = await make_gateway(pd_gateway(prefill.url, decode.url))
    name = model_dir.name
    async with aiohttp.ClientSession() as client:
        for text in ("Tell me about the fox.", "Tell me about the dog."):   # 2nd: prefix cached
            b = {**body(chat, text, stream), "model": name}
            expected, _ = await token_ids(client, single.url, b)
            got, headers = await token_ids(client, gw.url, b)
            assert got == expected and len(got) == 16
            assert headers["x-prefixgate-pd"] == "prefixgate"
            assert headers["x-prefixgate-prefill-upstream"] == "p"
            assert headers["x-prefixgate-upstream"] == "d"
            assert headers["x-prefixgate-kv"] == "pulled"
    await settled(prefill, decode)


async def test_a_prefill_engine_that_is_down_falls_back_to_the_decode_engine(
        pair, single, make_gateway, model_dir):
    _, decode = pair
    gw = await make_gateway(pd_gateway("http://127.0.0.1:9", decode.url))
    b = {**body(True, "Tell me about the cat.", False), "model": model_dir.name}
    async with aiohttp.ClientSession() as client:
        expected, _ = await token_ids(client, single.url, b)
        got, headers = await token_ids(client, gw.url, b)
    assert got == expected
    assert headers["x-prefixgate-pd"] == "fallback" and "x-prefixgate-kv" not in headers
    await settled(decode)


async def test_an_expired_transfer_is_a_clear_error_and_frees_every_block(model_dir,
                                                                          make_gateway):
    """The prefill engine drops its hold before the pull (a transfer timeout shorter than
    the hand-over): the decode engine says why before any byte, the gateway tries a fresh
    prefill, then answers with a clear error; no block is lost on either engine."""
    with engine(model_dir, "--role", "prefill", "--kv-transfer-timeout", "0.001") as p, \
            engine(model_dir, "--role", "decode") as d:
        gw = await make_gateway(pd_gateway(p.url, d.url))
        b = {**body(True, "Tell me about the owl.", True), "model": model_dir.name}
        async with aiohttp.ClientSession() as client:
            async with client.post(gw.url + "/v1/chat/completions", json=b) as r:
                answer = await r.json()
        assert r.status == 502, answer        # the decode engine's own error, relayed
        assert answer["error"]["code"] == "kv_transfer_not_found"
        assert "expired" in answer["error"]["message"]
        await settled(p, d)


def test_bundled_prefill_and_decode_become_a_pd_fleet():
    cfg = config_mod.validate({"bundled": {"prefill": 1, "decode": 2}})
    assert cfg["bundled"]["roles"] == ["prefill", "decode", "decode"]
    assert cfg["bundled"]["instances"] == 3 and cfg["pd"] == {"protocol": "prefixgate"}
    from prefixgate.proxy.bundled import BundledEngines
    ups = BundledEngines(cfg["bundled"]).upstream_configs(cfg["timeouts"])
    assert [(u["name"], u["role"]) for u in ups] == [("prefill0", "prefill"),
                                                      ("decode1", "decode"), ("decode2", "decode")]
    with pytest.raises(config_mod.ConfigError, match="bundled: prefill and decode go together"):
        config_mod.validate({"bundled": {"prefill": 1}})
    assert config_mod.validate({"bundled": {}})["pd"] is None
