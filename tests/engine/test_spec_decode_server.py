"""Prompt-lookup speculative decoding (`--speculative-config`) as clients see it: two engine
servers on one tiny model, one drafting and one not, give the same greedy answers through the
OpenAI API (completions and chat, whole and streamed, stop strings, max_tokens, usage); drafts
reach the stream as multi-token deltas; vLLM's spec_decode counters on /metrics add up; bad
configs fail clearly at the engine's command line and in the gateway's config; and a gateway
with `bundled: {speculative_config: ...}` serves through a drafting engine."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import openai
import pytest
import yaml

from prefixgate.backend.cli import build_parser, speculative_config
from prefixgate.backend.config import SpeculativeConfig
from prefixgate.proxy.bundled import BundledEngines
from prefixgate.proxy.config import gateway as config_mod
from tests.helpers import ServerThread, Serving

K = 5
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
MAX_TOKENS = 40
NAME = "tiny"
# Prompts under which the tiny random model's greedy output loops, so n-gram drafts are
# accepted (each test_greedy_answers_... case checks that the counters grew).
LOOPING = {
    "ids-a": ("completions", [100, 101, 102] * 2),
    "ids-b": ("completions", list(range(1, 9))),
    "text": ("completions", "1, 2, 3, 1, 2, 3, 1, 2, 3"),
    "chat-cat": ("chat", [{"role": "user", "content": "the cat the cat the cat the cat"}]),
    "chat-hello": ("chat", [{"role": "user", "content": "Hello there!"}]),
}
# Ends on EOS after a few tokens (no ignore_eos): finish_reason "stop" from the model itself.
EOS_CASE = ("chat", [{"role": "user", "content": "Be brief."}])
SPEC_METRICS = ["prefixgate:spec_decode_num_drafts_total",
                "prefixgate:spec_decode_num_draft_tokens_total",
                "prefixgate:spec_decode_num_accepted_tokens_total"]
PER_POS = "prefixgate:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_LINE = re.compile(r'^(prefixgate:spec_decode_\w+)(?:\{position="(\d+)"\})? ([-+\d.eE]+)$')


def engine_argv(model_dir, *flags) -> list[str]:
    return ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024",
            "--num-kv-blocks", "128", "--served-model-name", NAME, *flags]


@pytest.fixture(scope="module")
def plain(model_dir):
    with ServerThread(engine_argv(model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def spec(model_dir):
    with ServerThread(engine_argv(model_dir, "--speculative-config", json.dumps(SPEC))) as s:
        yield s


def free_blocks(server) -> int:
    return server.server.engine.engine.block_manager.num_free_blocks


async def settled(server, blocks: int, timeout: float = 5.0) -> None:
    """Every KV block free again (cached ones count as free): no draft's block was lost."""
    async with asyncio.timeout(timeout):
        while free_blocks(server) != blocks:
            await asyncio.sleep(0.02)


