"""Prompt-lookup speculative decoding (backend/spec_decode.py) through `LLMEngine`: greedy
exactness, and where a sequence ends.

Tiny random Llama and Qwen2 checkpoints run through `LLMEngine` with and without
`speculative_config`, in float32 on the CPU (deterministic, so greedy outputs can be compared
token for token):
- greedy decoding gives exactly the tokens it gives without drafts: batched mixed-length
  prompts, chunked prefill, whole-prompt prefill, prefix-cache hits, and preemption; and
  drafts never take the step budget a plain decode of the same step needs;
- max_tokens, EOS / stop_token_ids and stop strings that land inside an accepted draft, and
  max_model_len end a sequence where they would without drafts (tokens, text, counts, reason).
Every engine test also checks that drafts really were made, some accepted and some rejected, so
none of them passes without speculation happening, and that every KV block is free at the end.
The engines keep the cost fit they time on this CPU (a sequence whose acceptance falls under
its bar then pauses mid-run: exactness must hold through that too), except where a test needs
drafting to depend on the tokens alone (`FixedCost`).
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from prefixgate.common.tokenizer import IncrementalDecoder
from tests.engine.helpers import (
    SPEC,
    Result,
    assert_same,
    assert_speculated,
    generate,
    greedy,
    make_engine,
    prompt_of,
    quoting_prompt,
    record_drafts,
    run_both,
)
from tests.helpers import VOCAB_SIZE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------
# greedy: exactly the tokens of plain decoding


def test_batched_greedy_matches_plain_decoding(model):
    lengths = [3, 9, 17, 30, 47, 64, 90]
    reqs = {f"r{n}": ((quoting_prompt if i % 2 else prompt_of)(n, seed=n), greedy(24 + 3 * i))
            for i, n in enumerate(lengths)}
    plain, spec, e, drafts = run_both(model, reqs)
    assert_same(plain, spec)
    assert all(len(r.tokens) == reqs[k][1].max_tokens for k, r in spec.items())
    assert_speculated(e, drafts)
    # steps did add several tokens (accepted drafts)
    assert any(len(r.tokens) > len(r.steps) for r in spec.values())


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_greedy_matches_with_split_prefill(model, chunked):
    # A budget of 16 tokens: prompts of 40-75 tokens take several steps to prefill, next to
    # decodes that carry drafts (which share the same budget).
    reqs = {f"r{i}": (quoting_prompt(40 + 7 * i, seed=50 + i), greedy(30)) for i in range(6)}
    plain, spec, e, drafts = run_both(model, reqs, max_num_batched_tokens=16,
                                      enable_chunked_prefill=chunked)
    assert_same(plain, spec)
    assert_speculated(e, drafts)
    assert all(1 + d.num_draft <= 16 for d in drafts)


def test_drafts_never_crowd_out_other_decodes(model):
    """With a step budget of 8 tokens and 4 decoding sequences, drafts get only what the plain
    decodes leave: every decoding sequence gets a token in every step."""
    reqs = {f"r{i}": ([5 + i] * 12, greedy(30)) for i in range(4)}
    e = make_engine(model, SPEC, max_num_batched_tokens=8)
    drafts = record_drafts(e)
    for rid, (prompt, params) in reqs.items():
        e.add_request(rid, prompt, params)
    out = {rid: [] for rid in reqs}
    while e.has_work():
        decoding = {s.request_id for s in e.scheduler.running if s.num_uncomputed_tokens == 1}
        got = e.step()
        assert decoding <= {o.request_id for o in got}, "a decode was left out of the step"
        for o in got:
            out[o.request_id] += o.token_ids
    assert out == {rid: r.tokens for rid, r in generate(make_engine(model), reqs).items()}
    assert_speculated(e, drafts)


def test_greedy_matches_on_prefix_cache_hits(model):
    base = [quoting_prompt(80, seed=s) for s in (1, 2)]
    first = {f"a{i}": (p + prompt_of(5, seed=10 + i), greedy(24)) for i, p in enumerate(base)}
    # Second wave: 64 shared tokens (4 full blocks) plus new tails; one also shares the first
    # wave's generated text (its prompt is a first-wave prompt plus that output).
    second = {f"b{i}": (base[i % 2][:64] + quoting_prompt(12 + i, seed=20 + i), greedy(24))
              for i in range(4)}

    def waves(e):
        drafts = record_drafts(e) if e.speculator else None
        out = generate(e, first)
        out |= generate(e, second)
        follow = {"c": (first["a0"][0] + out["a0"].tokens, greedy(20))}
        out |= generate(e, follow)
        assert e.stats()["prefix_hits"] >= 4 * 64 + 80     # the second wave's and c's prefixes
        return out, drafts

    plain, _ = waves(make_engine(model))
    e = make_engine(model, SPEC)
    spec, drafts = waves(e)
    assert_same(plain, spec)
    assert_speculated(e, drafts)


def test_greedy_matches_under_preemption(model):
    # 12 blocks of 16 tokens: four 80-token sequences cannot all hold their KV at once.
    reqs = {f"r{i}": (quoting_prompt(40, seed=200 + i), greedy(40)) for i in range(4)}
    plain, spec, e, drafts = run_both(model, reqs, num_kv_blocks=12, max_num_batched_tokens=64)
    assert_same(plain, spec)
    assert e.stats()["preemptions"] > 0
    assert_speculated(e, drafts)


# ------------------------------------------------------------------------------------------
# where a sequence ends


def test_max_tokens_is_exact_and_drafts_never_pass_it(model):
    reqs = {f"m{m}": (quoting_prompt(30, seed=300 + m), greedy(m)) for m in range(1, 13)}
    reqs |= {f"x{m}": (quoting_prompt(25, seed=400 + m), greedy(m)) for m in (17, 23, 31)}
    plain, spec, e, drafts = run_both(model, reqs)
    assert_same(plain, spec)
    for rid, (_, params) in reqs.items():
        assert spec[rid].completion_tokens == len(spec[rid].tokens) == params.max_tokens
        assert spec[rid].finish_reason == "length"
    assert_speculated(e, drafts)
    # every draft left room for the token the target adds after it; some filled that room
    assert all(d.num_output + d.num_draft + 1 <= d.max_tokens for d in drafts)
    assert any(d.num_output + d.num_draft + 1 == d.max_tokens for d in drafts)


def test_max_model_len_is_respected(model):
    reqs = {f"r{n}": (quoting_prompt(n, seed=500 + n), greedy(200)) for n in (20, 27, 33, 41, 50)}
    # The drafts that must fill the context come last, after 14-44 decode steps: with the bar
    # of the cost fit timed here, sequences whose drafts fail pause by then (on a busy CPU a
    # fit tipped by a preempted step pauses them all), so no bar here: drafts whenever the
    # n-gram matches.
    no_bar = dataclasses.replace(SPEC, min_acceptance_rate=0.0)
    plain, spec, e, drafts = run_both(model, reqs, no_bar, fixed_cost=True, max_model_len=64)
    assert_same(plain, spec)
    for rid, (prompt, _) in reqs.items():
        assert len(prompt) + spec[rid].completion_tokens == 64
        assert spec[rid].finish_reason == "length"
    assert_speculated(e, drafts)
    assert all(d.length + d.num_draft + 1 <= 64 for d in drafts)
    assert any(d.length + d.num_draft + 1 == 64 for d in drafts)


# Drafts for every batch size (no cap: the default), no bar (min_acceptance_rate 0 and a cost
# fit that is not fed: `FixedCost`) and blocks to spare: a sequence's drafts then depend on its
# own tokens only, not on step timings, so a run with a stop added drafts exactly as the run
# without it, up to the stop.
FREE_SPEC = dataclasses.replace(SPEC, min_acceptance_rate=0.0)
FREE_KV_BLOCKS = 1024
FREE = dict(num_kv_blocks=FREE_KV_BLOCKS, fixed_cost=True)


def _drafted_positions(result: Result) -> list[int]:
    """Output positions of tokens that came from an accepted draft with tokens after it in the
    same step (every token of a step but its last)."""
    pos, out = 0, []
    for step in result.steps:
        out += range(pos, pos + len(step) - 1)
        pos += len(step)
    return out


@pytest.fixture(scope="module")
def free_run(model):
    """Greedy outputs with drafts and no stop condition, to place stops inside accepted drafts.

    Drafted tokens are copies of earlier ones, so for a token to arrive first in the output
    inside a draft the draft must copy from the prompt: each prompt here is a base prompt plus
    the first 20 tokens the model wrote after it, and the loop the model had settled into is
    then drafted from the prompt as the model goes on writing it."""
    base = {f"p{i}": ((prompt_of if i % 2 else quoting_prompt)(10 + 3 * (i % 16), seed=900 + i),
                      greedy(20)) for i in range(40)}
    e = make_engine(model, FREE_SPEC, **FREE)
    first = generate(e, base)
    reqs = {rid: (prompt + first[rid].tokens, greedy(48)) for rid, (prompt, _) in base.items()}
    results = generate(make_engine(model, FREE_SPEC, **FREE), reqs)
    return reqs, results, e.tokenizer


def _first_in_draft(r: Result, avoid=frozenset()):
    """(position, token) of the first token that occurs first in the output inside an accepted
    draft, none of `avoid` before it; None if there is none."""
    for pos in _drafted_positions(r):
        tok = r.tokens[pos]
        if tok not in r.tokens[:pos] and tok not in avoid and not set(avoid) & set(r.tokens[:pos]):
            return pos, tok
    return None


def _assert_cut_in_a_draft(stopped: Result, free: Result, pos: int) -> None:
    """`stopped` went as `free` did up to the step that produced token `pos`, and that step,
    which in `free` went on past `pos` (tokens accepted after it), ends at `pos`."""
    done, steps = 0, []
    for step in free.steps:
        if done + len(step) > pos:
            assert done + len(step) > pos + 1           # the stop is not the step's last token
            steps.append(step[:pos + 1 - done])
            break
        steps.append(step)
        done += len(step)
    assert stopped.steps == steps


def _assert_stopped_in_drafts(spec, results, cases) -> None:
    """Each case's output ends at its stop position (inside an accepted draft), as "stop"."""
    for rid, (pos, _) in cases.items():
        assert spec[rid].tokens == results[rid].tokens[:pos + 1]
        assert spec[rid].finish_reason == "stop" and spec[rid].completion_tokens == pos + 1
        _assert_cut_in_a_draft(spec[rid], results[rid], pos)


