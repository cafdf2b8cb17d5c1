"""The prompt plugins use the request's model (`ctx.model`): prerender tokenizes with that
model's tokenizer, prefix_route keys per model, normalize learns per model, the doctor
analyses each request as its model's."""
from __future__ import annotations

import re

import aiohttp
import pytest

from prefixgate.backend.demo import train_bpe_tokenizer, write_tokenizer_files
from prefixgate.common.block_hash import block_hash_chain
from prefixgate.common.schema import ConfigError, check
from prefixgate.common.tokenizer import Tokenizer
from prefixgate.plugins.normalize.plugin import MAX_MODELS, Normalizer
from prefixgate.plugins.normalize.plugin import SPEC as NORMALIZE_SPEC
from prefixgate.plugins.prefix_route.keys import ring_position
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from prefixgate.proxy.context import RequestContext
from prefixgate.proxy.doctor import scrape as pm
from prefixgate.proxy.doctor.cli import prompt_findings
from prefixgate.proxy.doctor.prompt import divergence
from tests.plugins.helpers import PLAIN_TEMPLATE

TEXTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
         "A prefix cache keeps the keys and values of prompts that many requests share.",
         "User asks a question and the assistant answers it clearly and briefly.",
         "Numbers like 1, 2, 3, 42 and 2024 appear in text; so do symbols: {} [] () <> # @."]
SYSTEM = "You are a careful assistant. Answer briefly and cite the rules you used. " * 12
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi there"}]
TEMPLATE = ("You are assisting customer #{cust} on plan Pro-3 (v2.1 rules, $29.99/mo).\n"
            "Ticket opened at {t}. Answer in under 120 words.")


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """Two models' tokenizers: different vocabularies and chat templates."""
    a, b = tmp_path_factory.mktemp("tok_a"), tmp_path_factory.mktemp("tok_b")
    write_tokenizer_files(a, train_bpe_tokenizer(TEXTS * 4, 384))
    write_tokenizer_files(b, train_bpe_tokenizer(TEXTS[:2] * 4, 300),
                          chat_template=PLAIN_TEMPLATE)
    return {"a": a, "b": b}


def _ids(tok_dir, messages=MESSAGES) -> list[int]:
    tok = Tokenizer.from_dir(tok_dir)
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def _route(r) -> str:
    return r.headers["x-prefixgate-route"]


def _key(route: str) -> str:
    return re.search(r"key=([0-9a-f]+)", route).group(1)


# --- keys -----------------------------------------------------------------------------------

def test_ring_positions_separate_models():
    key = 0x1234_5678_9abc_def0
    assert ring_position(key, None) == key                      # no model: the key itself
    assert len({ring_position(key, m) for m in (None, "a", "b", "a-lora")}) == 4
    assert ring_position(key, "a") == ring_position(key, "a")


def _home(route: str) -> str:
    return re.search(r"home=([^;]+)", route).group(1)


# --- prerender ------------------------------------------------------------------------------

def _gateway(cfg: dict) -> Gateway:
    cfg.setdefault("upstreams", [{"name": "u", "url": "http://127.0.0.1:9"}])
    return Gateway(validate(cfg))


async def test_prerender_picks_the_request_models_tokenizer(tok_dirs):
    gw = _gateway({"models": {"a": {"tokenizer": str(tok_dirs["a"])},
                              "b": {"tokenizer": str(tok_dirs["b"])}, "c": {}},
                   "plugins": [{"prerender": {"block_tokens": 8}}]})
    plugin = gw.chain.plugins[0]
    seen = {}
    for model in ("a", "b", "c", "unknown"):
        ctx = RequestContext(request_id="1", path="/v1/chat/completions", headers={},
                             body={"model": model, "messages": MESSAGES}, model=model)
        await plugin.on_request(ctx)
        seen[model] = ctx
    for m in ("a", "b"):
        assert seen[m].tokens == _ids(tok_dirs[m])
        assert seen[m].block_hashes == block_hash_chain(seen[m].tokens, 8)   # the engine's
    assert seen["a"].tokens != seen["b"].tokens
    for m in ("c", "unknown"):                   # no tokenizer for it: untouched
        assert seen[m].tokens is None and seen[m].block_hashes is None
        assert not seen[m].body_changed
    assert plugin.cache_for(None) is None        # several models, no `*`: none to pick


