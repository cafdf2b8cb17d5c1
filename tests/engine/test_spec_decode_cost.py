"""The cost gate of prompt-lookup speculative decoding: `StepCost`'s fit of step time and its
break-even acceptance rate, the `Speculator`'s probe, bar and pause (counted in drafts), and
`disable_by_batch_size`; and, through `LLMEngine`, that the engine honours the batch cap and
feeds the cost fit."""
from __future__ import annotations

import pytest
import torch

from prefixgate.backend import spec_decode
from prefixgate.backend.config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    DEFAULT_MIN_ACCEPTANCE_RATE,
    parse_speculative_config,
)
from prefixgate.backend.sampling import SamplingParams
from prefixgate.backend.sequence import Sequence
from prefixgate.backend.spec_decode import Speculator, StepCost
from tests.engine.helpers import (
    SPEC,
    assert_same,
    assert_speculated,
    generate,
    greedy,
    make_engine,
    quoting_prompt,
    run_both,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
    w = torch.tensor([spec_decode._COST_DECAY ** (m - 1 - i) for i in range(m)],
                     dtype=torch.float64).sqrt()
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
    assert (0 < cost.break_even(1) < cost.break_even(4) < cost.break_even(16)
            < cost.break_even(64) < 1)
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
    assert (sp0.bar(1) == pytest.approx(3 / 35, abs=1e-9)
            and sp0.bar(16) == pytest.approx(0.6, abs=1e-9))
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
                {"num_speculative_tokens": 2, "prompt_lookup_min": 1,
                 "disable_by_batch_size": None},
                '{"num_speculative_tokens": 2, "prompt_lookup_min": 1, '
                '"disable_by_batch_size": null}'):
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
    reqs = {f"r{i}": (quoting_prompt(24 + 8 * i, seed=1100 + i), greedy(12 + 12 * i))
            for i in range(4)}
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