def client_for(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


async def ask(server, kind: str, prompt, stream: bool, *, include_usage: bool = True,
              ignore_eos: bool = True, extra: dict | None = None, **params) -> dict:
    """One request through the openai SDK (greedy unless `params` say otherwise): text, token
    ids, finish_reason, usage and, streamed, the token count of each output chunk (the role
    chunk and the usage chunk aside)."""
    client = client_for(server)
    kwargs = dict(model=NAME, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": ignore_eos, "return_token_ids": True, **(extra or {})})
    kwargs.update(params)
    if stream:
        kwargs["stream"] = True
        if include_usage:
            kwargs["stream_options"] = {"include_usage": True}
    try:
        if kind == "chat":
            resp = await client.chat.completions.create(messages=prompt, **kwargs)
        else:
            resp = await client.completions.create(prompt=prompt, **kwargs)
        if not stream:
            choice = resp.choices[0]
            text = choice.message.content if kind == "chat" else choice.text
            return {"text": text, "ids": choice.model_extra["token_ids"],
                    "finish": choice.finish_reason,
                    "usage": (resp.usage.prompt_tokens, resp.usage.completion_tokens),
                    "chunks": None}
        text, ids, finish, usage, chunks, usage_only = [], [], None, None, [], 0
        async for c in resp:
            if c.usage is not None:
                usage = (c.usage.prompt_tokens, c.usage.completion_tokens)
            if not c.choices:
                usage_only += 1
                continue
            choice = c.choices[0]
            if kind == "chat":
                if choice.delta.role == "assistant" and not choice.model_extra.get("token_ids"):
                    continue                    # the role chunk opens the stream
                text.append(choice.delta.content or "")
            else:
                text.append(choice.text)
            chunk_ids = choice.model_extra.get("token_ids") or []
            ids += chunk_ids
            chunks.append(len(chunk_ids))
            finish = choice.finish_reason or finish
        assert usage_only == (1 if include_usage else 0)
        return {"text": "".join(text), "ids": ids, "finish": finish, "usage": usage,
                "chunks": chunks}
    finally:
        await client.close()


async def scrape(server) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()


async def spec_counters(server) -> dict:
    """{name: value} of the three totals, plus PER_POS: {position: value}."""
    text = await scrape(server)
    out = {PER_POS: {}}
    for line in text.splitlines():
        if m := SPEC_LINE.match(line):
            name, pos, value = m.group(1), m.group(2), float(m.group(3))
            if pos is None:
                out[name] = value
            else:
                assert name == PER_POS
                out[PER_POS][int(pos)] = value
    return out


def check_invariants(c: dict, k: int = K) -> None:
    drafts, draft_tokens, accepted = (c[n] for n in SPEC_METRICS)
    assert sorted(c[PER_POS]) == list(range(k))
    per_pos = [c[PER_POS][i] for i in range(k)]
    assert accepted <= draft_tokens <= k * drafts
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    assert per_pos[0] <= drafts


# --- 1. the same greedy answers, with and without drafts -------------------------------------

CASES = [*LOOPING, "eos"]


def case(name):
    if name == "eos":
        return (*EOS_CASE, False)
    return (*LOOPING[name], True)


@pytest.mark.parametrize("name", CASES)
async def test_greedy_answers_are_the_same_with_and_without_speculation(plain, spec, name):
    kind, prompt, ignore_eos = case(name)
    before = await spec_counters(spec)
    ref = await ask(plain, kind, prompt, False, ignore_eos=ignore_eos)
    if ignore_eos:
        assert ref["usage"][1] == MAX_TOKENS and ref["finish"] == "length"
    else:
        assert ref["usage"][1] < MAX_TOKENS and ref["finish"] == "stop"     # the model's EOS
    answers = {
        "plain-stream": await ask(plain, kind, prompt, True, ignore_eos=ignore_eos),
        "spec-whole": await ask(spec, kind, prompt, False, ignore_eos=ignore_eos),
        "spec-stream": await ask(spec, kind, prompt, True, ignore_eos=ignore_eos),
        "spec-stream-no-usage-option": await ask(spec, kind, prompt, True, ignore_eos=ignore_eos,
                                                 include_usage=False),
    }
    for label, got in answers.items():
        assert (got["text"], got["ids"], got["finish"], got["usage"]) == (
            ref["text"], ref["ids"], ref["finish"], ref["usage"]), label
    assert len(ref["ids"]) == ref["usage"][1]
    # without drafts every step yields one token, so one chunk per token
    assert answers["plain-stream"]["chunks"] == [1] * ref["usage"][1]
    after = await spec_counters(spec)
    check_invariants(after)
    if not ignore_eos:
        return
    # drafts reach the stream: steps that accepted some gave several tokens in one chunk
    for label in ("spec-stream", "spec-stream-no-usage-option"):
        chunks = answers[label]["chunks"]
        assert sum(chunks) == ref["usage"][1]
        assert max(chunks) > 1 and len(chunks) < ref["usage"][1], (label, chunks)
    accepted = after[SPEC_METRICS[2]] - before[SPEC_METRICS[2]]
    assert accepted > 0


async def test_one_streamed_chunk_per_step_and_the_counters_agree(spec):
    """A request alone on the engine: every step is one chunk and gives 1 + its accepted
    tokens, so chunks + accepted == completion tokens; a chunk never carries more than K + 1."""
    kind, prompt = LOOPING["ids-a"]
    before = await spec_counters(spec)
    got = await ask(spec, kind, prompt, True)
    after = await spec_counters(spec)
    accepted = after[SPEC_METRICS[2]] - before[SPEC_METRICS[2]]
    assert accepted > 0
    assert len(got["chunks"]) + accepted == got["usage"][1] == MAX_TOKENS
    assert max(got["chunks"]) <= K + 1


async def test_concurrent_requests_draft_in_one_batch_and_answer_as_alone(plain, spec):
    """All the looping prompts at once (one batch of drafting decodes, streamed and whole)
    give what each gives alone without drafts, and every KV block comes back."""
    refs = {name: await ask(plain, kind, prompt, False) for name, (kind, prompt) in LOOPING.items()}
    before = await spec_counters(spec)
    jobs = [(name, stream) for name in LOOPING for stream in (False, True)]
    answers = await asyncio.gather(*(ask(spec, *LOOPING[name], stream) for name, stream in jobs))
    for (name, stream), got in zip(jobs, answers):
        ref = refs[name]
        assert (got["text"], got["ids"], got["finish"], got["usage"]) == (
            ref["text"], ref["ids"], ref["finish"], ref["usage"]), (name, stream)
    after = await spec_counters(spec)
    check_invariants(after)
    assert after[SPEC_METRICS[2]] > before[SPEC_METRICS[2]]
    await settled(spec, 128)


async def test_drafts_under_kv_pressure_with_preemptions_answer_as_without(model_dir, plain):
    """A KV cache too small for the batch: drafts only take spare blocks, sequences are
    preempted and recomputed, and the answers are still the plain engine's."""
    blocks = 12             # 192 tokens; five requests want ~60 each
    refs = {name: await ask(plain, kind, prompt, False) for name, (kind, prompt) in LOOPING.items()}
    argv = engine_argv(model_dir, "--speculative-config", json.dumps(SPEC))
    argv[argv.index("--num-kv-blocks") + 1] = str(blocks)
    with ServerThread(argv) as tight:
        # a burst of five until one preempts (up to three): on a busy machine the requests can
        # arrive spread out enough that the cache holds them all
        for _ in range(3):
            answers = await asyncio.gather(*(ask(tight, kind, prompt, True)
                                             for kind, prompt in LOOPING.values()))
            for name, got in zip(LOOPING, answers):
                ref = refs[name]
                assert (got["text"], got["ids"], got["finish"], got["usage"]) == (
                    ref["text"], ref["ids"], ref["finish"], ref["usage"]), name
            await settled(tight, blocks)
            text = await scrape(tight)
            preemptions = re.search(r"^prefixgate:num_preemptions_total (\S+)$", text, re.M)
            if float(preemptions.group(1)) > 0:
                break
        assert float(preemptions.group(1)) > 0
        counters = await spec_counters(tight)
        check_invariants(counters)
        assert counters[SPEC_METRICS[2]] > 0


async def test_seeded_sampling_with_drafts_is_reproducible(spec):
    """Random rows verify drafts by speculative sampling from the request's own generator:
    the same seed gives the same answer, whole or streamed, and drafts are still verified."""
    kind, prompt = LOOPING["ids-a"]
    before = await spec_counters(spec)
    runs = [await ask(spec, kind, prompt, stream, temperature=0.3, seed=1234)
            for stream in (False, True, False)]
    for got in runs:
        assert (got["text"], got["ids"], got["usage"], got["finish"]) == (
            runs[0]["text"], runs[0]["ids"], runs[0]["usage"], "length")
    assert runs[0]["usage"][1] == MAX_TOKENS
    after = await spec_counters(spec)
    check_invariants(after)
    assert after[SPEC_METRICS[0]] > before[SPEC_METRICS[0]]


# --- 2. stop strings and max_tokens ----------------------------------------------------------

@pytest.mark.parametrize("name", ["chat-cat", "chat-hello"])
async def test_a_stop_string_inside_accepted_drafts_truncates_as_without_them(plain, spec, name):
    """Stops ending on several consecutive tokens of a looping stretch: most end inside a
    step's accepted draft, whose later tokens must then be dropped (text and usage)."""
    kind, prompt = LOOPING[name]
    ref = await ask(plain, kind, prompt, False)
    text = ref["text"]
    run = re.search(r"([!-~])\1{7,}", text)       # an ASCII character repeated: the loop
    assert run and run.start() > 0, text
    tokens_seen = set()
    for n in range(2, 8):
        stop = run.group(1) * n
        expected = text[:text.find(stop)]
        assert expected                                 # the stop is from the middle
        plain_got = await ask(plain, kind, prompt, False, stop=[stop])
        assert (plain_got["text"], plain_got["finish"]) == (expected, "stop")
        for got in (await ask(spec, kind, prompt, False, stop=[stop]),
                    await ask(spec, kind, prompt, True, stop=[stop])):
            assert got["text"] == expected, (stop, got)
            assert got["finish"] == "stop"
            assert got["usage"] == plain_got["usage"], stop
            assert got["ids"] == plain_got["ids"], stop
        assert plain_got["usage"][1] < MAX_TOKENS
        tokens_seen.add(plain_got["usage"][1])
    assert len(tokens_seen) > 1         # the stops ended on different tokens


async def test_a_stop_token_inside_an_accepted_draft_ends_the_answer_there(plain, spec):
    """`stop_token_ids` checked token by token through a step's accepted draft: the prompt is
    a looping prompt plus the start of its own answer, so drafts copied from the prompt carry
    tokens whose first appearance in the answer is then a draft token (the tokens after it in
    that step are never generated)."""
    kind, prompt = LOOPING["ids-b"]
    answer = (await ask(plain, kind, prompt, False, max_tokens=60))["ids"]
    for m in (19, 22, 25):
        head = prompt + answer[:m]
        rest = (await ask(plain, kind, head, False))["ids"]
        for tok in dict.fromkeys(rest[:10]):
            ref = await ask(plain, kind, head, False, extra={"stop_token_ids": [tok]})
            assert ref["ids"] == rest[:rest.index(tok) + 1] and ref["finish"] == "stop"
            for stream in (False, True):
                got = await ask(spec, kind, head, stream, extra={"stop_token_ids": [tok]})
                assert (got["text"], got["ids"], got["finish"], got["usage"]) == (
                    ref["text"], ref["ids"], ref["finish"], ref["usage"]), (m, tok)


@pytest.mark.parametrize("name", ["ids-a", "chat-cat"])
async def test_max_tokens_is_exact_with_drafts(plain, spec, name):
    kind, prompt = LOOPING[name]
    ref = await ask(plain, kind, prompt, False)
    for n in (1, 2, 3, 7, 11, 23):
        for server in (plain, spec):
            for stream in (False, True):
                got = await ask(server, kind, prompt, stream, max_tokens=n)
                assert got["usage"][1] == n and got["finish"] == "length", (n, got)
                assert got["ids"] == ref["ids"][:n]


async def test_drafts_stop_at_the_context_limit(plain, spec):
    """A looping prompt 25 tokens short of max_model_len: drafts never run past the context,
    and the answer ends there ("length") as without them."""
    prompt = ([100, 101, 102] * 400)[:1024 - 25]
    ref = await ask(plain, "completions", prompt, False)
    assert ref["usage"] == (len(prompt), 25) and ref["finish"] == "length"
    before = await spec_counters(spec)
    for stream in (False, True):
        got = await ask(spec, "completions", prompt, stream)
        assert (got["text"], got["ids"], got["finish"], got["usage"]) == (
            ref["text"], ref["ids"], ref["finish"], ref["usage"]), stream
    assert (await spec_counters(spec))[SPEC_METRICS[2]] > before[SPEC_METRICS[2]]


# --- 3. /metrics -----------------------------------------------------------------------------

async def test_spec_decode_metrics_have_vllms_names_only_where_it_is_on(plain, spec):
    text = await scrape(spec)
    for name in SPEC_METRICS + [PER_POS]:
        assert f"# TYPE {name} counter" in text, name
    positions = re.findall(rf'^{re.escape(PER_POS)}\{{position="(\d+)"\}} ', text, re.M)
    assert positions == [str(i) for i in range(K)]
    for name in SPEC_METRICS:
        assert re.search(rf"^{re.escape(name)} ", text, re.M), name
    assert "spec_decode" not in await scrape(plain)


async def test_spec_decode_counters_add_up_and_grow(spec):
    await ask(spec, *LOOPING["chat-cat"], False)
    first = await spec_counters(spec)
    check_invariants(first)
    assert first[SPEC_METRICS[0]] > 0 and first[SPEC_METRICS[2]] > 0
    await ask(spec, *LOOPING["ids-b"], True)
    second = await spec_counters(spec)
    check_invariants(second)
    for name in SPEC_METRICS:
        assert second[name] > first[name], name
    assert second[PER_POS][0] > first[PER_POS][0]
    # what the one request added is itself a set of drafts: prefixes accepted
    delta = [second[PER_POS][i] - first[PER_POS][i] for i in range(K)]
    assert all(a >= b >= 0 for a, b in zip(delta, delta[1:])), delta
    assert sum(delta) == second[SPEC_METRICS[2]] - first[SPEC_METRICS[2]]


# --- 4. bad configs fail clearly ------------------------------------------------------------

def test_a_bad_speculative_config_stops_the_engine_at_once_naming_the_flag_and_key(model_dir):
    bad = {
        '{"num_speculative_tokens": 0}': "num_speculative_tokens",
        '{"num_speculative_tokens": 5,': "not valid JSON",
        '{"method": "eagle", "num_speculative_tokens": 5}': "method",
    }
    procs = {value: subprocess.Popen(
        [sys.executable, "-m", "prefixgate.backend", "--model", str(model_dir),
         "--port", "0", "--speculative-config", value],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for value in bad}
    try:
        for value, key in bad.items():
            out, err = procs[value].communicate(timeout=60)
            assert procs[value].returncode == 1, (value, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1, err
            assert (lines[0].startswith("prefixgate backend: --speculative-config: ")
                    and key in lines[0]), err
            assert "Traceback" not in err and "engine ready" not in err   # before any model load
            assert out == ""
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("value,key", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"prompt_lookup_max": 4}, "num_speculative_tokens"),            # required
    ({"method": "eagle", "num_speculative_tokens": 3}, "method"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "min_acceptance_rate": 2}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 3, "draft_model": "x"}, "draft_model"),
])
def test_a_bad_bundled_speculative_config_names_its_key(value, key):
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.validate({"bundled": {"speculative_config": value}})
    assert str(e.value).startswith(f"bundled.speculative_config.{key}: ")
    assert "\n" not in str(e.value)


