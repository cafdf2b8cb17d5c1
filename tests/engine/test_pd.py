"""The bundled engine split into prefill and decode instances: leg 1 to a
prefill engine with vLLM's `kv_transfer_params`, leg 2 to a decode engine that pulls the prompt's
KV over TCP and decodes. Real engines on loopback, a real HTTP client."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import torch

from prefixgate.backend import kv_transfer
from tests.engine.helpers import metrics
from tests.helpers import ServerThread, make_tiny_model

BLOCKS = "128"
LEG1_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
MESSAGES = [{"role": "system", "content": "You are brief and you answer in English."},
            {"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}]


def engine(model_dir, *flags):
    return ServerThread(["--model", str(model_dir), "--num-kv-blocks", BLOCKS, *flags])


@pytest.fixture(scope="module")
def prefill(model_dir):
    with engine(model_dir, "--role", "prefill") as s:
        yield s


@pytest.fixture(scope="module")
def decode(model_dir):
    with engine(model_dir, "--role", "decode") as s:
        yield s


@pytest.fixture(scope="module")
def single(model_dir):
    with engine(model_dir) as s:        # both roles: the one-engine reference
        yield s


def core(server: ServerThread):
    return server.server.engine.engine


def expire(server: ServerThread, transfer_id: str) -> None:
    """Free a hold now, as its timeout would (on the server's own loop)."""
    server._loop.call_soon_threadsafe(server.server.kv._expire, transfer_id)


def body_for(chat: bool, prompt, max_tokens=24, **extra) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    body["messages" if chat else "prompt"] = prompt
    return body


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def answer(s, url, chat, body) -> dict:
    """{'token_ids', 'text', 'usage', 'headers'} of a whole or streamed answer (status 200)."""
    async with s.post(url + path(chat), json=body) as r:
        assert r.status == 200, await r.text()
        headers = dict(r.headers)
        if not body.get("stream"):
            data = await r.json()
            c = data["choices"][0]
            return {"token_ids": c["token_ids"],
                    "text": c["message"]["content"] if chat else c["text"],
                    "usage": data["usage"], "headers": headers,
                    "kv": data.get("kv_transfer_params")}
        ids, text, usage = [], "", None
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                ids += c.get("token_ids", [])
                text += (c["delta"].get("content") or "") if chat else c["text"]
            usage = chunk.get("usage") or usage
        return {"token_ids": ids, "text": text, "usage": usage, "headers": headers}


async def leg1(s, url, chat, body) -> dict:
    """The prefill leg as the gateway sends it; the kv_transfer_params it returns."""
    got = await answer(s, url, chat, {**body, "stream": False, "max_tokens": 1,
                                      "kv_transfer_params": LEG1_PARAMS})
    assert len(got["token_ids"]) == 1
    return got["kv"]


async def pd(s, prefill_url, decode_url, chat, body) -> dict:
    params = await leg1(s, prefill_url, chat, body)
    got = await answer(s, decode_url, chat, {**body, "kv_transfer_params": params})
    assert got["headers"]["x-prefixgate-kv"] == "pulled"
    return got


async def settled(s, *servers) -> None:
    """Wait until no engine runs or holds anything, then check every block is free."""
    for _ in range(200):
        states = [await metrics(s, x.url) for x in servers]
        if all(m["prefixgate:num_requests_running"] == 0
               and m["prefixgate:kv_transfer_held_blocks"] == 0
               and m["prefixgate:kv_cache_usage_perc"] == 0 for m in states):
            break
        await asyncio.sleep(0.02)
    for x in servers:
        bm = core(x).block_manager
        assert bm.num_free_blocks == bm.num_blocks, x.argv
        assert core(x).scheduler.held == {}


def prompt_ids(n: int, start: int = 20) -> list[int]:
    return [(start + i * 7) % 360 + 10 for i in range(n)]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_pd_gives_the_tokens_of_one_engine(prefill, decode, single, chat, stream):
    prompt = MESSAGES if chat else prompt_ids(70, start=20 + 3 * stream)
    body = body_for(chat, prompt, stream=stream,
                    stream_options={"include_usage": True} if stream else None)
    async with aiohttp.ClientSession() as s:
        before = await metrics(s, decode.url)
        ref = await answer(s, single.url, chat, body)
        got = await pd(s, prefill.url, decode.url, chat, body)
        after = await metrics(s, decode.url)
        await settled(s, prefill, decode)
    assert got["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 24
    assert got["text"] == ref["text"]
    n = ref["usage"]["prompt_tokens"]
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == 24
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1    # not computed there
    pulls = "prefixgate:kv_transfers_pulled_total"
    assert after[pulls] == before[pulls] + 1
    assert "kv_pull;dur=" in got["headers"]["Server-Timing"]
    # one token computed, as a decode
    assert 'desc="computed=1 ' in got["headers"]["Server-Timing"]


async def test_leg1_answer_and_hold(prefill):
    """Leg 1 answers like vLLM's NixlConnector plus transfer_id/num_tokens, and holds the blocks."""
    prompt = prompt_ids(40, start=30)
    async with aiohttp.ClientSession() as s:
        params = await leg1(s, prefill.url, False, body_for(False, prompt))
        held = await metrics(s, prefill.url)
        assert (held["prefixgate:kv_transfer_held_blocks"] == 3
                and held["prefixgate:kv_cache_usage_perc"] > 0)
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == prefill.server.kv.engine_id
        assert (params["remote_host"] == "127.0.0.1"
                and params["remote_port"] == prefill.server.kv.port > 0)
        assert len(params["remote_block_ids"]) == 3 and params["num_tokens"] == 40
        assert params["transfer_id"].startswith("kvx-")
        hold = core(prefill).scheduler.held[params["transfer_id"]]
        assert hold.block_table == params["remote_block_ids"]
        expire(prefill, params["transfer_id"])
        await settled(s, prefill)


async def test_prefix_cached_on_either_side(prefill, decode, single):
    """A prompt partly cached on the prefill engine, then one partly cached on the decode
    engine (its own prefix cache learnt the pulled blocks): the same tokens as one engine,
    and the decode engine pulls only the blocks it lacks."""
    shared = prompt_ids(64, start=41)
    first, second = shared + prompt_ids(20, start=90), shared + prompt_ids(30, start=95)
    async with aiohttp.ClientSession() as s:
        for prompt in (first, second):
            body = body_for(False, prompt)
            before = {x: await metrics(s, x.url) for x in (prefill, decode)}
            ref = await answer(s, single.url, False, body)
            params = await leg1(s, prefill.url, False, body)
            got = await answer(s, decode.url, False, {**body, "kv_transfer_params": params})
            after = {x: await metrics(s, x.url) for x in (prefill, decode)}
            assert got["token_ids"] == ref["token_ids"]
            await settled(s, prefill, decode)
        hits = "prefixgate:prefix_cache_hits_total"
        assert after[prefill][hits] - before[prefill][hits] == 64       # the second prompt's leg 1
        assert after[decode][hits] - before[decode][hits] == 64         # ... and its leg 2
        pulled = (after[decode]["prefixgate:kv_transfer_received_bytes_total"]
                  - before[decode]["prefixgate:kv_transfer_received_bytes_total"])
        per_block = 2 * 2 * kv_transfer.block_bytes(core(decode))      # K and V, 2 layers
        assert pulled == 2 * per_block     # blocks 4 and 5 of 94 tokens; 0-3 were cached there
        # a plain request on the decode engine hits what the pull taught its prefix cache
        plain = await answer(s, decode.url, False, body_for(False, first, max_tokens=2))
        assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 80


async def test_other_family_and_fp8_kv_move_as_is(tmp_path_factory, prefill):
    """An e4m3 KV cache, and the Qwen2 family (biased q/k/v): the bytes move unconverted, so
    P/D decodes exactly what one engine with that cache decodes; engines whose caches differ
    refuse to pair."""
    qwen = make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")
    for flags in (["--kv-cache-dtype", "fp8"], []):
        model = prefill.argv[1] if flags else qwen
        with engine(model, *flags) as a, engine(model, *flags) as b:
            async with aiohttp.ClientSession() as s:
                for chat in (False, True):
                    body = body_for(chat, MESSAGES if chat else prompt_ids(50, start=60))
                    # one engine (and a's prefix cache), then leg 2 on a fresh engine: a full pull
                    ref = await answer(s, a.url, chat, body)
                    got = await pd(s, a.url, b.url, chat, body)
                    assert got["token_ids"] == ref["token_ids"]
                if flags:
                    assert core(b).runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
                    body = body_for(False, prompt_ids(30))
                    params = await leg1(s, prefill.url, False, body)      # the model's dtype
                    async with s.post(b.url + "/v1/completions",
                                      json={**body, "kv_transfer_params": params}) as r:
                        err = (await r.json())["error"]
                    assert r.status == 502 and err["code"] == "kv_layout_mismatch"
                    theirs = str(core(prefill).runner.kv_caches[0][0].dtype).removeprefix("torch.")
                    assert f"kv_dtype {theirs} here, float8_e4m3fn there" in err["message"]
                    expire(prefill, params["transfer_id"])
                await settled(s, a, b, prefill)


async def post_error(s, url, body, chat=False) -> tuple[int, dict]:
    async with s.post(url + path(chat), json=body) as r:
        return r.status, (await r.json())["error"]


async def test_prefill_engine_gone_or_expired(model_dir, decode):
    """Held blocks are freed after --kv-transfer-timeout; a pull of an expired handle, or from
    an engine that is gone, fails with a clear error and frees what the decode engine took."""
    body = body_for(False, prompt_ids(45, start=70))
    async with aiohttp.ClientSession() as s:
        with engine(model_dir, "--role", "prefill", "--kv-transfer-timeout", "0.3") as p:
            params = await leg1(s, p.url, False, body)
            assert (await metrics(s, p.url))["prefixgate:kv_transfer_held_blocks"] == 3
            await asyncio.sleep(0.4)
            await settled(s, p)
            assert (await metrics(s, p.url))["prefixgate:kv_transfer_expired_holds_total"] == 1
            status, err = await post_error(s, decode.url, {**body, "kv_transfer_params": params})
            assert (status == 502 and err["code"] == "kv_transfer_not_found"
                    and "expired" in err["message"])
            await settled(s, decode)
            params = await leg1(s, p.url, False, body)
        status, err = await post_error(s, decode.url,
                                       {**body, "stream": True, "kv_transfer_params": params})
        assert status == 502 and err["code"] == "kv_transfer_failed"
        assert f"127.0.0.1:{params['remote_port']}" in err["message"]
        await settled(s, decode)
        failures = (await metrics(s, decode.url))["prefixgate:kv_transfer_failures_total"]
        assert failures >= 2


async def test_prefill_engine_dies_mid_transfer(prefill, decode, monkeypatch):
    kv = prefill.server.kv

    async def die_after_one_layer(writer, hold, first):
        layer_bytes = 2 * (hold.num_blocks - first) * kv.block_bytes
        kv_transfer._write_json(writer, {"ok": True, "num_blocks": hold.num_blocks - first,
                                         "layer_bytes": layer_bytes})
        writer.write(kv_transfer.FRAME.pack(b"D", layer_bytes) + b"x" * 100)
        await writer.drain()
        writer.transport.abort()
        raise ConnectionResetError("killed")

    monkeypatch.setattr(kv, "_send_blocks", die_after_one_layer)
    body = body_for(False, prompt_ids(60, start=80))
    async with aiohttp.ClientSession() as s:
        params = await leg1(s, prefill.url, False, body)
        status, err = await post_error(s, decode.url, {**body, "kv_transfer_params": params})
        assert status == 502 and err["code"] == "kv_transfer_failed"
        await settled(s, prefill, decode)       # both sides freed their blocks


@pytest.mark.parametrize("params,field", [
    ("yes", "'kv_transfer_params'"),
    ({"do_remote_prefill": "true"}, "kv_transfer_params.do_remote_prefill"),
    ({"do_remote_prefill": True, "do_remote_decode": True}, "cannot both"),
    ({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
      "remote_engine_id": "e", "remote_block_ids": [0]}, "kv_transfer_params.transfer_id"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "127.0.0.1",
      "remote_port": "80", "remote_engine_id": "e", "remote_block_ids": [0]},
     "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_port": 80, "remote_engine_id": "e",
      "remote_block_ids": [0]}, "kv_transfer_params.remote_host"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 80,
      "remote_engine_id": "e", "remote_block_ids": None}, "kv_transfer_params.remote_block_ids"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_host": "h", "remote_port": 80,
      "remote_engine_id": "e", "remote_block_ids": [0], "num_tokens": 3}, "num_tokens"),
])
async def test_bad_kv_transfer_params_are_400(decode, params, field):
    async with aiohttp.ClientSession() as s:
        body = {**body_for(False, prompt_ids(20)), "kv_transfer_params": params}
        status, err = await post_error(s, decode.url, body)
        await settled(s, decode)
    assert status == 400 and field in err["message"], err


