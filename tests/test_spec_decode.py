"""Prompt-lookup speculative decoding (backend/spec_decode.py), end to end on real engines.

Tiny random Llama and Qwen2 checkpoints (tests/model_factory.py) run through `LLMEngine` with
and without `speculative_config`, in float32 on the CPU (deterministic, so greedy outputs can be
compared token for token):
- greedy decoding gives exactly the tokens it gives without drafts: batched mixed-length
  prompts, chunked prefill, whole-prompt prefill, prefix-cache hits, and preemption; and
  drafts never take the step budget a plain decode of the same step needs;
- max_tokens, EOS / stop_token_ids and stop strings that land inside an accepted draft, and
  max_model_len end a sequence where they would without drafts (tokens, text, counts, reason);
- with temperature > 0 the sampled tokens follow the same distribution with and without
  drafts (two-sample chi-square over hundreds of seeded requests), and `sampling.verify`'s
  accept/resample rule reproduces the target distributions on hand-made logits;
- the pure parts: `propose`, `parse_speculative_config`, `StepCost`'s fit of step time and its
  break-even acceptance rate, the `Speculator`'s probe, bar and pause (counted in drafts), and
  `disable_by_batch_size`, `BlockManager.truncate`; and that the engine feeds the cost fit.
Every engine test also checks that drafts really were made, some accepted and some rejected, so
none of them passes without speculation happening, and that every KV block is free at the end.
The engines keep the cost fit they time on this CPU (a sequence whose acceptance falls under
its bar then pauses mid-run: exactness must hold through that too), except where a test needs
drafting to depend on the tokens alone (`FixedCost`).
"""
from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from model_factory import VOCAB_SIZE, PagedCache, make_tiny_model

from prefixgate.backend import spec_decode
from prefixgate.backend.block_manager import BlockManager
from prefixgate.backend.config import (DEFAULT_DISABLE_BY_BATCH_SIZE, DEFAULT_MIN_ACCEPTANCE_RATE,
                                       EngineArgs, parse_speculative_config)
from prefixgate.backend.engine import LLMEngine
from prefixgate.backend.sampling import SamplingParams, verify
from prefixgate.backend.sequence import Sequence
from prefixgate.backend.spec_decode import NgramIndex, Speculator, StepCost, propose
from prefixgate.common.schema import ConfigError
from prefixgate.common.tokenizer import IncrementalDecoder

