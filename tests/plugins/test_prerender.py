"""prerender: split prefix + tail tokenizes exactly like the whole prompt; cache; gateway."""
from __future__ import annotations

import json

import aiohttp
import pytest

from prefixgate.backend.demo import write_tokenizer_files
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.common.schema import ConfigError
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.prerender import PromptCache
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from tests.helpers import QWEN_STYLE_TEMPLATE, tiny_tokenizer
from tests.plugins.helpers import PLAIN_TEMPLATE, Recorder

SYSTEM = ("You are a careful assistant for Northwind Cloud.\n  Rules:\n1. Be brief.  \n"
          "2. 用中文或英文回答。\n\n") * 20
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _dir(tmp_path_factory, name, template=None):
    d = tmp_path_factory.mktemp(name)
    kwargs = {"chat_template": template} if template else {}
    write_tokenizer_files(d, tiny_tokenizer(), **kwargs)
    return d


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return _dir(tmp_path_factory, "qwen", QWEN_STYLE_TEMPLATE)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return _dir(tmp_path_factory, "plain", PLAIN_TEMPLATE)


CONVERSATIONS = {
    "one_turn": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
    "tail_starts_with_space": [{"role": "system", "content": SYSTEM + "  "},
                               {"role": "user", "content": "  \n leading spaces"}],
    "multi_turn": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "天气?"},
                   {"role": "assistant", "content": "晴。"}, {"role": "user", "content": "谢谢"}],
    "long": [{"role": "system", "content": SYSTEM * 4},            # > 4096 chars: encode_batch
             {"role": "user", "content": "长问题？ " * 1200}],
    "two_system": [{"role": "system", "content": SYSTEM}, {"role": "system", "content": "Extra."},
                   {"role": "user", "content": "ok"}],
}


def _whole(tok, messages, tools=None, agp=True):
    return tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=agp))


