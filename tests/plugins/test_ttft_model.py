"""The prefill-rate fit (ttft_model.py) and the prefill queue (prefill_queue.py) on synthetic
answers: what predicted_ttft learns and counts."""
from __future__ import annotations

import random

import pytest

from prefixgate.plugins.prefix_route.prefill_queue import PrefillQueue
from prefixgate.plugins.prefix_route.ttft_model import (
    DEFAULT_PRIOR,
    YOUNG_CLIP,
    PrefillFit,
    Prior,
    TTFTModel,
)

EVERY_S = 0.25                  # an answer every quarter second


def feed(fit: PrefillFit, t: float, n: int, rate: float, overhead: float, rng,
         noise: float = 0.1) -> float:
    """`n` answers of a backend prefilling `rate` tokens/s after `overhead` s; the time after."""
    for _ in range(n):
        t += EVERY_S
        tokens = rng.uniform(100, 4000)
        fit.observe(tokens, overhead + tokens / rate * rng.uniform(1 - noise, 1 + noise), t)
    return t


def converged(rate: float = 5000.0, overhead: float = 0.03) -> tuple[PrefillFit, float]:
    rng = random.Random(0)
    fit = PrefillFit(Prior(10_000.0, 0.02), half_life_s=15.0, now=0.0)
    return fit, feed(fit, 0.0, 300, rate, overhead, rng)


def test_converges_to_the_backends_rate_and_overhead():
    fit, _ = converged()
    assert fit.tokens_per_s == pytest.approx(5000, rel=0.05)
    assert fit.overhead_s == pytest.approx(0.03, abs=0.015)
    assert fit.predict(2000) == pytest.approx(0.03 + 2000 / 5000, rel=0.05)


def test_starts_from_the_prior_and_one_answer_moves_it_a_bounded_step():
    fit = PrefillFit(Prior(8000.0, 0.05), half_life_s=15.0, now=0.0)
    assert (fit.tokens_per_s, fit.overhead_s) == (pytest.approx(8000), 0.05)
    expected = 0.05 + 1000 / 8000
    fit.observe(1000, 100.0, 1.0)        # 100 s for 1000 tokens: one stalled request
    assert fit.predict(1000) < (1 + YOUNG_CLIP) * expected


def test_a_prior_several_times_off_is_corrected_within_a_few_answers():
    fit = PrefillFit(Prior(10_000.0, 0.02), half_life_s=15.0, now=0.0)   # the default prior
    for i, tokens in enumerate((450, 900, 1350, 1800) * 2):    # a CPU engine: 1,500 tokens/s
        fit.observe(tokens, tokens / 1500, 0.1 * i)
    assert fit.tokens_per_s == pytest.approx(1500, rel=0.15)


def test_outliers_move_the_fit_a_bounded_amount():
    fit, t = converged()
    for _ in range(5):
        t += EVERY_S
        fit.observe(1000, 60.0, t)       # five requests stuck a minute behind a stall
    assert fit.tokens_per_s == pytest.approx(5000, rel=0.1)
    assert fit.predict(1000) < 0.3 + 0.2


def test_a_slowed_backend_is_seen_within_a_minute():
    fit, t = converged()
    rng = random.Random(1)
    t = feed(fit, t, int(60 / EVERY_S), 2500.0, 0.03, rng)   # half as fast from now on
    assert fit.tokens_per_s == pytest.approx(2500, rel=0.15)


def test_no_answers_keep_the_fit_where_it_was():
    fit, t = converged()
    before = fit.tokens_per_s
    rng = random.Random(2)
    feed(fit, t + 600, 1, 5000.0, 0.03, rng, noise=0.0)      # ten quiet minutes, then one
    assert fit.tokens_per_s == pytest.approx(before, rel=0.05)