SPEC = parse_speculative_config({"num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 2})
BLOCK = 16


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]


def quoting_prompt(n: int, seed: int) -> list[int]:
    """`n` tokens made of a few random spans, each repeated: n-grams that recur (as in a prompt
    that quotes itself), so drafts are proposed from the first decode step on."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        span = prompt_of(rng.randrange(3, 9), rng.randrange(1 << 30))
        out += span * rng.randrange(1, 4)
    return out[:n]


# ------------------------------------------------------------------------------------------
# engine helpers


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tiny models gain nothing from two intra-op threads, and on a busy machine a second
    thread waiting for a core slows every op down tenfold or more (this module: ~7 s on one
    thread, minutes on two when other processes share the CPUs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-stat"), "llama")


class FixedCost(StepCost):
    """A step-cost fit that the engine's timings never reach: its break-even rate stays 0 at
    every batch size. With `min_acceptance_rate: 0` no sequence is ever paused, so what is
    drafted depends on the tokens alone, not on how fast this CPU ran each step."""

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass


def make_engine(model_dir, spec=None, fixed_cost=False, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("step_overhead_tokens", 0)
    e = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device="cpu",
                             block_size=BLOCK, speculative_config=spec, **kw))
    if fixed_cost and e.speculator is not None:
        e.speculator.cost = FixedCost()
    return e


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    steps: list[list[int]] = field(default_factory=list)     # the tokens each step added
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0


@dataclass
class Draft:
    """A drafted decode as the model runner was given it (seen before it ran)."""
    num_output: int
    length: int
    max_tokens: int
    num_draft: int


def record_drafts(engine: LLMEngine) -> list[Draft]:
    """Every draft the engine's runner computes from now on (the real runner still runs)."""
    seen: list[Draft] = []
    run = engine.runner.run

    def recording_run(batch):
        for seq, draft in zip(batch.seqs, batch.drafts):
            if draft:
                seen.append(Draft(seq.num_output_tokens, len(seq), seq.params.max_tokens, len(draft)))
        return run(batch)

    engine.runner.run = recording_run
    return seen


def generate(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    out = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
        out[rid] = Result()
    steps = 0
    while engine.has_work():
        for o in engine.step():
            r = out[o.request_id]
            r.tokens += o.token_ids
            r.steps.append(list(o.token_ids))
            r.text += o.text
            r.finish_reason, r.completion_tokens = o.finish_reason, o.completion_tokens
        steps += 1
        assert steps < 10_000, "engine stalled"
    return out


def greedy(max_tokens: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def assert_speculated(engine: LLMEngine, drafts: list[Draft] | None = None) -> dict:
    """Drafts were verified, some tokens accepted and some rejected; the counters agree with
    what the runner computed; and every block is free again now that all requests ended."""
    s = engine.spec_stats()
    assert s["num_drafts"] > 0
    assert 0 < s["num_accepted_tokens"] < s["num_draft_tokens"], s
    per_pos = s["num_accepted_tokens_per_pos"]
    assert sum(per_pos) == s["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos   # a prefix is accepted
    assert len(per_pos) == engine.args.speculative_config.num_speculative_tokens
    if drafts is not None:
        assert len(drafts) == s["num_drafts"]
        assert sum(d.num_draft for d in drafts) == s["num_draft_tokens"]
    assert not engine.has_work()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return s


def run_both(model_dir, requests, spec=SPEC, fixed_cost=False, **engine_kw):
    """The same requests through an engine without and one with speculation."""
    plain = generate(make_engine(model_dir, **engine_kw), requests)
    e = make_engine(model_dir, spec, fixed_cost, **engine_kw)
    drafts = record_drafts(e)
    return plain, generate(e, requests), e, drafts


def assert_same(plain: dict[str, Result], spec: dict[str, Result]) -> None:
    for rid in plain:
        a, b = plain[rid], spec[rid]
        assert b.tokens == a.tokens, f"{rid} diverged"
        assert (b.text, b.finish_reason, b.completion_tokens) == (a.text, a.finish_reason,
                                                                 a.completion_tokens), rid


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
    plain, spec, e, drafts = run_both(model, reqs, dataclasses.replace(SPEC, min_acceptance_rate=0.0),
                                      fixed_cost=True, max_model_len=64)
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


# ------------------------------------------------------------------------------------------
# temperature > 0: the same distribution


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): the regularized upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_two_sample(a: list, b: list, min_count: int = 10) -> tuple[float, int]:
    """Pearson's chi-square test of homogeneity of two samples of labels (a 2 x K table);
    labels seen fewer than `min_count` times in both samples together share one cell, so
    every expected count is at least min_count / 2 (equal sample sizes). (p-value, K)."""
    ca, cb = Counter(a), Counter(b)
    both = ca + cb
    big = [x for x in both if both[x] >= min_count]
    cells = [(ca[x], cb[x]) for x in big]
    rest = (sum(ca[x] for x in both if x not in big), sum(cb[x] for x in both if x not in big))
    if sum(rest):
        cells.append(rest)
    na, nb = len(a), len(b)
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    return (chi2_sf(stat, len(cells) - 1) if len(cells) > 1 else 1.0), len(cells)


def chi2_goodness_of_fit(samples: list[int], probs: list[float], min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that `samples` come from `probs` (cells expected
    fewer than `min_expected` times pooled)."""
    n, counts = len(samples), Counter(samples)
    cells, pooled = [], [0, 0.0]
    for x, p in enumerate(probs):
        if n * p >= min_expected:
            cells.append((counts[x], n * p))
        else:
            pooled[0] += counts[x]
            pooled[1] += n * p
    if pooled[1] > 0:
        assert pooled[1] >= min_expected or pooled[0] == 0, "pool too small for the test"
        cells.append(tuple(pooled))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return chi2_sf(stat, len(cells) - 1)


def test_chi2_helpers_reject_and_accept():
    # known values of the chi-square tail
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(16.266, 3) == pytest.approx(0.001, abs=1e-5)
    rng = random.Random(0)
    same = [rng.choices(range(4), [4, 3, 2, 1])[0] for _ in range(2000)]
    other = [rng.choices(range(4), [4, 3, 2, 1])[0] for _ in range(2000)]
    skewed = [rng.choices(range(4), [3, 3, 3, 1])[0] for _ in range(2000)]
    assert chi2_two_sample(same, other)[0] > 0.001
    assert chi2_two_sample(same, skewed)[0] < 1e-6
    assert chi2_goodness_of_fit(same, [0.4, 0.3, 0.2, 0.1]) > 0.001
    assert chi2_goodness_of_fit(skewed, [0.4, 0.3, 0.2, 0.1]) < 1e-6


# The tiny random model's logits have a standard deviation of ~0.8, so it needs a colder
# temperature than a trained model for the same sharpness: at 0.2 its top token has ~50% of
# the mass, and the drafts of the prompts chosen below are accepted about as often as not.
TEMPERATURE = 0.2
SEEDS = 400


@pytest.fixture(scope="module")
def coin_flip_prompts(llama):
    """Three prompts [k] * 8 whose drafts are coin flips at TEMPERATURE, found from the model's
    own distributions (one forward pass over every [k] * 9): the first token is k again often
    (then k has occurred before, and the draft is k, k, ...), and the chance of yet another k
    is near 1/2. That is where a wrong accept/resample rule shows most: resampling without
    removing the rejected token, or accepting 30% too eagerly or too rarely, moves P(k) by
    0.15-0.25 at every drafted position."""
    e = make_engine(llama)
    cache = PagedCache(e.model_config, num_blocks=VOCAB_SIZE, block_size=BLOCK)
    ks = list(range(3, VOCAB_SIZE))
    logits = cache.step(e.model, {k: [k] * 9 for k in ks})
    score = {}
    for k in ks:
        p_first, p_next = torch.softmax(logits[k][7:9].double() / TEMPERATURE, dim=-1)[:, k].tolist()
        score[k] = p_first * min(p_next, 1 - p_next)
    best = sorted(ks, key=score.get, reverse=True)[:3]
    assert score[best[-1]] > 0.05, "no prompt makes drafts coin flips for this model"
    return [[k] * 8 for k in best]


def test_sampling_with_drafts_keeps_the_distribution(llama, coin_flip_prompts):
    """Seeded requests at temperature 0.2, 400 per prompt, without drafts (seeds 0..399) and
    with them (seeds 1000..1399: independent samples). For each prompt and for all three
    together, the two samples of each output token, of each pair of neighbouring tokens and of
    the number of times the prompt's token comes back must not differ at the 0.001 level
    (Pearson's chi-square test of homogeneity). Checked by hand to catch, at this size, a
    resample that keeps the rejected token and acceptance 30% too eager or too rare (p < 1e-4);
    the exact rule is tested on hand-made logits below."""
    spec = parse_speculative_config({"num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3, "disable_by_batch_size": 10_000,
                                     "min_acceptance_rate": 0.0})
    prompts = coin_flip_prompts
    n = len(prompts) * SEEDS
    kw = dict(num_kv_blocks=2 * n + 64, max_num_seqs=n, max_num_batched_tokens=8192)

    def sample_all(spec_config, seed0):
        e = make_engine(llama, spec_config, **kw)
        reqs = {f"{j}/{s}": (p, SamplingParams(seed=seed0 + s, temperature=TEMPERATURE,
                                               max_tokens=5, ignore_eos=True))
                for j, p in enumerate(prompts) for s in range(SEEDS)}
        # greedy requests in the same batches: verified next to random ones
        reqs |= {f"greedy{i}": (quoting_prompt(30, seed=800 + i), greedy(12)) for i in range(8)}
        out = generate(e, reqs)
        assert all(len(r.tokens) == 5 for k, r in out.items() if not k.startswith("greedy"))
        return (e, [[out[f"{j}/{s}"].tokens for s in range(SEEDS)] for j in range(len(prompts))],
                {k: r.tokens for k, r in out.items() if k.startswith("greedy")})

    _, plain, plain_greedy = sample_all(None, 0)
    e, drafted, drafted_greedy = sample_all(spec, 1000)
    assert drafted_greedy == plain_greedy
    s = assert_speculated(e)
    assert s["num_drafts"] > n // 4
    assert 0.2 * s["num_draft_tokens"] < s["num_accepted_tokens"] < 0.8 * s["num_draft_tokens"]
    stats = [(f"token {i}", lambda j, o, i=i: o[i]) for i in range(5)]
    stats += [(f"tokens {i}-{i + 1}", lambda j, o, i=i: tuple(o[i:i + 2])) for i in range(4)]
    stats += [("number of the prompt's token", lambda j, o: o.count(prompts[j][-1]))]
    informative = 0
    for j in range(len(prompts)):
        for label, key in stats:
            p, cells = chi2_two_sample([key(j, o) for o in plain[j]], [key(j, o) for o in drafted[j]])
            assert p > 0.001, f"prompt {j}, {label}: p={p:.2g}"
            informative += cells >= 3
    assert informative >= 15      # the tests had categories to compare, not one lumped cell
    # The prompts together, labels tagged with their prompt: as many requests per prompt in
    # both samples, so this is still a test of homogeneity, on three times the data.
    flips = range(len(prompts))
    for label, key in stats:
        p, _ = chi2_two_sample([(j, key(j, o)) for j in flips for o in plain[j]],
                               [(j, key(j, o)) for j in flips for o in drafted[j]])
        assert p > 0.001, f"all prompts, {label}: p={p:.2g}"


def _softmax(row: list[float], t: float) -> list[float]:
    return torch.softmax(torch.tensor(row, dtype=torch.float64) / t, dim=-1).tolist()


def test_verify_accept_and_resample_follow_the_target():
    """Many sequences in one verify call, each owning three rows (after its last token and
    after each of its two draft tokens) and its own seeded generator: the first kept token
    follows p0, the second (given the first draft token was kept) follows p1, and the third
    (both kept) follows p2, whichever way each was reached (accepted, or resampled)."""
    t = 0.7
    rows = [[0.3, -0.2, 0.9, 0.0, -1.0, 0.4], [0.1, 0.8, -0.5, 0.6, 0.0, -0.3],
            [-0.4, 0.2, 0.5, 0.0, 1.1, -0.8]]
    draft = [2, 3]                      # p0(2) = 0.41, p1(3) = 0.27: accepted and rejected
    n = 12_000
    logits = torch.tensor(rows, dtype=torch.float32).repeat(n, 1)
    params = [SamplingParams(temperature=t)] * n
    gens = [torch.Generator().manual_seed(s) for s in range(n)]
    out = verify(logits, [draft] * n, params, gens)
    for toks in out:
        kept = len(toks) - 1
        assert toks[:kept] == draft[:kept] and 1 <= len(toks) <= 3
    p0, p1, p2 = (_softmax(r, t) for r in rows)
    assert chi2_goodness_of_fit([o[0] for o in out], p0) > 0.001
    after_d0 = [o[1] for o in out if o[0] == draft[0]]
    assert abs(len(after_d0) / n - p0[draft[0]]) < 0.02
    assert chi2_goodness_of_fit(after_d0, p1) > 0.001
    after_both = [o[2] for o in out if o[:2] == draft]
    assert len(after_both) > 500
    assert chi2_goodness_of_fit(after_both, p2) > 0.001
    # both paths were taken at each position
    first_kept = sum(o[0] == draft[0] for o in out)
    assert 0.2 * n < first_kept < 0.6 * n
    assert 0 < sum(o[:2] == draft for o in out) < len(after_d0)


def test_verify_respects_top_k_and_mixes_greedy_rows():
    t = 1.0
    rows = [[2.0, 1.5, 1.0, 0.9, -1.0], [0.0, 0.0, 3.0, 0.0, 0.0]]
    n = 4000
    # random sequences with top_k=2: their draft token (rank 3) can never be accepted, and the
    # replacement follows the top-2 renormalized distribution
    topk = SamplingParams(temperature=t, top_k=2)
    greedy_p = SamplingParams(temperature=0.0)
    drafts, params, gens, chunks = [], [], [], []
    for s in range(n):
        if s % 4 == 0:          # greedy rows among them, with a draft the argmax accepts
            drafts.append([0])
            params.append(greedy_p)
            gens.append(None)
        else:
            drafts.append([2])
            params.append(topk)
            gens.append(torch.Generator().manual_seed(s))
        chunks.append(torch.tensor(rows))
    out = verify(torch.cat(chunks), drafts, params, gens)
    for s, toks in enumerate(out):
        if s % 4 == 0:
            assert toks == [0, 2]        # row 0's argmax is the draft, row 1's argmax follows
        else:
            assert len(toks) == 1 and toks[0] in (0, 1)
    top2 = _softmax(rows[0][:2], t)
    assert chi2_goodness_of_fit([o[0] for s, o in enumerate(out) if s % 4], top2) > 0.001
    # a greedy draft that differs from the argmax is cut there, the argmax taking its place
    g = verify(torch.tensor(rows * 2), [[1], [0]], [greedy_p] * 2, [None] * 2)
    assert g == [[0], [0, 2]]


# ------------------------------------------------------------------------------------------
# the pure parts


def draft_of(tokens, lo, hi, k):
    return propose(tokens, NgramIndex(lo), hi, k)


def test_propose_longest_match_wins_then_latest():
    # the suffix (3, 4) occurred twice; only the first occurrence also matches the 1, 2 before it
    tokens = [1, 2, 3, 4, 50, 9, 3, 4, 60, 1, 2, 3, 4]
    assert draft_of(tokens, 2, 4, 2) == [50, 9]
    # with prompt_lookup_max=2 both occurrences match 2 tokens: the latest wins the tie
    assert draft_of(tokens, 2, 2, 2) == [60, 1]
    # with max 3 the first occurrence matches 3 tokens (2, 3, 4), the later one 2 (9 before it)
    assert draft_of(tokens, 2, 3, 3) == [50, 9, 3]
    # equal-length matches: the latest occurrence
    assert draft_of([7, 8, 1, 7, 8, 2, 7, 8, 3, 7, 8], 2, 5, 1) == [3]


def test_propose_continues_a_loop_and_stops_when_nothing_matches():
    # period 3: the copy runs into the suffix and goes on from what it already proposed
    assert draft_of([5, 6, 7, 5, 6, 7, 5, 6], 2, 4, 5) == [7, 5, 6, 7, 5]
    assert draft_of([4, 4, 4], 2, 2, 4) == [4, 4, 4, 4]        # period 1
    assert draft_of([9, 1, 2, 1, 2], 2, 3, 6) == [1, 2, 1, 2, 1, 2]
    assert draft_of([1, 2, 3, 4], 2, 4, 3) == []                # the suffix never occurred
    assert draft_of([3], 1, 1, 3) == []                          # shorter than the n-gram
    assert draft_of([1, 2, 9, 3, 2], 2, 4, 3) == []              # 2 occurred, (3, 2) did not
    assert draft_of([1, 2, 9, 3, 2], 1, 4, 3) == [9, 3, 2]      # ... 1-grams allowed: it did
    assert draft_of([1, 2, 3, 1, 2], 3, 3, 2) == []              # (3, 1, 2) never occurred


def test_propose_incremental_index_agrees_with_a_fresh_one():
    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(8)]
    index = NgramIndex(2)
    proposed = 0
    for _ in range(150):
        got = propose(tokens, index, 4, 5)
        assert got == draft_of(tokens, 2, 4, 5)
        assert len(got) in (0, 5)
        proposed += bool(got)
        tokens.append(got[0] if got and rng.random() < 0.7 else rng.randrange(6))
    assert proposed > 50


def test_parse_speculative_config_defaults_and_values():
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    c = parse_speculative_config({"num_speculative_tokens": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 5, 5)
    assert c.method == "ngram"
    assert c.disable_by_batch_size is None and c.min_acceptance_rate == 0.1     # no cap by default
    c = parse_speculative_config('{"num_speculative_tokens": 4, "prompt_lookup_max": 7}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (7, 7)
    c = parse_speculative_config({"num_speculative_tokens": 4, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "disable_by_batch_size": 8,
                                  "min_acceptance_rate": 1})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (1, 3, 8)
    assert c.min_acceptance_rate == 1.0 and isinstance(c.min_acceptance_rate, float)
    c = parse_speculative_config({"num_speculative_tokens": 1, "min_acceptance_rate": 0})
    assert c.min_acceptance_rate == 0.0


@pytest.mark.parametrize("raw, key", [
    ({}, "num_speculative_tokens"),
    ({"prompt_lookup_max": 3}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "5"}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": False}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),   # given alone
    ({"num_speculative_tokens": 2, "prompt_lookup_min": -1}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 2.5}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": True}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": -0.1}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": True}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": "0.5"}, "min_acceptance_rate"),
    ({"num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method"),
    ("{not json", ""),
    ("[1, 2]", ""),
    ('"ngram"', ""),
    ([("num_speculative_tokens", 2)], ""),
])
def test_parse_speculative_config_errors_name_the_key(raw, key):
    with pytest.raises(ConfigError) as err:
        parse_speculative_config(raw)
    assert err.value.key == key
    assert isinstance(err.value, ValueError)
    if key:
        assert str(err.value).startswith(f"{key}: ")


def _looping_seq() -> Sequence:
    return Sequence([7] * 12, SamplingParams(max_tokens=100))


def _feed(cost: StepCost, a: float, c: float, rounds: int = 4) -> None:
    """`rounds` decode steps of each of 1..6 tokens, each taking exactly a + c * tokens s."""
    for _ in range(rounds):
        for n in range(1, 7):
            cost.observe(n, a + c * n)


def _break_even(a: float, c: float, batch: int) -> float:
    return batch * c / (a + c * batch)


# A step cost under which a draft pays above 0.6 at batch 16: 16c / (a + 16c) = 0.6 for
# a = 32c / 3; at batch 1 the break-even rate, 3 / 35 = 0.086, is under the default floor (0.1).
A16, C16 = 0.032, 0.003


def _wls_break_even(obs: list[tuple[int, float]], batch: int) -> float:
    """The break-even rate from a weighted least-squares fit done independently of `StepCost`
    (torch's lstsq; the newest observation weighs 1, each older one _COST_DECAY times the next)."""
    m = len(obs)
    w = torch.tensor([spec_decode._COST_DECAY ** (m - 1 - i) for i in range(m)], dtype=torch.float64).sqrt()
    x = torch.tensor([[1.0, n] for n, _ in obs], dtype=torch.float64) * w[:, None]
    y = torch.tensor([[t] for _, t in obs], dtype=torch.float64) * w[:, None]
    a, c = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    return _break_even(max(a, 0.0), c, batch) if c > 0 else 0.0


def test_step_cost_recovers_the_break_even_rate():
    for a, c in ((0.02, 0.0015), (A16, C16), (0.05, 1e-6), (1e-4, 0.01)):
        cost = StepCost()
        _feed(cost, a, c, rounds=3)
        for b in (1, 2, 4, 16, 64, 1000):
            assert cost.break_even(b) == pytest.approx(_break_even(a, c, b), abs=1e-6), (a, c, b)
    cost = StepCost()
    _feed(cost, A16, C16)
    assert cost.break_even(16) == pytest.approx(0.6, abs=1e-9)
    assert cost.break_even(1) == pytest.approx(3 / 35, abs=1e-9)
    assert 0 < cost.break_even(1) < cost.break_even(4) < cost.break_even(16) < cost.break_even(64) < 1
    # only the step time's shape matters: the same steps twice as slow break even at the same rate
    slow = StepCost()
    _feed(slow, 2 * A16, 2 * C16)
    assert slow.break_even(16) == pytest.approx(0.6, abs=1e-9)


def test_step_cost_needs_enough_steps_of_different_sizes():
    a, c = 0.02, 0.0015
    cost = StepCost()
    assert cost.break_even(1) == cost.break_even(16) == 0.0
    for i in range(8):       # the weight of 8 steps: 1 + 0.995 + ... + 0.995**7 = 7.86 < 8
        cost.observe(1 + i % 6, a + c * (1 + i % 6))
        assert cost.break_even(16) == 0.0, i
    cost.observe(3, a + c * 3)          # 9 steps: 8.34
    assert cost.break_even(16) == pytest.approx(_break_even(a, c, 16), abs=1e-6)
    # steps all of one size, however many and however their times vary: no slope to fit (and
    # no slope made of rounding errors: some sizes leave the sums' spread at 1e-11, not 0)
    for size in (1, 5, 7, 255, 16):
        same = StepCost()
        for i in range(500):
            same.observe(size, 0.04 + 0.01 * (i % 3))
        assert same.break_even(1) == same.break_even(16) == 0.0, size
    # ... until steps of another size come
    for i in range(3):
        same.observe(20, 0.04 + 0.01 * (i % 3) + 0.02)
    assert same.break_even(16) > 0


def test_step_cost_without_a_positive_slope_is_free_and_clamps_the_intercept():
    falling = StepCost()                # more tokens, faster steps: drafts cost nothing measurable
    _feed(falling, 0.05, -0.002)
    assert falling.break_even(1) == falling.break_even(16) == falling.break_even(1000) == 0.0
    flat = StepCost()
    _feed(flat, 0.05, 0.0)
    assert flat.break_even(16) == pytest.approx(0.0, abs=1e-9)
    # a fitted intercept under 0 (here t = 0.004 * n - 0.002) counts as 0: time proportional to
    # tokens, so a draft token costs what it can win at any batch size
    proportional = StepCost()
    _feed(proportional, -0.002, 0.004)
    for b in (1, 16, 1000):
        assert proportional.break_even(b) == pytest.approx(1.0, abs=1e-12)


def test_step_cost_forgets_old_steps():
    """Each step's weight decays by 0.995 per newer one: after the machine's costs change, the
    fit follows the new ones within ~1,000 steps (a rise of cost a little per step: each step
    counts at most 1.25 times what the standing fit predicts)."""
    old, new = (0.01, 0.004), (0.03, 0.0005)
    cost = StepCost()

    def observe(a, c, k):
        for i in range(k):
            n = 1 + i % 6
            cost.observe(n, a + c * n)

    observe(*old, 1000)
    assert cost.break_even(16) == pytest.approx(_break_even(*old, 16), abs=1e-6)
    gap = _break_even(*old, 16) - _break_even(*new, 16)
    observe(*new, 20)
    assert cost.break_even(16) - _break_even(*new, 16) > 0.7 * gap     # moved < 30% of the way
    observe(*new, 980)
    assert 0 < cost.break_even(16) - _break_even(*new, 16) < 0.05 * gap     # > 95% of the way
    assert cost.break_even(1) == pytest.approx(_break_even(*new, 1), abs=0.005)


@pytest.mark.parametrize("tokens", [1, 6])
def test_step_cost_is_not_flipped_by_stalled_steps(tokens):
    """20 steps in a row stalled 10x by another process (a busy CPU) leave the break-even rate
    near its value; counted in full by plain least squares they flip it to 0 or 1 (the check
    that they would)."""
    cost, obs = StepCost(), []
    for i in range(300):
        n = 1 + i % 6
        cost.observe(n, A16 + C16 * n)
        obs.append((n, A16 + C16 * n))
    assert cost.break_even(16) == pytest.approx(0.6, abs=1e-6)
    for _ in range(20):
        stalled = (tokens, 10 * (A16 + C16 * tokens))
        cost.observe(*stalled)
        obs.append(stalled)
    assert 0.45 < cost.break_even(16) < 0.75
    assert _wls_break_even(obs, 16) < 0.05 or _wls_break_even(obs, 16) > 0.95


def test_speculator_first_draft_is_a_probe_at_the_bar():
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 5, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 2}))
    _feed(sp.cost, A16, C16)
    assert sp.bar(1) == DEFAULT_MIN_ACCEPTANCE_RATE == 0.1     # the floor: 0.086 is under it
    assert sp.bar(16) == pytest.approx(0.6, abs=1e-9)            # the break-even rate
    seq = _looping_seq()
    assert seq.spec is None
    # no draft verified yet: the first is a probe, drafted whatever the bar, its rate set there
    assert sp.draft(seq, 16, 5) == [7] * 5
    assert seq.spec.rate == pytest.approx(0.6, abs=1e-9) and seq.spec.bar == seq.spec.rate
    sp.record(seq, 5, 4)                # 0.6 + (0.8 - 0.6) / 2 = 0.7: over the bar, it goes on
    assert seq.spec.rate == pytest.approx(0.7, abs=1e-9)
    assert sp.draft(seq, 16, 5) == [7] * 5
    sp.record(seq, 5, 2)                # 0.7 + (0.4 - 0.7) / 2 = 0.55: under 0.6, it pauses
    assert (seq.spec.skip, seq.spec.pause) == (4, 8)
    assert seq.spec.rate == pytest.approx(0.6, abs=1e-9)    # back at the bar: the probe decides
    # a probe at batch 1 starts at that batch's bar
    first = _looping_seq()
    assert sp.draft(first, 1, 5) == [7] * 5 and first.spec.rate == 0.1


def test_speculator_bar_rises_with_the_batch():
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 10, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 2}))
    _feed(sp.cost, A16, C16)
    seq, twin = _looping_seq(), _looping_seq()      # the same history
    for s in (seq, twin):
        assert sp.draft(s, 1, 10) == [7] * 10       # probes at batch 1: rate 0.1
        sp.record(s, 10, 7)                         # 0.1 + (0.7 - 0.1) / 2 = 0.4
        for _ in range(3):                          # at batch 1 a rate of 0.4 pays (bar 0.1)
            assert sp.draft(s, 1, 10) == [7] * 10
            sp.record(s, 10, 4)                     # 4 of 10: the rate stays 0.4
        assert s.spec.rate == pytest.approx(0.4, abs=1e-9) and s.spec.pause == 4
    # 16 decodes: the bar is 0.6, a rate of 0.4 no longer pays: a pause, without drafting
    assert sp.draft(twin, 1, 10) == [7] * 10
    assert sp.draft(seq, 16, 10) == []
    assert (seq.spec.skip, seq.spec.pause) == (4, 8)
    assert seq.spec.rate == pytest.approx(0.6, abs=1e-9)
    for _ in range(4):
        assert sp.draft(seq, 16, 10) == []
    assert sp.draft(seq, 16, 10) == [7] * 10        # the probe, at the bar of batch 16
    assert sp.num_drafts == 8
    # min_acceptance_rate 0 removes the floor, not the break-even bar
    sp0 = Speculator(parse_speculative_config({"num_speculative_tokens": 10, "prompt_lookup_min": 1,
                                               "min_acceptance_rate": 0}))
    _feed(sp0.cost, A16, C16)
    assert sp0.bar(1) == pytest.approx(3 / 35, abs=1e-9) and sp0.bar(16) == pytest.approx(0.6, abs=1e-9)
    # a floor over the break-even rate is the bar
    sp9 = Speculator(parse_speculative_config({"num_speculative_tokens": 10, "prompt_lookup_min": 1,
                                               "min_acceptance_rate": 0.9}))
    _feed(sp9.cost, A16, C16)
    assert sp9.bar(1) == sp9.bar(16) == 0.9


