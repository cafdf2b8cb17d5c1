"""normalize on a generated corpus it was not written against: recall per category, precision,
the learner's convergence, and the same through a real gateway.

The corpus is `tests/data/normalize_corpus.yaml`, written by `tests/data/gen_normalize_corpus.py`
from a seed (its vocabulary is its own, not the detector's). Run with `-s` to see the summary
of recall per category and of the learner's convergence.
"""
from __future__ import annotations

import collections
import copy
import importlib.util
import json
import re

import aiohttp
import pytest
import yaml

from prefixgate.plugins.normalize.detectors import scan
from prefixgate.plugins.normalize.plugin import CLOSE, OPEN, Normalizer
from tests.helpers import DATA
from tests.plugins.helpers import normalizer

CORPUS_FILE = DATA / "normalize_corpus.yaml"
CORPUS = yaml.safe_load(CORPUS_FILE.read_text("utf-8"))
USER = "Please help me with my question."
MAX_REQUESTS_TO_LEARN = 8
PLACEHOLDER = re.compile("⟨[0-9]+⟩")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_normalize_corpus",
                                                  DATA / "gen_normalize_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chat(system: str) -> dict:
    return {"model": "standin-model", "messages": [{"role": "system", "content": system},
                                                   {"role": "user", "content": USER}]}


def tail_of(body: dict) -> str:
    user = body["messages"][-1]["content"]
    return user[user.index(OPEN):] if OPEN in user else ""


def head_of(body: dict) -> list:
    msgs = copy.deepcopy(body["messages"])
    msgs[-1]["content"] = msgs[-1]["content"].split(OPEN)[0]
    return msgs


def test_corpus_file_is_what_the_generator_writes():
    assert _generator().render(CORPUS["seed"]) == CORPUS_FILE.read_text("utf-8"), \
        "stale: run python tests/data/gen_normalize_corpus.py"


def test_corpus_is_big_and_mixed():
    dynamic, static = CORPUS["dynamic"], CORPUS["static"]
    assert len(dynamic) >= 150 and len(static) >= 150
    for entries in (dynamic, static):
        assert {e["lang"] for e in entries} == {"en", "zh", "mixed"}
    assert {e["kind"] for e in dynamic} == {"system", "tools", "fewshot"}
    hard = collections.Counter(h for e in static for h in e["hard"])
    assert set(hard) >= {"policy_date", "version_pin", "session_prose", "fewshot_ids",
                         "tool_description", "code_uuid", "schedule", "quotation"}
    assert min(hard.values()) >= 10, hard
    categories = collections.Counter(f["category"] for e in dynamic for f in e["fields"])
    assert len(categories) == 15 and min(categories.values()) >= 10, categories


def test_typed_fields_move_with_full_recall_per_category():
    n = normalizer()
    total, moved, misses = collections.Counter(), collections.Counter(), []
    for e in CORPUS["dynamic"]:
        body = chat(e["text"])
        got = [m["value"] for m in n.normalize(body)]
        system, tail = body["messages"][0]["content"], tail_of(body)
        text = json.dumps(body, ensure_ascii=False)
        for f in e["fields"]:
            total[f["category"]] += 1
            if f["value"] in got and f["value"] not in system and f["value"] in tail \
                    and text.count(json.dumps(f["value"], ensure_ascii=False)[1:-1]) == 1:
                moved[f["category"]] += 1
            else:
                misses.append((e["id"], f["category"], f["value"]))
        # precision inside dynamic prompts too: nothing but the fields moved
        assert sorted(got) == sorted(f["value"] for f in e["fields"]), e["id"]
        assert len(tail.strip().split("\n")) == len(e["fields"]) + 2, e["id"]
    report = "\n".join(f"  {c:<16} {moved[c]:>3}/{total[c]:<3} {100 * moved[c] / total[c]:5.1f}%"
                       for c in sorted(total))
    print(f"\nnormalize recall per category ({len(CORPUS['dynamic'])} prompts, "
          f"{sum(total.values())} fields):\n{report}")
    assert not misses, misses


def test_requests_differing_in_their_fields_match_up_to_the_tail():
    n = normalizer()
    for e in CORPUS["dynamic"]:
        a, b = chat(e["text"]), chat(e["alt_text"])
        n.normalize(a)
        n.normalize(b)
        assert head_of(a) == head_of(b), e["id"]
        assert tail_of(a) != tail_of(b), e["id"]


def test_static_look_alikes_pass_byte_identical():
    n = normalizer()
    touched = []
    for _ in range(3):                      # repeats teach the learner nothing either
        for e in CORPUS["static"]:
            body = chat(e["text"])
            if n.normalize(body) or body != chat(e["text"]):
                touched.append(e["id"])
    hard = collections.Counter(h for e in CORPUS["static"] for h in e["hard"])
    print(f"\nnormalize precision: {len(CORPUS['static']) - len(set(touched))}/"
          f"{len(CORPUS['static'])} static prompts byte-identical; hard cases {dict(hard)}")
    assert not touched, sorted(set(touched))