def test_a_new_upstream_starts_from_the_fleet_or_the_configured_prior():
    model = TTFTModel(None, 15.0)
    assert model.fit("a", "m", 0.0).tokens_per_s == DEFAULT_PRIOR.tokens_per_s
    rng = random.Random(3)
    feed(model.fit("a", "m", 0.0), 0.0, 200, 3000.0, 0.01, rng)
    assert model.fit("b", "m", 50.0).tokens_per_s == pytest.approx(3000, rel=0.1)
    assert model.fit("c", "other", 50.0).tokens_per_s == DEFAULT_PRIOR.tokens_per_s
    configured = TTFTModel(Prior(1234.0, 0.1), 15.0)
    configured.fit("a", "m", 0.0).observe(100, 1.0, 1.0)
    assert configured.fit("b", "m", 1.0).tokens_per_s == pytest.approx(1234)
    model.retain({"b"})
    assert set(model.of("m")) == {"b"} and not model.of("other")


def test_the_queue_counts_tokens_until_the_first_byte():
    q = PrefillQueue()
    first = q.add("a", 1000, now=0.0)
    second = q.add("a", 500, now=0.0)
    lane = q.lanes["a"]
    assert lane.ahead(0.0, 1 / 1000) == 1500
    assert lane.ahead(0.4, 1 / 1000) == pytest.approx(1100)   # 400 of the oldest done
    assert lane.ahead(1.0, 1 / 1000) == pytest.approx(500)     # at most the oldest, on time
    # the oldest 4 s past its time: it waits behind work this gateway does not see (other
    # replicas'), and as much more is counted ahead
    assert lane.ahead(5.0, 1 / 1000) == pytest.approx(500 + 4000)
    q.remove("a", first, now=1.0, answered=True)
    assert lane.ahead(1.0, 1 / 1000) == 500
    q.remove("a", second, now=1.1, answered=False)              # failed: off the lane
    assert lane.ahead(9.0, 1 / 1000) == 0 and lane.tokens == 0


def test_polled_waiting_requests_beyond_ours_add_the_mean_request():
    q = PrefillQueue()
    q.add("a", 300, now=0.0)
    q.add("a", 100, now=0.0)
    lane = q.lanes["a"]
    assert lane.ahead(0.0, 1e-3, waiting=2) == 400             # only ours wait
    extra = lane.ahead(0.0, 1e-3, waiting=5) - 400             # three more: others' requests
    assert 3 * 100 <= extra <= 3 * 300


def test_an_upstream_with_few_answers_is_predicted_as_the_fleet():
    """Anchored to the fleet's line: one of many replicas hears from each of many upstreams
    rarely, and a few answers that waited behind other replicas' work do not make an upstream
    look slow; an upstream with many answers is predicted by its own."""
    model, rng, t = TTFTModel(None, 15.0), random.Random(5), 0.0
    for _ in range(400):                    # the fleet: 12,000 tokens/s
        t += EVERY_S / 4
        tokens = rng.uniform(100, 4000)
        model.observe(f"u{rng.randrange(40)}", "m", tokens, 0.005 + tokens / 12_000, t)
    for _ in range(3):                      # three answers of "rare", each 1 s late
        t += EVERY_S
        model.observe("rare", "m", 2000, 1.0 + 2000 / 12_000, t)
    assert model.fit("rare", "m", t).predict(2000) < 0.5
    for _ in range(300):                    # "slow" answers often, at half the speed
        t += EVERY_S / 4
        tokens = rng.uniform(100, 4000)
        model.observe("slow", "m", tokens, 0.005 + tokens / 6000, t)
    assert model.fit("slow", "m", t).tokens_per_s == pytest.approx(6000, rel=0.2)


def test_an_answer_that_was_all_cached_does_not_make_an_upstream_look_fast():
    """A replica's first answer from an upstream is often a prompt another replica put there:
    a few tokens computed, a few ms. That says where the line starts, not its slope: the
    anchor's second point stays at ANCHOR_MIN_TOKENS or more, not at those few tokens (where
    it sat, the fit read 3,700 tokens/s off this answer, on a fleet of 2,500)."""
    model, rng, t = TTFTModel(None, 15.0), random.Random(6), 0.0
    for _ in range(200):                    # the fleet: 2,500 tokens/s after 20 ms
        t += EVERY_S
        tokens = rng.uniform(100, 4000)
        model.observe(f"u{rng.randrange(4)}", "m", tokens, 0.02 + tokens / 2500, t)
    model.observe("warmed", "m", 15, 0.004, t + EVERY_S)    # 15 tokens computed, 4 ms
    assert model.fit("warmed", "m", t).tokens_per_s == pytest.approx(2500, rel=0.2)