def test_speculator_pauses_a_failing_sequence_and_backs_off():
    # no step timed yet: the bar is the floor, min_acceptance_rate (default 0.1), at every batch
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 2}))
    seq = _looping_seq()
    other = _looping_seq()          # a second sequence: its own state, never paused

    def skipped() -> int:
        """Drafts skipped (the n-gram always matches here) before `seq` drafts again."""
        n = 0
        while not sp.draft(seq, 1, 3):
            n += 1
            assert n < 1000
        assert sp.draft(other, 1, 3) == [7, 7, 7]
        return n

    assert sp.draft(seq, 1, 3) == [7, 7, 7]
    assert seq.spec.rate == 0.1     # the probe: its rate starts at the bar
    # the acceptance rate is a moving average, the newest draft weighing 1/2
    sp.record(seq, 3, 0)            # 0.05 < 0.1: four drafts skipped, then a probe
    assert (seq.spec.skip, seq.spec.pause) == (4, 8)
    assert seq.spec.rate == 0.1     # reset to the bar
    assert skipped() == 4
    pauses = []
    for _ in range(8):              # each failed probe doubles the pause, up to 256 drafts
        sp.record(seq, 3, 0)
        pauses.append(skipped())
    assert pauses == [8, 16, 32, 64, 128, 256, 256, 256]
    sp.record(seq, 3, 3)            # a probe that pays off (0.1 + 0.9 / 2): drafting resumes...
    assert seq.spec.rate == pytest.approx(0.55) and seq.spec.pause == 4
    assert skipped() == 0
    sp.record(seq, 3, 1)            # 0.55 + (1/3 - 0.55) / 2
    assert seq.spec.rate == pytest.approx(0.55 / 2 + 1 / 6)
    assert skipped() == 0
    for rate in (0.22083, 0.11042):     # halved by each failure, still over the bar
        sp.record(seq, 3, 0)
        assert seq.spec.rate == pytest.approx(rate, abs=1e-5)
        assert skipped() == 0
    sp.record(seq, 3, 0)            # 0.055: under the bar
    assert skipped() == 4           # ... and the pause starts from 4 again
    assert sp.num_drafts == 14 and sp.num_draft_tokens == 42 and sp.num_accepted_tokens == 4
    assert sp.accepted_per_pos == [2, 1, 1]
    # a room smaller than num_speculative_tokens shortens the draft; none at all: no draft
    assert len(sp.draft(other, 1, 2)) == 2 and sp.draft(other, 1, 0) == []


