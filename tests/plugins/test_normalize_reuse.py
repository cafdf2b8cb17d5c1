"""The fast paths of normalize give exactly what the plain ones give.

`suffix_reuse` (reusing the analysis of a text that ends the same way) must equal a full
analysis for any edit anywhere, and `code_spans` must equal its reference regex.
"""
from __future__ import annotations

import random

import pytest
import yaml

from prefixgate.common.schema import check
from prefixgate.plugins.normalize import detectors
from prefixgate.plugins.normalize.learner import template_key
from prefixgate.plugins.normalize.plugin import SPEC, Normalizer
from prefixgate.plugins.normalize.suffix_reuse import reuse
from tests.helpers import DATA

CORPUS = yaml.safe_load((DATA / "prompts.yaml").read_text("utf-8"))
GENERATED = yaml.safe_load((DATA / "normalize_corpus.yaml").read_text("utf-8"))
TEXTS = [e["text"] for e in CORPUS["dynamic"] + CORPUS["static"]] + \
    [e["text"] for e in GENERATED["dynamic"][:60] + GENERATED["static"][:60]]
INSERTS = ["Current time: 2026-03-15 14:22:31\n", "Request ID: req_77aa01\n",
           "今天是2026年3月16日，", "```\ncode 12:00\n", "`inline 7`", "\n", " v1.2.3 ", "now 9:05",
           "x", "", "Session 550e8400-e29b-41d4-a716-446655440000 ", "<tools>{\"a\": 1}</tools>",
           "~~~\n", "当前时间：", "99", ": ", "requestId=", "| 订单号 | ", "【会话ID】",
           "## Examples\n", "Example:\n", "\"", "e.g. "]


def _long_text(rng: random.Random) -> str:
    """Several corpus prompts glued together: long enough for reuse, full of look-alikes."""
    return "\n".join(rng.sample(TEXTS, 20)) + "\n" + "Be brief. Rule 7 applies.\n" * 60


def _edit(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(0, len(text))
        j = min(len(text), i + rng.choice([0, 0, 1, 5, 30]))
        text = text[:i] + rng.choice(INSERTS) + text[j:]
    return text


def _full(n: Normalizer, text: str):
    code = detectors.code_spans(text)
    toks, statics, values = detectors.scan(text)
    return toks, template_key(statics), values, n.detector.candidates(text, toks, code)


@pytest.mark.parametrize("seed", range(4))
def test_reused_analysis_equals_a_full_one(seed):
    rng = random.Random(seed)
    n = Normalizer(check({}, SPEC))
    reused = 0
    for _ in range(25):
        base = _long_text(rng)
        for _ in range(4):
            text = _edit(rng, base) if rng.random() < 0.7 else (
                rng.choice(INSERTS) + base[rng.randint(0, 40):])
            code, old_code = detectors.code_spans(text), detectors.code_spans(base)
            old_toks, old_statics, old_values = detectors.scan(base)
            old_found = n.detector.candidates(base, old_toks, old_code)
            got = reuse(text, code, base, old_toks, old_statics, old_values, old_found, old_code,
                        n.detector)
            full = _full(n, text)
            if got is not None:
                reused += 1
                toks, statics, values, found = got
                assert (toks, template_key(statics), values, found) == full
            # and through the normaliser, whichever path it takes
            n._scan(base, old_code)
            toks, statics, values, found = n._scan(text, code)
            assert (toks, template_key(statics), values, found) == full
            base = text if rng.random() < 0.5 else base
    assert reused > 25          # the fast path really ran


def test_normalising_long_prompts_with_reuse_equals_without():
    def body(t):
        system = f"Current time: 2026-03-15 14:{t:02d}:00\n" + "Rule 7: be brief, v1.2.3.\n" * 400
        return {"messages": [{"role": "system", "content": system},
                             {"role": "user", "content": "q"}]}

    n = Normalizer(check({}, SPEC))
    for t in range(5):
        a, b = body(t), body(t)
        assert n.normalize(a) == Normalizer(check({}, SPEC)).normalize(b)
        assert a == b
    assert len(n.recent) == 1               # one ending seen: one reuse base, refreshed


def test_code_spans_equal_the_reference_regex():
    rng = random.Random(0)
    pieces = ["`", "```", "~~~", "<tools>", "</tools>", "<functions>", "x", "\n", " ", "~", "<",
              "y z", "</functions>"]
    texts = TEXTS + ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
                     for _ in range(2000)]
    for t in texts:
        assert detectors.code_spans(t) == [m.span() for m in detectors._CODE.finditer(t)], t


def test_common_suffix_equals_a_character_by_character_count():
    from prefixgate.plugins.normalize.suffix_reuse import BLOCK, common_suffix

    def naive(a: str, b: str) -> int:
        k = 0
        while k < min(len(a), len(b)) and a[-1 - k] == b[-1 - k]:
            k += 1
        return k

    rng = random.Random(3)
    for _ in range(3000):
        tail = "".join(rng.choice("ab\n") for _ in range(rng.choice([0, 1, 7, BLOCK - 1, BLOCK,
                                                                     BLOCK + 1, 3 * BLOCK + 5])))
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40))) + tail
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40))) + tail
        assert common_suffix(a, b) == naive(a, b), (a[-20:], b[-20:])