def test_stop_token_inside_an_accepted_draft_ends_there(model, free_run):
    reqs, results, _ = free_run
    cases = {rid: c for rid, r in results.items() if (c := _first_in_draft(r))}
    assert len(cases) >= 3, "too few drafted stops to test"
    # (a second stop id, never produced, so the list is really searched)
    stopped = {rid: (reqs[rid][0], greedy(48, stop_token_ids=[VOCAB_SIZE + 7, tok]))
               for rid, (_, tok) in cases.items()}
    plain, spec, e, drafts = run_both(model, stopped, FREE_SPEC, **FREE)
    assert_same(plain, spec)
    _assert_stopped_in_drafts(spec, results, cases)
    assert_speculated(e, drafts)


def test_eos_inside_an_accepted_draft_ends_there(model, free_run, tmp_path):
    reqs, results, tokenizer = free_run
    eos = frozenset(tokenizer.eos_token_ids)
    # Every chosen token becomes an EOS id of the model, for all its requests at once: choose
    # them so that none occurs in another chosen request's output before that one's stop.
    cases: dict[str, tuple[int, int]] = {}
    for rid, r in results.items():
        chosen = {tok for _, tok in cases.values()}
        c = _first_in_draft(r, avoid=eos | chosen)
        if c and all(c[1] not in results[o].tokens[:p] for o, (p, _) in cases.items()):
            cases[rid] = c
    assert len(cases) >= 2, "too few drafted EOS positions to test"
    eos_dir = tmp_path / "eos"                  # the same weights, with more EOS ids
    shutil.copytree(model, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    config["eos_token_id"] = sorted(eos | {tok for _, tok in cases.values()})
    (eos_dir / "config.json").write_text(json.dumps(config))
    stopped = {rid: (reqs[rid][0], greedy(48, ignore_eos=False)) for rid in cases}
    stopped["ignoring"] = (reqs[next(iter(cases))][0], greedy(48))      # ignore_eos=True
    plain, spec, e, drafts = run_both(eos_dir, stopped, FREE_SPEC, **FREE)
    assert_same(plain, spec)
    _assert_stopped_in_drafts(spec, results, cases)
    assert spec["ignoring"].tokens == results[next(iter(cases))].tokens
    assert spec["ignoring"].finish_reason == "length"
    assert_speculated(e, drafts)


def test_stop_string_inside_an_accepted_draft_cuts_there(model, free_run):
    """Stop strings first completed by a token inside an accepted draft: one that is that
    token's whole text, and one that straddles it and the token before."""
    reqs, results, tokenizer = free_run
    cases = {}
    for rid, r in results.items():
        dec = IncrementalDecoder(tokenizer)
        pieces = [dec.push(t) for t in r.tokens]
        for pos in _drafted_positions(r):
            before = "".join(pieces[:pos])
            for kind, stop in (("whole", pieces[pos]), ("straddle", before[-1:] + pieces[pos][:1])):
                if len(stop) < (2 if kind == "straddle" else 1) or "\ufffd" in stop:
                    continue
                at = (before + pieces[pos]).find(stop)
                if before.find(stop) == -1 and at != -1:     # first completed by token `pos`
                    cases.setdefault(f"{rid}/{kind}", (rid, stop, pos, before[:at]))
    assert sum(k.endswith("/whole") for k in cases) >= 2, "too few drafted stop strings to test"
    assert sum(k.endswith("/straddle") for k in cases) >= 2, "too few drafted stop strings to test"
    # (with a longer stop string that never occurs: text is held back by its length - 1)
    stopped = {key: (reqs[rid][0], greedy(48, stop=["\x00never occurs", stop]))
               for key, (rid, stop, _, _) in cases.items()}
    plain, spec, e, drafts = run_both(model, stopped, FREE_SPEC, **FREE)
    assert_same(plain, spec)
    for key, (rid, stop, pos, text) in cases.items():
        assert spec[key].text == text and stop not in spec[key].text
        assert spec[key].completion_tokens == pos + 1 == len(spec[key].tokens)
        assert spec[key].tokens == results[rid].tokens[:pos + 1]
        assert spec[key].finish_reason == "stop"
        _assert_cut_in_a_draft(spec[key], results[rid], pos)
    assert_speculated(e, drafts)