async def test_roles(prefill, decode, single):
    """Plain requests are unchanged on every role; a leg sent to the wrong role is a 400."""
    body = body_for(False, prompt_ids(33, start=100), max_tokens=8)
    async with aiohttp.ClientSession() as s:
        answers = [await answer(s, x.url, False, body) for x in (prefill, decode, single)]
        assert answers[0]["token_ids"] == answers[1]["token_ids"] == answers[2]["token_ids"]
        assert all("kv" not in a or a["kv"] is None for a in answers)
        assert all("x-prefixgate-kv" not in a["headers"] for a in answers)
        status, err = await post_error(s, decode.url, {**body, "kv_transfer_params": LEG1_PARAMS})
        assert status == 400 and err["code"] == "kv_role" and "role is decode" in err["message"]
        params = await leg1(s, prefill.url, False, body)
        status, err = await post_error(s, prefill.url, {**body, "kv_transfer_params": params})
        assert status == 400 and err["code"] == "kv_role" and "role is prefill" in err["message"]
        status, err = await post_error(s, prefill.url,
                                       {**body, "stream": True, "kv_transfer_params": LEG1_PARAMS})
        assert status == 400 and "'stream'" in err["message"]
        other = {**body, "prompt": prompt_ids(33, start=101)}       # the same length, other tokens
        status, err = await post_error(s, decode.url, {**other, "kv_transfer_params": params})
        assert status == 400 and err["code"] == "kv_prompt_mismatch"
        # the hold is still there
        got = await answer(s, decode.url, False, {**body, "kv_transfer_params": params})
        assert got["token_ids"] == answers[0]["token_ids"]
        await settled(s, prefill, decode)


