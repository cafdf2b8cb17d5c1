"""The batched sampler and the stop checks."""
import math

import pytest
import torch

from prefixgate.backend.sampling import SamplingParams, find_stop_string, sample, stop_token_reason


def draws(logits_row, params: SamplingParams, n=4000, seed=0) -> torch.Tensor:
    """n samples of one row, drawn as one batch of n identical rows."""
    torch.manual_seed(seed)
    logits = torch.tensor(logits_row, dtype=torch.float32).repeat(n, 1)
    return torch.tensor(sample(logits, [params] * n, [None] * n))


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    out = sample(logits, [SamplingParams(temperature=0.0)] * 5, [None] * 5)
    assert out == logits.argmax(-1).tolist()


def test_extreme_settings_stay_well_defined():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    tiny_t = [SamplingParams(temperature=1e-300)] * 2              # would overflow: greedy
    assert sample(logits, tiny_t, [None] * 2) == logits.argmax(-1).tolist()
    huge_k = [SamplingParams(top_k=2**70)] * 2                    # more than the vocabulary: no cut
    assert all(0 <= t < 50 for t in sample(logits, huge_k, [None] * 2))


def test_top_k_one_is_greedy_even_when_hot():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    out = sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 3, [None] * 3)
    assert out == logits.argmax(-1).tolist()


def test_temperature_sampling_follows_the_softmax():
    row = [math.log(0.5), math.log(0.3), math.log(0.2)]
    counts = torch.bincount(draws(row, SamplingParams(temperature=1.0)), minlength=3) / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)
    # A low temperature sharpens the distribution toward the top token.
    cold = torch.bincount(draws(row, SamplingParams(temperature=0.2)), minlength=3) / 4000
    assert cold[0] > 0.9


def test_top_k_and_top_p_cut_the_tail():
    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    assert set(draws(row, SamplingParams(top_k=2)).tolist()) == {0, 1}
    # top_p=0.65: 0.4 < 0.65 so the second token is kept, 0.7 >= 0.65 so the third is not.
    assert set(draws(row, SamplingParams(top_p=0.65)).tolist()) == {0, 1}
    assert set(draws(row, SamplingParams(top_p=0.05)).tolist()) == {0}
    assert set(draws(row, SamplingParams(top_p=1.0)).tolist()) == {0, 1, 2, 3}


def test_seeded_requests_repeat_regardless_of_batch_companions():
    logits = torch.zeros(3, 100)
    p = SamplingParams(temperature=1.0, seed=1234)

    def seeded_stream(batch_rows: int) -> list[int]:
        gen = p.make_generator()
        out = []
        for _ in range(10):
            rows = [p] + [SamplingParams()] * (batch_rows - 1)
            out.append(sample(logits[:batch_rows], rows, [gen] + [None] * (batch_rows - 1))[0])
        return out

    alone, batched = seeded_stream(1), seeded_stream(3)
    assert alone == batched
    assert len(set(alone)) > 3                          # it is really sampling


def test_param_validation():
    for bad in (dict(max_tokens=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_token_reasons():
    p = SamplingParams(max_tokens=3, stop_token_ids=[7])
    assert stop_token_reason(2, 1, p, {2}) == "stop"
    assert stop_token_reason(2, 1, SamplingParams(ignore_eos=True), {2}) is None
    assert stop_token_reason(7, 1, p, {2}) == "stop"
    assert stop_token_reason(5, 3, p, {2}) == "length"
    assert stop_token_reason(5, 2, p, {2}) is None


def test_find_stop_string_takes_the_earliest():
    assert find_stop_string("hello world. bye", ["bye", "."]) == 11
    assert find_stop_string("hello", ["x"]) == -1
    assert find_stop_string("a.b.", ["."], start=2) == 3
