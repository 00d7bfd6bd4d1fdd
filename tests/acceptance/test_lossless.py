"""Speculation emits the AR distribution: the joint law of the first 3 tokens, 20k samples each, against the
exact AR law and against 20k AR samples; and the same harness flags rules that are biased."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.drafting.acceptance import accept_chains, dense_draft_probs, draft_sparse_distribution
from dspark_grpc.runtime.drafting.sampling import SamplingParams, target_probs

from .harness import (
    V,
    accept_chains_resample_from_p,
    ar_samples,
    exact_joint,
    homogeneity,
    looks_exact,
    speculative_samples,
    tiny_drafter,
    tiny_target,
    tree_samples,
    verdict,
)

N = 20_000
PARAMS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-top_k3": SamplingParams(temperature=0.7, top_k=3),
    "T1.3-top_p0.8": SamplingParams(temperature=1.3, top_p=0.8),
}
TARGET = tiny_target()
DRAFTER = tiny_drafter(TARGET)


def _check_lossless(spec: torch.Tensor, params: SamplingParams, seed: int) -> None:
    joint = exact_joint(TARGET, params)
    ar = ar_samples(TARGET, params, N, seed)
    v_spec, v_ar = verdict(spec, joint), verdict(ar, joint)
    tv_pair, p_pair = homogeneity(spec, ar, V**3)
    print(f"spec {v_spec}  ar {v_ar}  spec-vs-ar tv {tv_pair:.4f} p {p_pair:.3g}")
    assert looks_exact(v_ar), v_ar  # the harness itself
    assert looks_exact(v_spec), v_spec
    assert p_pair > 1e-3 and tv_pair < 2 * 2**0.5 * v_spec["noise"], (tv_pair, p_pair)


@pytest.mark.parametrize("name", PARAMS)
def test_chain_rejection_sampling_is_lossless(name: str):
    params = PARAMS[name]
    spec, accepted = speculative_samples(TARGET, DRAFTER, params, N, seed=2)
    print(f"{name}: {accepted:.3f} drafted tokens accepted per chain of 3")
    assert accepted > 0.3  # the drafter is good enough that accepted chains, rejections and bonuses all occur
    _check_lossless(spec, params, seed=1)


@pytest.mark.parametrize("name", PARAMS)
def test_tree_sample_and_match_is_lossless(name: str):
    params = PARAMS[name]
    spec, accepted = tree_samples(TARGET, DRAFTER, params, N, seed=3)
    print(f"{name}: {accepted:.3f} tree tokens accepted per tree")
    assert accepted > 0.2
    _check_lossless(spec, params, seed=4)


BIASED = {
    # Right acceptance, wrong rejection branch: draws from p instead of norm(max(0, p - q)).
    "resample_from_p": dict(rule=accept_chains_resample_from_p),
    # min(1, p/q) on a deterministic top-1 draft (dspark_algorithm.md §5): q is not what x was drawn from.
    "greedy_draft_softmax_q": dict(greedy_draft=True),
    # A subtle one: the chain is sampled at T = 0.8 but q is reported at T = 1.
    "q_at_wrong_temperature": dict(reported_temperature=1.0),
}


@pytest.mark.parametrize("name", BIASED)
def test_the_harness_flags_biased_rules(name: str):
    params = PARAMS["T1"]
    spec, _ = speculative_samples(TARGET, DRAFTER, params, N, seed=2, **BIASED[name])
    v = verdict(spec, exact_joint(TARGET, params))
    print(f"{name}: {v}")
    assert not looks_exact(v)
    assert v["p"] < 1e-6 and v["tv"] > 2 * v["noise"], v  # each statistic on its own catches it


def test_first_token_law_and_acceptance_rate_of_one_drafted_token():
    """n = 1, 200k chains at once: the emitted token ~ p, and x is accepted with rate 1 - TV(p, q), above the
    sum_x p(x) q(x) that sample-and-match would get on the same draft."""
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(2, V, generator=g) * 1.5
    ids, logprobs = draft_sparse_distribution(torch.randn(1, V, generator=g) * 1.5, 1.0, 4)
    p, q = target_probs(logits[0].double(), params), dense_draft_probs(ids, logprobs, V)[0]
    b = 200_000
    x = torch.multinomial(q, b, replacement=True, generator=g)
    tokens = torch.stack([torch.zeros(b, dtype=torch.long), x], dim=1)
    m, bonus = accept_chains(logits.expand(b, 2, V), tokens, ids.expand(b, 1, -1), logprobs.expand(b, 1, -1),
                             params, g)
    first = torch.where(m == 1, x, bonus)
    freq = torch.bincount(first, minlength=V).double() / b
    assert (freq - p).abs().max() < 0.005, (freq, p)
    rate, best = float(m.double().mean()), float(torch.minimum(p, q).sum())
    assert abs(rate - best) < 0.005, (rate, best)
    assert rate > float((p * q).sum()) + 0.05
