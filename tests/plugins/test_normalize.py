"""normalize, the pure part: the corpus, pairs, idempotence, learning, limits, config."""
from __future__ import annotations

import copy
import json

import pytest
import yaml

from prefixgate.common.schema import ConfigError
from prefixgate.plugins.normalize.learner import Learner
from prefixgate.plugins.normalize.plugin import CLOSE, OPEN
from prefixgate.proxy.app import Gateway
from prefixgate.proxy.config.gateway import validate
from tests.helpers import DATA
from tests.plugins.helpers import normalizer

CORPUS = yaml.safe_load((DATA / "prompts.yaml").read_text("utf-8"))
DYNAMIC = {e["id"]: e for e in CORPUS["dynamic"]}
STATIC = {e["id"]: e for e in CORPUS["static"]}
USER = "Please help me with my question about the rules above."


def chat(system: str, user: str = USER, **extra) -> dict:
    return {"model": "standin-model", "messages": [{"role": "system", "content": system},
                                       {"role": "user", "content": user}], **extra}


def all_text(body: dict) -> str:
    out = []
    for m in body["messages"]:
        c = m["content"]
        out.append(c if isinstance(c, str) else "".join(p.get("text", "") for p in c))
    return "\n".join(out)


def head(body: dict) -> list:
    """Everything the model reads before the tail block."""
    msgs = copy.deepcopy(body["messages"])
    last = msgs[-1]
    if last["role"] == "user" and OPEN in last["content"]:
        last["content"] = last["content"][:last["content"].index(OPEN)]
    return msgs


def test_corpus_is_big_enough_and_sane():
    assert len(DYNAMIC) >= 30 and len(STATIC) >= 30
    for e in DYNAMIC.values():
        assert len(e["values"]) == len(e["alt"]), e["id"]
        for v in e["values"]:
            assert e["text"].count(v) == 1, (e["id"], v)


@pytest.mark.parametrize("pid", sorted(DYNAMIC))
def test_every_dynamic_value_moves_and_reaches_the_model_once(pid):
    e = DYNAMIC[pid]
    body = chat(e["text"])
    moved = normalizer().normalize(body)
    assert [m["value"] for m in moved] == e["values"]
    system, user = body["messages"][0]["content"], body["messages"][1]["content"]
    assert user.startswith(USER + "\n\n" + OPEN) and user.endswith(CLOSE)
    for v in e["values"]:
        assert v not in system
        assert all_text(body).count(v) == 1
    # the tail holds only what moved: one line per value, nothing else
    tail = user[user.index(OPEN) + len(OPEN):-len(CLOSE)].strip().split("\n")
    assert len(tail) == len(e["values"])
    assert all(v in line for v, line in zip(e["values"], tail))


@pytest.mark.parametrize("pid", sorted(DYNAMIC))
def test_requests_differing_only_in_dynamic_values_match_up_to_the_tail(pid):
    e = DYNAMIC[pid]
    other = e["text"]
    for v, alt in zip(e["values"], e["alt"]):
        other = other.replace(v, alt)
    n = normalizer()
    a, b = chat(e["text"]), chat(other)
    n.normalize(a)
    n.normalize(b)
    assert json.dumps(head(a), ensure_ascii=False) == json.dumps(head(b), ensure_ascii=False)
    assert a != b                          # the values themselves still differ, at the tail


@pytest.mark.parametrize("pid", sorted(STATIC))
def test_static_prompts_pass_byte_identical(pid):
    body = chat(STATIC[pid]["text"])
    before = json.dumps(body, ensure_ascii=False)
    n = normalizer()
    for _ in range(4):                     # repeated requests teach the learner nothing either
        assert n.normalize(body) == []
    assert json.dumps(body, ensure_ascii=False) == before


@pytest.mark.parametrize("pid", ["zh-time-head", "en-many-fields", "en-bullet-list"])
@pytest.mark.parametrize("move_to", ["last_user", "system_tail"])
def test_normalising_twice_is_normalising_once(pid, move_to):
    n = normalizer(move_to=move_to)
    body = chat(DYNAMIC[pid]["text"])
    assert n.normalize(body)
    once = copy.deepcopy(body)
    assert n.normalize(body) == []
    assert body == once