def _learn_run(entry: dict, n: Normalizer) -> tuple[int | None, list[dict]]:
    """Feed the template's requests; return the first request (1-based) from which every
    dynamic span is out of the head, and the bodies."""
    converged, bodies = None, []
    for r, text in enumerate(entry["requests"]):
        body = chat(text)
        moved = n.normalize(body)
        bodies.append(body)
        system = body["messages"][0]["content"]
        assert not {m["value"] for m in moved} & set(entry["constants"]), (entry["id"], r)
        assert all(c in system for c in entry["constants"]), (entry["id"], r)
        words = set(scan(PLACEHOLDER.sub("", system))[2])     # the head's digit-bearing words
        out = all(d["values"][r] not in words and d["values"][r] in tail_of(body)
                  for d in entry["dynamic"])
        if out and converged is None:
            converged = r + 1
        assert out or converged is None, f"{entry['id']}: unlearned again at request {r + 1}"
    return converged, bodies


def test_learner_converges_within_8_requests_and_keeps_constants():
    lines = []
    for entry in CORPUS["learn"]:
        assert 2 <= len(entry["dynamic"]) <= 4
        converged, bodies = _learn_run(entry, normalizer())
        lines.append(f"  {entry['id']:<16} {len(entry['dynamic'])} spans: request {converged}")
        assert converged is not None and converged <= MAX_REQUESTS_TO_LEARN, entry["id"]
        heads = {json.dumps(head_of(b), ensure_ascii=False) for b in bodies[converged - 1:]}
        assert len(heads) == 1, entry["id"]        # converged: one prefix for every request
    print("\nnormalize learner, first request with every span moved:\n" + "\n".join(lines))


def test_learner_never_learns_a_span_that_stays_constant():
    n = normalizer()
    for entry in CORPUS["learn"]:
        for _ in range(MAX_REQUESTS_TO_LEARN):      # the same request over and over
            body = chat(entry["requests"][0])
            assert n.normalize(body) == [] and body == chat(entry["requests"][0]), entry["id"]


# --- through the gateway -----------------------------------------------------------------------
def _one_per_category() -> list[dict]:
    seen, out = set(), []
    for e in CORPUS["dynamic"]:
        new = {f["category"] for f in e["fields"]} - seen
        if new:
            seen |= new
            out.append(e)
    return out


async def test_gateway_upstream_receives_each_category_at_the_tail(make_standin, make_gateway):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"normalize": {}}]})
    entries = _one_per_category()
    static = CORPUS["static"][:5]
    async with aiohttp.ClientSession() as client:
        for body in [chat(e["text"]) for e in entries] + [chat(e["text"]) for e in static]:
            async with client.post(gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                await r.read()
    sent = [r["json"]["messages"] for r in up.requests]
    for e, msgs in zip(entries, sent):
        system, user = msgs[0]["content"], msgs[-1]["content"]
        assert user.startswith(USER + "\n\n" + OPEN) and user.endswith(CLOSE), e["id"]
        for f in e["fields"]:
            assert f["value"] not in system and f["value"] in user.split(OPEN)[1], (e["id"], f)
    for e, msgs in zip(static, sent[len(entries):]):
        assert msgs == chat(e["text"])["messages"], e["id"]


async def test_gateway_learns_a_template_and_the_upstream_sees_one_prefix(make_standin,
                                                                          make_gateway):
    up = await make_standin(tokens=2)
    gw = await make_gateway({"upstreams": [{"name": "a", "url": up.url}],
                             "plugins": [{"normalize": {}}]})
    entry = max(CORPUS["learn"], key=lambda e: len(e["dynamic"]))
    async with aiohttp.ClientSession() as client:
        for text in entry["requests"]:
            async with client.post(gw.url + "/v1/chat/completions", json=chat(text)) as r:
                assert r.status == 200
                await r.read()
    systems = [r["json"]["messages"][0]["content"] for r in up.requests]
    assert len(set(systems[MAX_REQUESTS_TO_LEARN // 2:])) == 1
    last = up.requests[-1]["json"]["messages"][-1]["content"]
    assert all(d["values"][-1] in last.split(OPEN)[1] for d in entry["dynamic"])


@pytest.mark.parametrize("seed", [1, 2])
def test_other_seeds_of_the_generator_hold_too(seed):
    """The committed corpus is one seed; fresh ones must pass as well (nothing tuned to lines)."""
    corpus = _generator().generate(seed)
    n = normalizer()
    for e in corpus["dynamic"]:
        got = sorted(m["value"] for m in n.normalize(chat(e["text"])))
        assert got == sorted(f["value"] for f in e["fields"]), e["id"]
    for e in corpus["static"]:
        assert n.normalize(chat(e["text"])) == [], e["id"]


# Held-out seeds of the generator (none of them is the committed corpus) whose prompts each once
# held a field normalize missed: a label read with its own last words as the value's ("Current
# date and time 2026-03-17T11:19:09", seeds 47 113 132 171 174 207) and ids with no digit
# under an id label ("[空间ID: t_aefdfeea]", "Thread ID → conv_cdcfaacea", seeds 41 324 453 522
# 711 841 912). A sweep of seeds 0-999 passes whole.
HELD_OUT_SEEDS = [41, 47, 113, 132, 171, 174, 207, 324, 453, 522, 711, 841, 912]


@pytest.mark.parametrize("seed", HELD_OUT_SEEDS)
def test_held_out_seeds_that_once_missed_a_field(seed):
    test_other_seeds_of_the_generator_hold_too(seed)