def test_a_bundled_speculative_config_that_is_no_mapping_is_refused():
    with pytest.raises(config_mod.ConfigError) as e:
        config_mod.validate({"bundled": {"speculative_config": "ngram"}})
    assert str(e.value).startswith("bundled.speculative_config: ")


def test_a_bundled_speculative_config_becomes_the_engines_flag():
    cfg = config_mod.validate({"bundled": {"model": "x", "args": ["--max-num-seqs", 8],
                                           "speculative_config": SPEC}})
    args = BundledEngines(cfg["bundled"]).engine_args()
    assert args == ["--max-num-seqs", "8", "--speculative-config", json.dumps(SPEC)]
    # the engine reads it back as given
    assert speculative_config(build_parser().parse_args(args)) == SpeculativeConfig(
        num_speculative_tokens=K, prompt_lookup_min=2, prompt_lookup_max=4)
    # the flag in `args` wins; no config, no flag
    own = config_mod.validate({"bundled": {"args": ["--speculative-config",
                                                    '{"num_speculative_tokens": 2}'],
                                           "speculative_config": SPEC}})
    assert BundledEngines(own["bundled"]).engine_args() == [
        "--speculative-config", '{"num_speculative_tokens": 2}']
    none = config_mod.validate({"bundled": {}})
    assert none["bundled"]["speculative_config"] is None
    assert BundledEngines(none["bundled"]).engine_args() == []


