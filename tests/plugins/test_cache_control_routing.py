"""prefix_route with tenants and cache breakpoints: salted prefix keys (two tenants' equal
prompts are two prefixes, as the engine holds them under their cache_salt; the KV-event index
keys the engine's salted blocks the same way) and `cache_control` as the affinity key of a
request that names no session (sessions.py). Real gateways on loopback over stand-ins;
clients: the anthropic and openai SDKs and aiohttp."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import anthropic
import msgpack
import openai
import pytest

from prefixgate.common.block_hash import block_hash_chain, salted_root
from prefixgate.common.schema import check
from prefixgate.plugins.prefix_route.keys import PrefixKeys
from prefixgate.plugins.prefix_route.kv_index import KVEventIndex, decode_batch
from prefixgate.plugins.prefix_route.plugin import SPEC
from prefixgate.proxy.context import RequestContext

MODEL = "standin-model"
KEYS = {"a": "sk-tenant-a-000001", "b": "sk-tenant-b-000002"}
SYSTEM = "You are a coding agent in a large repository; follow the house rules. " * 8


def config(standins, cache="per_key", **prefix_route) -> dict:
    return {"upstreams": [{"name": f"u{i}", "url": s.url} for i, s in enumerate(standins)],
            "auth": {"api_keys": list(KEYS.values())}, "isolation": {"cache": cache},
            "plugins": [{"prefix_route": prefix_route}]}


async def post(client, gw, key: str, body: dict, path="/v1/chat/completions") -> tuple[str, str]:
    """(upstream, route header) of one request."""
    async with client.post(gw.url + path, json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers["x-prefixgate-upstream"], r.headers["x-prefixgate-route"]


def field(route: str, name: str) -> str | None:
    m = re.search(rf"{name}=([\w.:-]+)", route)
    return m and m.group(1)


def ask(question: str) -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}


# --- salted keys --------------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["per_key", "shared"])
async def test_two_tenants_equal_prompts_are_two_prefixes_under_per_key(make_standin,
                                                                        make_gateway, cache):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    aware = await make_gateway(config(standins, cache, policy="cache_aware"))
    ring = await make_gateway(config(standins, cache, policy="chwbl"))
    async with aiohttp.ClientSession() as client:
        await post(client, aware, KEYS["a"], ask("the same question"))
        _, again = await post(client, aware, KEYS["a"], ask("the same question"))
        _, other = await post(client, aware, KEYS["b"], ask("the same question"))
        chwbl = {t: field((await post(client, ring, k, ask("q")))[1], "key")
                 for t, k in KEYS.items()}
    assert field(again, "outcome") == "cache"              # a's own prefix: found
    if cache == "shared":                                   # one cache: b finds a's prefix
        assert field(other, "outcome") == "cache" and chwbl["a"] == chwbl["b"]
    else:                                                   # b's prefix is its own
        assert field(other, "outcome") != "cache" and field(other, "blocks") != "0"
        assert chwbl["a"] != chwbl["b"]


def keys_of(tokens, salt):
    ctx = RequestContext(request_id="", path="/v1/completions", body={"prompt": tokens},
                         headers={}, tokens=tokens, cache_salt=salt)
    return PrefixKeys(check({"block_tokens": 4}, SPEC)).of(ctx).chain


def test_salted_token_keys_are_the_engines_salted_blocks_in_the_kv_event_index():
    tokens = list(range(200, 224))          # 6 gateway blocks, 3 engine blocks of 8
    assert keys_of(tokens, "t-a") == block_hash_chain(tokens, 4, parent=salted_root("t-a"))
    stored = [{"type": "BlockStored", "block_hashes": [b"e1", b"e2", b"e3"],
               "parent_block_hash": None, "token_ids": tokens, "block_size": 8,
               "lora_id": None, "medium": "GPU", "lora_name": None,
               "extra_keys": [["t-a"], None, None], "group_idx": 0,
               "kv_cache_spec_kind": "full_attention"}]        # vLLM 0.32's salted first block
    index = KVEventIndex(4, capacity=100)
    index.apply("e", decode_batch(msgpack.packb([1.0, stored, 0])))
    assert index.match(keys_of(tokens, "t-a")) == {"e": 6}
    assert index.match(keys_of(tokens, "t-b")) == {} and index.match(keys_of(tokens, None)) == {}


# --- cache_control affinity ---------------------------------------------------------------------
def turn_of(history: list, conv: int, n: int) -> list:
    """The conversation after turn n's question, Claude Code's way: the newest message's last
    block marked, earlier marks moved off (the system block's stays)."""
    history = [{**m, "content": [{k: v for k, v in b.items() if k != "cache_control"}
                                 for b in m["content"]]} for m in history]
    if n:
        history.append({"role": "assistant", "content": [{"type": "text",
                                                          "text": f"answer {n}"}]})
    text = f"question {n}" if n else f"conversation {conv}: fix the build"
    history.append({"role": "user", "content": [
        {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]})
    return history


async def test_a_marked_conversation_stays_on_one_upstream_across_turns_and_replicas(
        make_standin, make_gateway, tmp_path):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    log = tmp_path / "access.log"
    replicas = [await make_gateway({**config(standins, policy=p),
                                    "access_log": {"path": str(log)}})
                for p in ("chwbl", "cache_aware")]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral",
                                                                 "ttl": "1h"}}]
    homes: dict[int, set] = {}
    routes = []
    for conv in range(8):          # one system prompt: only the conversation tells them apart
        history: list = []
        for n in range(4):
            gw = replicas[(conv + n) % 2]                  # each turn: the other replica
            sdk = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["a"], max_retries=0)
            history = turn_of(history, conv, n)
            raw = await sdk.messages.with_raw_response.create(
                model=MODEL, max_tokens=1, system=system, messages=history,
                extra_body={"temperature": 0})
            homes.setdefault(conv, set()).add(raw.headers["x-prefixgate-upstream"])
            routes.append(raw.headers["x-prefixgate-route"])
    assert all(len(ups) == 1 for ups in homes.values()), homes
    assert len({u for ups in homes.values() for u in ups}) >= 2, homes     # and spread
    assert all(field(r, "session_key").startswith("cache_control:") for r in routes), routes
    for _ in range(200):        # the access log's `route` names the source too
        logged = [json.loads(line)["route"] for line in log.read_text().splitlines()] \
            if log.exists() else []
        if len(logged) >= len(routes):
            break
        await asyncio.sleep(0.02)
    assert sorted(r for r in logged if r) == sorted(routes)


