"""Sampling: validation, greedy, filters, and determinism per request independent of batching.

``Sampler`` is ``moeserve.sampling.sample`` on a batch of one at position = tokens drawn so far
(tests/test_batch_sampling.py tests the batch path); its random stream is the counter-based one
(Philox keyed by seed and position), no longer a ``torch.Generator``: the draws below changed,
the properties they check did not."""

import pytest
import torch

from moeserve.sampling import Sampler, SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be an integer >= 0"),
        (dict(top_k=2.5), "top_k must be an integer >= 0"),
        (dict(seed=-3), "seed must be None or an integer in 0..9223372036854775807"),
        (dict(seed=2**64), "seed must be None or an integer"),
    ],
)
def test_invalid_parameters_name_the_field_and_the_allowed_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_temperature_zero_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert Sampler(SamplingParams()).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0.0, seed=4)).sample(logits.to(torch.bfloat16)) == 1


def _draws(params, logits, n=400):
    s = Sampler(params)
    return [s.sample(logits) for _ in range(n)]


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=0), logits)) == {0, 1}
    # nucleus 0.7: tokens 0 (0.5) and 1 (0.3, reaching 0.8) stay; 2 and 3 are cut
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7, seed=0), logits)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.4, seed=0), logits)) == {0}
    assert set(_draws(SamplingParams(temperature=1.0, seed=0), logits)) == {0, 1, 2, 3}


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    d = torch.bincount(torch.tensor(_draws(SamplingParams(temperature=1.0, seed=1), logits, 4000)), minlength=3) / 4000
    assert torch.allclose(d, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
    hot = (
        torch.bincount(torch.tensor(_draws(SamplingParams(temperature=0.3, seed=1), logits, 2000)), minlength=3) / 2000
    )
    assert hot[0] > 0.9, "a low temperature sharpens the distribution"


def test_same_seed_same_tokens_whatever_else_is_sampled_in_between():
    rows = torch.randn(20, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)
    alone = Sampler(params)
    expected = [alone.sample(r) for r in rows]
    a, other, b = Sampler(params), Sampler(SamplingParams(temperature=1.0, seed=9)), Sampler(params)
    got_a, got_b = [], []
    for r in rows:  # interleaved with another request, as in a batch
        other.sample(r)
        got_a.append(a.sample(r))
        torch.manual_seed(0)  # the global RNG is never used
        got_b.append(b.sample(r))
    assert got_a == expected == got_b
    other_seed = Sampler(SamplingParams(temperature=1.0, top_p=0.9, seed=124))
    assert [other_seed.sample(r) for r in rows] != expected


def test_a_temperature_that_rounds_to_zero_is_greedy_not_an_error():
    # 1e-320 is 0 in fp32: the old Sampler divided by it and torch.multinomial raised on NaN
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    for t in (1e-320, 5e-324, 1e-6):
        assert _draws(SamplingParams(temperature=t, top_p=0.5, seed=0), logits, 20) == [1] * 20


def test_each_draw_is_keyed_by_its_position():
    rows = torch.randn(6, 30, generator=torch.Generator().manual_seed(1))
    s = Sampler(SamplingParams(temperature=1.0, seed=5))
    first = [s.sample(r) for r in rows]
    assert s.position == 6
    again = Sampler(SamplingParams(temperature=1.0, seed=5))
    assert [again.sample(r) for r in rows] == first
    later = Sampler(SamplingParams(temperature=1.0, seed=5))
    later.position = 3  # a sampler resumed at its 4th token draws the 4th token
    assert [later.sample(r) for r in rows[3:]] == first[3:]


def test_no_seed_draws_a_random_one():
    assert Sampler(SamplingParams(temperature=1.0)).seed != Sampler(SamplingParams(temperature=1.0)).seed