async def test_prerender_any_model_entry_and_the_single_form(tok_dirs):
    gw = _gateway({"models": {"a": {"tokenizer": str(tok_dirs["a"])},
                              "*": {"tokenizer": str(tok_dirs["b"])}},
                   "plugins": [{"prerender": {}}]})
    plugin = gw.chain.plugins[0]
    assert plugin.cache_for("a").tok is not plugin.cache_for("zzz").tok
    assert plugin.cache_for("zzz") is plugin.cache_for(None) is plugin.caches["*"]
    # the single `model:` form (a named model): a request naming none uses it too
    gw = _gateway({"model": {"name": "a", "tokenizer": str(tok_dirs["a"])},
                   "plugins": [{"prerender": {}}]})
    plugin = gw.chain.plugins[0]
    assert plugin.cache_for(None) is plugin.cache_for("a") is not None
    assert plugin.cache_for("b") is None
    ctx = RequestContext(request_id="1", path="/v1/chat/completions", headers={},
                         body={"messages": MESSAGES})
    await plugin.on_request(ctx)
    assert ctx.tokens == _ids(tok_dirs["a"])
    assert ctx.block_hashes == block_hash_chain(ctx.tokens, 16)     # one model: engine's root


def test_prerender_config_errors_name_the_model(tok_dirs, tmp_path):
    with pytest.raises(ConfigError) as e:
        _gateway({"models": {"a": {"tokenizer": str(tok_dirs["a"])},
                             "b": {"tokenizer": str(tmp_path)}},
                  "plugins": [{"prerender": {}}]})
    assert e.value.path == "plugins[0].prerender"
    assert "models.b.tokenizer" in str(e.value) and "no tokenizer.json" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _gateway({"models": {"a": {}, "b": {}}, "plugins": [{"prerender": {}}]})
    assert "`models.<name>.tokenizer`" in str(e.value) and "`model.tokenizer`" in str(e.value)


async def test_gateway_forwards_each_models_own_tokens(tok_dirs, make_standin, make_gateway):
    """End to end: the stand-in behind `forward: tokens` receives the token ids of its own
    model's tokenizer; a model without a tokenizer gets the chat as it was sent."""
    ups = {m: await make_standin(tokens=2, model=m) for m in ("a", "b", "c")}
    gw = await make_gateway({
        "upstreams": [{"name": m, "url": s.url, "models": [m], "forward": "tokens"}
                      for m, s in ups.items()],
        "models": {"a": {"tokenizer": str(tok_dirs["a"])},
                   "b": {"tokenizer": str(tok_dirs["b"])}},
        "plugins": [{"prerender": {}}, {"metrics": {}}]})
    async with aiohttp.ClientSession() as client:
        for m in ("a", "b", "c"):
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={"model": m, "messages": MESSAGES}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-prefixgate-upstream"] == m
        metrics = await (await client.get(gw.url + "/metrics")).text()
    for m in ("a", "b"):
        (req,) = ups[m].requests
        assert req["path"] == "/v1/completions" and req["json"]["prompt"] == _ids(tok_dirs[m])
    (req,) = ups["c"].requests
    assert req["path"] == "/v1/chat/completions" and req["json"]["messages"] == MESSAGES
    # two lookups (b's plain template has no special token to split at), none for c
    assert 'prefixgate_prerender_prefix_cache_total{result="miss"} 1.0' in metrics
    assert 'prefixgate_prerender_prefix_cache_total{result="unsplittable"} 1.0' in metrics
    tokenized = len(_ids(tok_dirs["a"])) + len(_ids(tok_dirs["b"]))
    assert f'prefixgate_prerender_tokens_total{{source="tokenized"}} {tokenized}.0' in metrics


# --- prefix_route ---------------------------------------------------------------------------