def test_speculator_pause_counts_drafts_not_steps():
    """A paused sequence skips drafts it would have made: a step where its n-gram did not occur
    earlier (no draft anyway) leaves the pause as it was."""
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 2}))
    seq = _looping_seq()
    fresh = iter(range(1000, 2000))

    def step(match: bool) -> list[int]:
        """The next decode step, after a token that is 7 again (a match) or new (none)."""
        seq.append_token(7 if match else next(fresh))
        return sp.draft(seq, 1, 3)

    assert sp.draft(seq, 1, 3) == [7, 7, 7]
    sp.record(seq, 3, 0)                # paused: 4 drafts to skip
    skips = []
    for match in (False, True, False, False, True, True, False, False, False, True):
        assert step(match) == []
        skips.append(seq.spec.skip)
    assert skips == [4, 3, 3, 3, 2, 1, 1, 1, 1, 0]
    assert step(False) == [] and seq.spec.skip == 0     # no match: no draft, pause or not
    assert step(True) != []                             # the probe
    sp.record(seq, 3, 0)                # failed again: 8 drafts
    assert seq.spec.skip == 8
    for _ in range(20):
        assert step(False) == []
    assert seq.spec.skip == 8
    for left in range(7, -1, -1):
        assert step(True) == [] and seq.spec.skip == left
    assert step(True) != []