async def test_client_gone_during_the_pull(prefill, decode, monkeypatch):
    """A leg-2 client that hangs up while the KV is on its way: both engines free the blocks."""
    kv = prefill.server.kv
    real = kv._send_blocks

    async def slow(writer, hold, first):
        await asyncio.sleep(0.5)
        return await real(writer, hold, first)

    monkeypatch.setattr(kv, "_send_blocks", slow)
    body = body_for(False, prompt_ids(50, start=110))
    async with aiohttp.ClientSession() as s:
        params = await leg1(s, prefill.url, False, body)
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(decode.url + "/v1/completions",
                              json={**body, "kv_transfer_params": params},
                              timeout=aiohttp.ClientTimeout(total=0.2)) as r:
                await r.read()
        await settled(s, prefill, decode)


def test_kv_transfer_benchmark_runs(model_dir, tmp_path, capsys):
    from prefixgate.backend.bench import kv_handover as bench_kv_transfer

    out = tmp_path / "kv.json"
    argv = ["--model", str(model_dir), "--prompt-tokens", "200", "--repeats", "1",
            "--num-kv-blocks", "64", "--kv-cache-dtype", "float32", "--out", str(out)]
    assert bench_kv_transfer.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["median"]["mb_per_s"] > 0 and data["kv_bytes"] == 13 * 2 * 2 * 2048
    assert "recompute / leg 2" in capsys.readouterr().out