async def test_chwbl_keys_the_same_prompt_per_model(tok_dirs, make_standin, make_gateway):
    """Same prompt, two models: the same key (the engine's block hash, as prerender hashed
    it) placed on the ring per model, so the two models' homes are unrelated."""
    standins = [await make_standin(tokens=1) for _ in range(4)]
    gw = await make_gateway({
        "upstreams": [{"name": f"u{i}", "url": s.url, "models": ["a", "b"]}
                      for i, s in enumerate(standins)],
        "models": {"a": {"tokenizer": str(tok_dirs["a"])},
                   "b": {"tokenizer": str(tok_dirs["a"])}},    # even with one tokenizer
        "plugins": [{"prerender": {}}, {"prefix_route": {"policy": "chwbl",
                                                         "load_factor": 100}}]})
    homes = {"a": [], "b": []}
    async with aiohttp.ClientSession() as client:
        for i in range(12):
            messages = [{"role": "system", "content": f"{i} " + SYSTEM}, MESSAGES[1]]
            for m in ("a", "b"):
                async with client.post(gw.url + "/v1/chat/completions",
                                       json={"model": m, "messages": messages}) as r:
                    assert r.status == 200
                    route = _route(r)
                chain = block_hash_chain(_ids(tok_dirs["a"], messages), 16)
                assert _key(route) == f"{chain[3]:016x}"
                homes[m].append(_home(route))
    assert homes["a"] != homes["b"]


async def test_chwbl_text_keys_per_model_and_short_prompts(make_standin, make_gateway):
    standins = [await make_standin(tokens=1) for _ in range(4)]
    gw = await make_gateway({
        "upstreams": [{"name": f"u{i}", "url": s.url, "models": ["a", "b"]}
                      for i, s in enumerate(standins)],
        "models": {"a": {}, "b": {}},                      # named, no tokenizer: text keys
        "plugins": [{"prefix_route": {"policy": "chwbl", "load_factor": 100}}]})
    homes = {"a": [], "b": []}
    async with aiohttp.ClientSession() as client:
        for i in range(8):
            for body in ({"messages": [{"role": "system", "content": f"{i} " + SYSTEM}]},
                         {"prompt": f"short {i}"}, {"prompt": [1, 2, i]}):
                for m in ("a", "b"):
                    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                    async with client.post(gw.url + path, json={"model": m, **body}) as r:
                        assert r.status == 200
                        homes[m].append(_home(_route(r)))
    assert homes["a"] != homes["b"]


async def test_cache_aware_never_matches_another_models_prefix(make_standin, make_gateway):
    """A prompt sent to model a, then the same to model b on upstreams serving both: no
    cache match for b; a's second send matches."""
    standins = [await make_standin(tokens=1) for _ in range(2)]
    gw = await make_gateway({
        "upstreams": [{"name": f"u{i}", "url": s.url, "models": ["a", "b"]}
                      for i, s in enumerate(standins)],
        "models": {"a": {}, "b": {}},
        "plugins": [{"prefix_route": {"policy": "cache_aware"}}, {"metrics": {}}]})
    routes = []
    async with aiohttp.ClientSession() as client:
        for m in ("a", "b", "a"):
            async with client.post(gw.url + "/v1/chat/completions",
                                   json={"model": m, "messages": MESSAGES}) as r:
                assert r.status == 200
                await r.read()
                routes.append(_route(r))
    assert "outcome=new" in routes[0]
    assert "outcome=new" in routes[1] and "matched=0" in routes[1]
    assert "outcome=cache" in routes[2]


async def test_cache_aware_plugin_level_per_model():
    """The scorer alone, with ctx.model set as the gateway sets it."""
    gw = _gateway({"upstreams": [{"name": f"u{i}", "url": f"http://127.0.0.1:{9 + i}"}
                                 for i in range(2)],
                   "models": {"a": {}, "b": {}},
                   "plugins": [{"prefix_route": {"policy": "cache_aware"}}]})
    plugin = gw.chain.plugins[0]

    def ctx(model):
        return RequestContext(request_id="1", path="/v1/chat/completions", headers={},
                              body={"model": model, "messages": MESSAGES}, model=model)
    first = ctx("a")
    plugin.score(first, gw.upstreams)
    plugin.record(first, gw.upstreams[0])
    for model, best in (("b", 0), ("a", len(plugin.keys(first).chain))):
        c = ctx(model)
        plugin.score(c, gw.upstreams)
        assert c.route_info["best_match"] == best