def test_speculator_without_a_threshold_never_pauses():
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                              "min_acceptance_rate": 0}))
    seq = _looping_seq()
    for _ in range(20):
        assert sp.draft(seq, 1, 5) == [7, 7]
        sp.record(seq, 2, 0)
    assert seq.spec.skip == 0 and sp.num_drafts == 20


def test_speculator_has_no_batch_cap_unless_configured():
    assert DEFAULT_DISABLE_BY_BATCH_SIZE is None and DEFAULT_MIN_ACCEPTANCE_RATE == 0.1
    for raw in ({"num_speculative_tokens": 2, "prompt_lookup_min": 1},
                {"num_speculative_tokens": 2, "prompt_lookup_min": 1, "disable_by_batch_size": None},
                '{"num_speculative_tokens": 2, "prompt_lookup_min": 1, "disable_by_batch_size": null}'):
        config = parse_speculative_config(raw)
        assert config.disable_by_batch_size is None and config.min_acceptance_rate == 0.1
        sp = Speculator(config)
        for batch in (1, 32, 33, 1000, 10 ** 6):
            assert sp.draft(_looping_seq(), batch, 5) == [7, 7], (raw, batch)


def test_speculator_drafts_only_up_to_disable_by_batch_size():
    sp = Speculator(parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                              "disable_by_batch_size": 4}))
    seq = _looping_seq()
    assert sp.draft(seq, 5, 5) == [] and sp.draft(seq, 4, 5) == [7, 7]
    assert sp.draft(_looping_seq(), 1000, 5) == []