@pytest.mark.parametrize("which", ["chatml_dir", "qwen_dir"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("agp", [True, False])
def test_split_tokenizes_exactly_like_the_whole_prompt(request, which, name, tools, agp):
    tok = Tokenizer.from_dir(request.getfixturevalue(which))
    cache = PromptCache(tok, block_tokens=16)
    first = CONVERSATIONS[name]
    second = first[:-1] + [{"role": "user", "content": first[-1]["content"] + " and more?"}]
    for messages, expect in ((first, "miss"), (second, "hit"), (first, "hit")):
        r = cache.render(messages, tools, agp)
        assert r.cache == expect
        whole = _whole(tok, messages, tools, agp)
        assert r.tokens == whole
        assert r.block_hashes == block_hash_chain(whole, 16)
    assert r.cached > 0
    assert r.text == tok.apply_chat_template(first, tools=tools, add_generation_prompt=agp)


def test_the_prefix_is_cut_after_a_special_token(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    cache = PromptCache(tok)
    cache.render(CONVERSATIONS["one_turn"])
    (entry,) = cache.entries.values()
    assert entry.text.endswith("<|im_end|>") and entry.text.startswith("<|im_start|>system\n")
    assert entry.ids == tok.encode(entry.text)


def test_no_special_token_means_no_split_but_still_exact(plain_dir):
    tok = Tokenizer.from_dir(plain_dir)
    cache = PromptCache(tok)
    for expect in ("unsplittable", "unsplittable"):
        r = cache.render(CONVERSATIONS["one_turn"])
        assert r.cache == expect and r.cached == 0
        assert r.tokens == _whole(tok, CONVERSATIONS["one_turn"])


def test_changed_prefix_is_a_miss_and_cache_is_bounded(chatml_dir):
    tok = Tokenizer.from_dir(chatml_dir)
    cache = PromptCache(tok, max_entries=3)
    for i in range(6):
        msgs = [{"role": "system", "content": f"{SYSTEM} v{i}"}, {"role": "user", "content": "q"}]
        assert cache.render(msgs).cache == "miss"
    assert len(cache.entries) == 3
    no_system = [{"role": "user", "content": "q"}]
    r = cache.render(no_system)
    assert r.cache == "none" and r.tokens == _whole(tok, no_system)


def test_block_hashes_on_a_hit_equal_the_routing_chain_of_the_whole_prompt(chatml_dir):
    toks = list(range(1000, 1100))
    whole = block_hash_chain(toks, 16)
    assert whole[:2] + block_hash_chain(toks[32:], 16, parent=whole[1]) == whole
    cache = PromptCache(Tokenizer.from_dir(chatml_dir), block_tokens=16)
    messages = CONVERSATIONS["multi_turn"]
    miss, hit = cache.render(messages), cache.render(messages)
    assert (miss.cache, hit.cache) == ("miss", "hit") and hit.cached > 16
    assert hit.block_hashes == miss.block_hashes == block_hash_chain(hit.tokens, 16)


# --- through the gateway --------------------------------------------------------------------

async def test_gateway_normalize_then_prerender_hits_the_prefix_cache(
        chatml_dir, make_standin, make_gateway):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "model": {"tokenizer": str(chatml_dir)},
                             "plugins": [{"normalize": {}}, {"prerender": {}}]})
    async with aiohttp.ClientSession() as client:
        for t in ("09:00:01", "09:00:07", "09:01:30"):
            body = {"model": "standin-model", "messages": [
                {"role": "system", "content": f"Current time: 2026-03-15 {t}\n{SYSTEM}"},
                {"role": "user", "content": "hi"}]}
            async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and r.headers["x-prefixgate-moved"] == "1"
        metrics = await (await client.get(gw.url + "/metrics")).text()
        # a request our template rendering rejects still goes on: the backend decides
        odd = {"model": "standin-model", "messages": [{"role": "wizard", "content": "x"}]}
        async with client.post(gw.url + "/v1/chat/completions", json=odd) as r:
            assert r.status == 200
        metrics_after = await (await client.get(gw.url + "/metrics")).text()
    assert 'prefixgate_prerender_prefix_cache_total{result="miss"} 1.0' in metrics
    assert 'prefixgate_prerender_prefix_cache_total{result="hit"} 2.0' in metrics
    assert 'prefixgate_prerender_prefix_cache_total{result="error"} 1.0' in metrics_after
    assert len(up.requests) == 4
    assert json.dumps(up.requests[1]["json"]["messages"][0]) == \
        json.dumps(up.requests[2]["json"]["messages"][0])


def test_prerender_needs_a_tokenizer(tmp_path):
    for model, reason in (({}, "needs `model.tokenizer`"), ({"tokenizer": str(tmp_path)},
                                                            "no tokenizer.json")):
        cfg = validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                        "model": model, "plugins": [{"prerender": {}}]})
        with pytest.raises(ConfigError) as e:
            Gateway(cfg)
        assert e.value.path == "plugins[0].prerender" and reason in str(e.value)
    cfg = validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                    "plugins": [{"prerender": {"block_tokens": 0}}]})
    with pytest.raises(ConfigError) as e:
        Gateway(cfg)
    assert e.value.path == "plugins[0].prerender.block_tokens"


@pytest.mark.parametrize("inline_chars", [0, 1 << 20])       # in a thread / on the loop
async def test_tokens_and_block_hashes_reach_the_context(
        chatml_dir, make_standin, make_gateway, inline_chars):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "model": {"tokenizer": str(chatml_dir)},
                             "plugins": [{"prerender": {"inline_chars": inline_chars,
                                                        "block_tokens": 8}},
                                         {"tests.plugins.helpers:Recorder": {}}]})
    Recorder.seen.clear()
    tok = Tokenizer.from_dir(chatml_dir)
    parts = [{"role": "system", "content": [{"type": "text", "text": SYSTEM[:50]},
                                            {"type": "text", "text": SYSTEM[50:]}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    convs = [CONVERSATIONS["one_turn"], CONVERSATIONS["multi_turn"], parts]
    async with aiohttp.ClientSession() as client:
        for messages in convs:
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={"model": "standin-model", "messages": messages}) as r:
                assert r.status == 200
        async with client.post(gw.url + "/v1/completions",
                               json={"model": "standin-model", "prompt": "plain text prompt"}) as r:
            assert r.status == 200
    expected = [_whole(tok, m) for m in convs[:2]] + [
        _whole(tok, CONVERSATIONS["one_turn"])] + [tok.encode("plain text prompt")]
    assert [c.tokens for c in Recorder.seen] == expected
    assert [c.block_hashes for c in Recorder.seen] == [block_hash_chain(t, 8) for t in expected]