# --- normalize ------------------------------------------------------------------------------

def _learn_body(i: int, model: str) -> dict:
    return {"model": model, "messages": [
        {"role": "system", "content": TEMPLATE.format(cust=48213 + 7 * i,
                                                      t=f"2026/03/15 09:{i:02d}")},
        {"role": "user", "content": "Where is my order?"}]}


def test_normalizer_learns_per_model():
    n = Normalizer(check({}, NORMALIZE_SPEC))
    assert [len(n.normalize(_learn_body(i, "a"), "a")) for i in range(4)] == [0, 0, 2, 2]
    assert n.normalize(_learn_body(4, "b"), "b") == []        # a's template: not b's
    assert n.normalize(_learn_body(5, None)) == []            # nor a request naming none
    assert len(n.learner_for("a").templates) == 1 and n.learned_templates() == 3
    for i in range(MAX_MODELS + 10):                          # bounded, least recent dropped
        n.normalize(_learn_body(0, f"m{i}"), f"m{i}")
    assert len(n.learners) == MAX_MODELS and "a" not in n.learners
    assert Normalizer(check({"learn": False}, NORMALIZE_SPEC)).learner_for("a") is None


async def test_gateway_normalize_learns_per_model(make_standin, make_gateway):
    up = await make_standin(tokens=1)
    gw = await make_gateway({"upstreams": [{"name": "u", "url": up.url,
                                            "models": ["a", "b"]}],
                             "plugins": [{"normalize": {}}, {"metrics": {}}]})
    moved = []
    async with aiohttp.ClientSession() as client:
        for i, m in enumerate(["a"] * 4 + ["b", "b", "a"]):
            async with client.post(gw.url + "/v1/chat/completions",
                                   json=_learn_body(i, m)) as r:
                assert r.status == 200
                moved.append((m, int(r.headers["x-prefixgate-moved"])))
        metrics = await (await client.get(gw.url + "/metrics")).text()
    # a learns on its 3rd request; b starts from nothing (2 values seen: not yet learned)
    assert moved == [("a", 0), ("a", 0), ("a", 2), ("a", 2), ("b", 0), ("b", 0), ("a", 2)]
    assert up.requests[4]["json"]["messages"] == _learn_body(4, "b")["messages"]
    assert "prefixgate_normalize_learned_templates 2.0" in metrics


# --- doctor ---------------------------------------------------------------------------------

def test_doctor_analyses_each_request_as_its_models(tok_dirs):
    tok = Tokenizer.from_dir(tok_dirs["a"])
    system = "Current time: 2026-03-15 14:22:31\n" + SYSTEM
    a = {"model": "a", "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": "hi"}]}
    b = {**a, "model": "b"}
    found = divergence(a, b, tok)
    assert found.status == "INFO" and "different models" in found.detail
    # the tokenizer is the probed model's: offsets in tokens only for that model's requests
    fa, fb, div = prompt_findings([a, b], tok, None, "a")
    assert "tokens" in fa.data["offset"] and "tokens" not in fb.data["offset"]
    assert div.data["models"] == ["a", "b"]
    # --model: every request is analysed as that model's (and compared)
    fa, fb, div = prompt_findings([a, b], tok, "a", "a")
    assert "tokens" in fb.data["offset"] and div.title == "divergence" and "before" in div.data


def test_doctor_reads_the_probed_models_metrics():
    text = ('vllm:prefix_cache_queries_total{model_name="a"} 10\n'
            'vllm:prefix_cache_queries_total{model_name="b"} 90\n'
            'prefixgate_ttft_seconds_count{upstream="u"} 4\n')
    assert pm.parse(text)["vllm:prefix_cache_queries"] == 100
    assert pm.parse(text, "a") == {"vllm:prefix_cache_queries": 10,
                                   "prefixgate_ttft_seconds_count": 4}
    assert pm.parse(text, "alias")["vllm:prefix_cache_queries"] == 100   # no such label: all