@pytest.mark.parametrize("batch", [5, 4])
def test_engine_drafts_only_up_to_disable_by_batch_size(model, batch):
    spec = parse_speculative_config({"num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                     "disable_by_batch_size": 4})
    # equal prompts lengths and budgets, all prefilled in one step: they decode in lockstep,
    # so the batch stays at `batch` sequences until they all finish together
    reqs = {f"r{i}": (quoting_prompt(32, seed=700 + i), greedy(24)) for i in range(batch)}
    plain, spec_out, e, drafts = run_both(model, reqs, spec)
    assert_same(plain, spec_out)
    if batch > 4:
        assert e.spec_stats()["num_drafts"] == 0 and drafts == []
        assert all(len(r.steps) == 24 for r in spec_out.values())
    else:
        assert_speculated(e, drafts)


def test_engine_feeds_the_step_cost_fit(model):
    """Every decode-only step's token count (drafts included) and time go into the fit, no
    step with a prompt chunk does, and nothing else does; and on this CPU the fit finds tokens
    costing time, so the break-even rate is over 0 and rises with the batch.

    The steps take ~0.5 ms here; one preempted by another process takes ~5 ms, and one such
    step can tip the least-squares fit (slope <= 0: break-even 0; intercept < 0: break-even 1).
    So the timing claim must hold in one of up to 5 runs (a fresh engine each); everything
    else is checked on every run."""
    # a batch that shrinks from 4 sequences to 1: decode steps of 1 to ~24 tokens
    reqs = {f"r{i}": (quoting_prompt(24 + 8 * i, seed=1100 + i), greedy(12 + 12 * i)) for i in range(4)}
    fits = []
    for _ in range(5):
        e = make_engine(model, SPEC)
        fed, steps = [], []
        observe, run = e.speculator.cost.observe, e.runner.run

        def spying_observe(num_tokens, seconds, fed=fed, observe=observe):
            fed.append((num_tokens, seconds))
            observe(num_tokens, seconds)

        def recording_run(batch, steps=steps, run=run):
            steps.append((batch.is_decoding, batch.num_tokens, len(batch.seqs)))
            return run(batch)

        e.speculator.cost.observe, e.runner.run = spying_observe, recording_run
        generate(e, reqs)
        assert_speculated(e)
        assert [n for n, _ in fed] == [n for decoding, n, _ in steps if decoding]
        assert len(fed) < len(steps)                        # prefill steps were not fed
        assert all(s > 0 for _, s in fed)
        assert any(n > seqs for decoding, n, seqs in steps if decoding)     # drafted steps were
        assert len(fed) >= 20 and len({n for n, _ in fed}) >= 4
        cost, replay = e.speculator.cost, StepCost()
        for n, seconds in fed:
            replay.observe(n, seconds)
        for b in (1, 4, 16):                # the fit is that of the steps fed, and only those
            assert cost.break_even(b) == pytest.approx(replay.break_even(b), abs=1e-12)
        fits.append((cost.break_even(1), cost.break_even(16)))
        if 0 < fits[-1][0] < fits[-1][1] < 1:
            break
    else:
        pytest.fail(f"break-even (batch 1, batch 16) in 5 runs: {fits}")


def test_block_manager_truncate_returns_the_rejected_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = Sequence(list(range(9)))
    assert bm.allocate(seq, 9)                      # 3 blocks
    seq.num_computed_tokens = 8
    bm.cache_full_blocks(seq)                       # its 2 full blocks are in the prefix cache
    head = list(seq.block_table)
    assert bm.allocate(seq, 9 + 7)                  # a draft of 7 tokens: 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    tail = seq.block_table[3]
    bm.truncate(seq, 9 + 1)                         # one draft token accepted: 3 blocks
    assert seq.block_table == head[:3] and bm.num_free_blocks == 5
    assert bm.blocks[tail].ref_count == 0
    # the given-back block holds nothing worth keeping: it is the next one handed out
    other = Sequence([100] * 3)
    assert bm.allocate(other, 3) and other.block_table == [tail]
    bm.truncate(seq, 12)                            # covered already: nothing to give back
    assert seq.block_table == head[:3]
    bm.truncate(seq, 1)                             # down to the first block
    assert seq.block_table == head[:1] and bm.num_free_blocks == 6
    # a freed cached block stays in the prefix cache (only its reference is dropped)
    assert bm.cached[seq.block_hashes[1]] == head[1]
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 8 and bm.usage() == 0.0