async def test_chat_content_marks_and_the_sdks_request_level_mark(make_standin, make_gateway):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    gw = await make_gateway(config(standins))
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["a"], max_retries=0)
    an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["a"], max_retries=0)
    chat_homes, auto_homes, keys = {}, {}, set()
    for conv in range(6):
        messages = [{"role": "system", "content": SYSTEM}]
        for n in range(3):
            messages = [{**m, "content": [{"type": "text", "text": p["text"]} for p in
                                          m["content"]]} if isinstance(m["content"], list)
                        else m for m in messages]
            messages.append({"role": "user", "content": [{"type": "text", "text":
                             f"conv {conv} turn {n}", "cache_control": {"type": "ephemeral"}}]})
            raw = await oa.chat.completions.with_raw_response.create(
                model=MODEL, max_tokens=1, messages=messages)
            chat_homes.setdefault(conv, set()).add(raw.headers["x-prefixgate-upstream"])
            keys.add(field(raw.headers["x-prefixgate-route"], "session_key").split(":")[0])
            messages.append({"role": "assistant", "content": "ok"})
            auto = await an.messages.with_raw_response.create(         # automatic caching
                model=MODEL, max_tokens=1, system=SYSTEM, cache_control={"type": "ephemeral"},
                messages=[{"role": "user", "content": f"conv {conv}"},
                          *[{"role": r, "content": f"{r} {i}"} for i in range(n)
                            for r in ("assistant", "user")]])
            auto_homes.setdefault(conv, set()).add(auto.headers["x-prefixgate-upstream"])
            keys.add(field(auto.headers["x-prefixgate-route"], "session_key").split(":")[0])
    assert keys == {"cache_control"}
    for homes in (chat_homes, auto_homes):
        assert all(len(ups) == 1 for ups in homes.values()), homes
        assert len({u for ups in homes.values() for u in ups}) >= 2, homes


async def test_the_marked_key_is_salted_per_tenant_and_a_named_key_comes_first(make_standin,
                                                                              make_gateway):
    standins = [await make_standin(tokens=1) for _ in range(3)]
    gw = await make_gateway(config(standins))
    marked = {"model": MODEL, "max_tokens": 1, "system": [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession() as client:
        shown = {t: field((await post(client, gw, k, marked, "/v1/messages"))[1], "session_key")
                 for t, k in KEYS.items()}
        named = field((await post(client, gw, KEYS["a"], {**marked, "metadata": {
            "user_id": "someone"}}, "/v1/messages"))[1], "session_key")
    assert shown["a"].startswith("cache_control:") and shown["b"].startswith("cache_control:")
    assert shown["a"] != shown["b"]                 # one prompt, two tenants: two keys
    assert named.startswith("metadata.user_id:")


BAD_MARKS = [
    ({"type": "ephemeral", "ttl": "2h"}, "ttl"),
    ({"type": "persistent"}, "ephemeral"),
]


@pytest.mark.parametrize("mark, words", BAD_MARKS)
async def test_a_malformed_cache_control_is_a_400_in_the_apis_shape_sent_nowhere(
        make_standin, make_gateway, mark, words):
    standin = await make_standin(tokens=1)
    gw = await make_gateway(config([standin]))
    an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["a"], max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        await an.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user",
                                 "content": [{"type": "text", "text": "hi", "cache_control":
                                              mark}]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert words in e.value.body["error"]["message"]
    oa = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["a"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        await oa.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": mark}]}])
    assert e.value.body["type"] == "invalid_request_error" and words in e.value.body["message"]
    assert standin.requests == []


async def test_five_breakpoints_are_one_too_many(make_standin, make_gateway):
    standin = await make_standin(tokens=1)
    gw = await make_gateway(config([standin]))
    an = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["a"], max_retries=0)
    mark = {"type": "ephemeral"}
    with pytest.raises(anthropic.BadRequestError, match="A maximum of 4 blocks"):
        await an.messages.create(
            model=MODEL, max_tokens=1, cache_control=mark,
            system=[{"type": "text", "text": f"s{i}", "cache_control": mark} for i in range(4)],
            messages=[{"role": "user", "content": "hi"}])
    assert standin.requests == []