# --- a gateway with a drafting bundled engine ------------------------------------------------

async def test_a_gateway_serves_through_a_bundled_engine_that_drafts(model_dir, plain, tmp_path):
    gw_cfg = {"listen": {"host": "127.0.0.1", "port": 0},
              "bundled": {"model": str(model_dir), "instances": 1,
                          "args": ["--dtype", "float32", "--num-kv-blocks", "128",
                                   "--served-model-name", NAME],
                          "speculative_config": {"num_speculative_tokens": 3,
                                                 "prompt_lookup_min": 2,
                                                 "prompt_lookup_max": 3}},
              "plugins": [{"metrics": {}}]}
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(gw_cfg))
    async with Serving("--config", str(path), timeout=60) as gw:
        engine_url = re.search(r"engine0=(http://127\.0\.0\.1:\d+)", gw.line).group(1)
        kind, prompt = LOOPING["chat-cat"]
        engine = SimpleNamespace(url=engine_url)
        expected = await ask(plain, kind, prompt, False)
        for stream in (False, True):
            got = await ask(gw, kind, prompt, stream)
            assert (got["text"], got["ids"], got["usage"], got["finish"]) == (
                expected["text"], expected["ids"], expected["usage"], expected["finish"])
        counters = await spec_counters(engine)
        check_invariants(counters, k=3)
        assert counters[SPEC_METRICS[0]] > 0 and counters[SPEC_METRICS[2]] > 0
