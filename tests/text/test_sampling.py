import math
import random

import pytest
import torch
from dspark_grpc.runtime.drafting.sampling import SamplingParams, make_generator, sample, target_probs
from tolerance import gamma, softmax_error, unit_roundoff


def probs_error(logits: torch.Tensor, temperature: float, dtype: torch.dtype = torch.float32) -> float:
    """Relative error of each probability of softmax(logits / T) in `dtype`, renormalised once more after a top-k /
    top-p cut (a sum of n and a divide): tests/tolerance.py."""
    n, z_max = logits.shape[-1], float(logits.abs().max()) / (temperature or 1.0)
    return softmax_error(n, z_max, unit_roundoff(dtype) * z_max, dtype) + gamma(n + 1, dtype)


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Slow plain-Python temperature -> top-k -> top-p, keeping ties at each boundary."""
    if temperature == 0 or top_k == 1:
        best = max(logits)
        first = logits.index(best)
        return [1.0 if i == first else 0.0 for i in range(len(logits))]
    x = [v / temperature for v in logits]
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    m = max(x)
    e = [math.exp(v - m) for v in x]
    p = [v / sum(e) for v in e]
    if top_p < 1:
        mass, threshold = 0.0, None
        for v in sorted(p, reverse=True):
            if mass >= top_p:
                break
            threshold, mass = v, mass + v
        p = [v if v >= threshold else 0.0 for v in p]
        p = [v / sum(p) for v in p]
    return p


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_is_greedy():
    assert SamplingParams().is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 1.0  # frozen


def test_greedy_takes_the_lowest_index_among_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 0.0, 5.0, 5.0]])
    for params in (SamplingParams(), SamplingParams(temperature=0.9, top_k=1)):
        probs = target_probs(logits, params)
        assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))
        assert sample(logits, params, make_generator(0)).tolist() == [1, 0]
    assert sample(logits.to(torch.bfloat16), SamplingParams()).tolist() == [1, 0]


def test_matches_reference_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 50, generator=gen, dtype=torch.float64) * 3
    for temperature in (0.0, 0.3, 1.0, 2.5):
        for top_k in (0, 1, 5, 49, 50, 80):
            for top_p in (1.0, 0.95, 0.5, 0.05):
                params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
                got = target_probs(logits, params)
                assert got.shape == logits.shape
                want = [reference_probs(row, temperature, top_k, top_p) for row in logits.tolist()]
                want = torch.tensor(want, dtype=torch.float64)
                torch.testing.assert_close(got, want, atol=0, rtol=2 * probs_error(logits, temperature, torch.float64))


def test_float32_and_bfloat16_logits():
    logits = torch.randn(3, 4, 100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    probs = target_probs(logits, params)
    assert probs.dtype == torch.float32 and probs.shape == (3, 4, 100)
    error = probs_error(logits, params.temperature)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4), atol=error + gamma(100), rtol=0)
    # against float64 rounded to float32
    torch.testing.assert_close(probs, target_probs(logits.double(), params).float(), atol=0,
                               rtol=error + unit_roundoff() + probs_error(logits, params.temperature, torch.float64))
    assert target_probs(logits.bfloat16(), params).dtype == torch.float32
    assert sample(logits, params, make_generator(0)).shape == (3, 4)


def test_temperature_is_softmax_of_scaled_logits():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for t in (0.5, 1.0, 4.0):
        probs = target_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, (logits / t).softmax(-1), atol=0, rtol=2 * probs_error(logits, t))


def test_ties_at_the_boundaries_are_kept():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 0.0])

    def kept(**kwargs) -> list[bool]:
        return (target_probs(logits, SamplingParams(temperature=1.0, **kwargs)) > 0).tolist()

    p = logits.softmax(-1)
    assert kept(top_k=2) == [True, True, True, False, False]
    assert kept(top_p=(p[0] + p[1] * 0.5).item()) == [True, True, True, False, False]  # inside the tie
    assert kept(top_p=0.01) == [True, False, False, False, False]


def test_target_probs_is_pure():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    assert torch.equal(target_probs(logits, params), target_probs(logits, params))
    assert torch.equal(logits, before)


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=123)
    a = sample(logits, params, make_generator(params.seed))
    b = sample(logits, params, make_generator(params.seed))
    c = sample(logits, params, make_generator(124))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()


def test_empirical_distribution_matches_target_probs():
    logits = torch.tensor([1.5, 1.0, 0.8, 0.2, 0.0, -0.5, -1.0, -3.0])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = target_probs(logits, params)
    kept = probs > 0
    assert 2 < kept.sum() < 6
    n = 40_000
    draws = sample(logits.expand(n, -1), params, make_generator(7))
    counts = torch.bincount(draws, minlength=logits.numel()).double()
    assert counts[~kept].sum() == 0
    expected = probs.double()[kept] * n
    chi2 = (((counts[kept] - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # 99.9th percentile of chi-square with <= 5 degrees of freedom
    assert 0.5 * (counts / n - probs.double()).abs().sum() < 0.01


def test_python_reference_self_check():
    rng = random.Random(0)
    row = [rng.gauss(0, 1) for _ in range(10)]
    assert sum(reference_probs(row, 1.0, 0, 1.0)) == pytest.approx(1.0)
    assert sum(v > 0 for v in reference_probs(row, 1.0, 3, 1.0)) == 3
