"""Prompt-lookup speculative decoding with temperature > 0: the sampled tokens follow the same
distribution with and without drafts (two-sample chi-square over hundreds of seeded requests
through `LLMEngine`), and `sampling.verify`'s accept/resample rule reproduces the target
distributions on hand-made logits."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from prefixgate.backend.config import parse_speculative_config
from prefixgate.backend.sampling import SamplingParams, verify
from tests.engine.helpers import (
    BLOCK,
    PagedCache,
    assert_speculated,
    generate,
    greedy,
    make_engine,
    quoting_prompt,
)
from tests.helpers import VOCAB_SIZE, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-stat"), "llama")


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


def chi2_goodness_of_fit(samples: list[int], probs: list[float],
                         min_expected: float = 5.0) -> float:
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
        probs = torch.softmax(logits[k][7:9].double() / TEMPERATURE, dim=-1)
        p_first, p_next = probs[:, k].tolist()
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
            p, cells = chi2_two_sample([key(j, o) for o in plain[j]],
                                       [key(j, o) for o in drafted[j]])
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