def test_system_tail_appends_a_final_system_message():
    body = chat(DYNAMIC["zh-time-head"]["text"])
    normalizer(move_to="system_tail").normalize(body)
    assert body["messages"][1] == {"role": "user", "content": USER}
    last = body["messages"][-1]
    assert last["role"] == "system"
    assert last["content"] == f"{OPEN}\n当前时间：2026-03-15 14:22:31\n{CLOSE}"


def test_clause_is_cut_with_its_label_and_the_label_goes_to_the_tail():
    body = chat("当前时间是 2026-03-15 14:22:31，请根据以下规则回答…")
    normalizer().normalize(body)
    assert body["messages"][0]["content"] == "请根据以下规则回答…"
    moved = f"{OPEN}\n当前时间：2026-03-15 14:22:31\n{CLOSE}"
    assert body["messages"][1]["content"].endswith(moved)


def test_value_inside_a_sentence_becomes_a_numbered_placeholder():
    body = chat("It is now 14:22 UTC and the desk closes at 16:00 UTC.")
    normalizer().normalize(body)
    assert body["messages"][0]["content"] == "It is now ⟨1⟩ and the desk closes at 16:00 UTC."
    assert "⟨1⟩ now: 14:22 UTC" in body["messages"][1]["content"]


def test_text_parts_are_normalised_and_the_tail_is_a_new_part():
    body = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Request ID: r-5521ab"},
                                       {"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "hi"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]}]}
    moved = normalizer().normalize(body)
    assert [m["value"] for m in moved] == ["r-5521ab"]
    assert body["messages"][0]["content"] == [{"type": "text", "text": ""},
                                              {"type": "text", "text": "Be brief."}]
    assert body["messages"][1]["content"][-1] == {
        "type": "text", "text": f"{OPEN}\nRequest ID: r-5521ab\n{CLOSE}"}


def test_user_content_and_tools_are_left_alone_by_default():
    tools = [{"type": "function", "function": {"name": "at", "description":
              "Current time: 2026-03-15 14:22:31", "parameters": {"type": "object"}}}]
    user = "Current time: 2026-03-15 14:22:31. Session ID: 8a7b-6c5d"
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": user}], "tools": tools}
    before = copy.deepcopy(body)
    assert normalizer().normalize(body) == []
    assert body == before


def test_scan_first_reaches_into_the_first_user_message():
    body = {"messages": [{"role": "user", "content": "Current time: 2026-03-15 14:22:31\nhi"},
                         {"role": "assistant", "content": "hello"},
                         {"role": "user", "content": "what time is it?"}]}
    moved = normalizer(scan_first=1).normalize(body)
    assert [m["message"] for m in moved] == [0]
    assert body["messages"][0]["content"] == "hi"
    assert body["messages"][2]["content"].endswith(f"Current time: 2026-03-15 14:22:31\n{CLOSE}")


def test_detectors_and_bare_types_can_be_switched_off():
    text = "Current time: 2026-03-15 14:22:31\nSession 7c9e6679-7425-40de-944b-e07fc1f90ae7."
    assert [m["type"] for m in normalizer().normalize(chat(text))] == ["datetime", "uuid"]
    assert [m["type"] for m in normalizer(detectors=["uuid"]).normalize(chat(text))] == ["uuid"]
    assert [m["type"] for m in normalizer(bare=[]).normalize(chat(text))] == ["datetime"]


def test_custom_labels_and_rules():
    text = "Ticket: TCK-88123\nShift: night-4471\nYou are a helpdesk bot."
    assert normalizer().normalize(chat(text)) == []
    n = normalizer(labels={"id": ["ticket"]}, rules=[{"pattern": r"Shift: (?P<value>night-\d+)",
                                                     "label": "Shift"}])
    body = chat(text)
    assert [(m["label"], m["value"]) for m in n.normalize(body)] == [
        ("Ticket", "TCK-88123"), ("Shift", "night-4471")]
    assert body["messages"][0]["content"] == "You are a helpdesk bot."


def test_max_moves_bounds_the_tail():
    text = "\n".join(f"Request ID: r{i:04d}x" for i in range(10)) + "\nBe brief."
    body = chat(text)
    moved = normalizer(max_moves=3).normalize(body)
    assert len(moved) == 3
    assert body["messages"][1]["content"].count("Request ID") == 3
    assert "Request ID: r0003x" in body["messages"][0]["content"]


def test_texts_over_max_chars_are_left_alone():
    text = "Current time: 2026-03-15 14:22:31\n" + "Be brief. " * 50
    assert normalizer(max_chars=len(text)).normalize(chat(text))
    body = chat(text)
    assert normalizer(max_chars=len(text) - 1).normalize(body) == []
    assert body == chat(text)


# --- learned detection ---------------------------------------------------------------------

TEMPLATE = ("You are assisting customer #{cust} on plan Pro-3 (v2.1 rules, $29.99/mo).\n"
            "Ticket opened at {t}. Answer in under 120 words.")


def _learn_body(i: int) -> dict:
    return chat(TEMPLATE.format(cust=48213 + 7 * i, t=f"2026/03/15 09:{i:02d}"))


def test_learning_needs_values_seen_to_vary():
    n = normalizer()
    for _ in range(6):                       # the same request again and again: nothing varies
        assert n.normalize(_learn_body(0)) == []
    assert n.normalize(_learn_body(1)) == []     # two distinct values: not yet (learn_after 3)
    moved = n.normalize(_learn_body(2))
    assert [m["value"] for m in moved] == ["48227", "09:02"]     # the date never varied
    assert all(m["type"] == "learned" for m in moved)


def test_learned_values_move_and_pairs_match_up_to_the_tail():
    n = normalizer()
    for i in range(3):
        n.normalize(_learn_body(i))
    a, b = _learn_body(10), _learn_body(11)
    assert len(n.normalize(a)) == 2 and len(n.normalize(b)) == 2
    assert head(a) == head(b)
    system = a["messages"][0]["content"]
    assert "Pro-3" in system and "v2.1" in system and "$29.99" in system and "120" in system
    assert all_text(a).count("48283") == 1 and "48283" not in system


def test_learning_is_per_template_and_can_be_off():
    n = normalizer()
    for i in range(3):
        n.normalize(_learn_body(i))
    other = chat("Another template with number 48213 and 2026/03/15 09:00.")
    assert n.normalize(other) == []
    off = normalizer(learn=False)
    assert all(off.normalize(_learn_body(i)) == [] for i in range(6))


def test_learner_memory_is_bounded():
    learner = Learner(after=3, max_templates=8, max_slots=16)
    for t in range(200):
        for r in range(4):
            learner.observe(t, [f"{t}-{r}-{s}" for s in range(10)])
    templates, hashes = learner.size()
    assert templates == 8
    assert hashes <= 8 * 16 * 3
    assert learner.observe(999, ["1"] * 17) == frozenset()     # over max_slots: not learned
    assert 999 not in learner.templates


def test_normaliser_text_cache_is_bounded():
    n = normalizer(cache_texts=4, learn_templates=4)
    for i in range(50):
        n.normalize(chat(f"Template {'ab' * i}: ticket {i}"))
    assert len(n.cache) == 0                 # seen once: not worth caching
    assert len(n.seen_once) == 16 and len(n.learner.templates) == 4
    for i in range(50):
        for _ in range(2):
            n.normalize(chat(f"Static {'ab' * i}: v{i}"))
    assert len(n.cache) == 4 and len(n.seen_once) <= 16


# --- config ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad,key", [
    ({"move_to": "head"}, "move_to"),
    ({"detectors": ["datetime", "phone"]}, "detectors"),
    ({"bare": ["datetime"]}, "bare"),
    ({"learn_after": 1}, "learn_after"),
    ({"scan_first": -1}, "scan_first"),
    ({"rules": [{"pattern": "(unclosed"}]}, "rules[0].pattern"),
    ({"rules": [{"pattern": "x*"}]}, "rules[0].pattern"),
    ({"labels": {"time": [""]}}, "labels.time"),
    ({"learn": "yes"}, "learn"),
    ({"typo": 1}, "typo"),
])
def test_bad_config_names_the_key(bad, key):
    cfg = validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                    "plugins": [{"normalize": bad}]})
    with pytest.raises(ConfigError) as e:
        Gateway(cfg)
    assert e.value.path == f"plugins[0].normalize.{key}", str(e.value)


def test_empty_config_gives_safe_defaults():
    cfg = validate({"upstreams": [{"name": "a", "url": "http://127.0.0.1:9"}],
                    "plugins": [{"normalize": {}}]})
    gw = Gateway(cfg)
    plugin = gw.chain.plugins[0]
    assert plugin.cfg["move_to"] == "last_user" and plugin.cfg["learn"] is True
    assert plugin.cfg["roles"] == ["system", "developer"] and plugin.cfg["scan_first"] == 0
