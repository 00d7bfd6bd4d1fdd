"""accept_chain at temperature 0, its input errors, and the drafter side (draft_sparse_distribution, sample_sparse)."""

from __future__ import annotations

import math

import pytest
import torch
from dspark_grpc.runtime.drafting.acceptance import (
    accept_chain,
    accept_chains,
    accept_tree,
    dense_draft_probs,
    draft_sparse_distribution,
    sample_sparse,
)
from dspark_grpc.runtime.drafting.markov import run_chain
from dspark_grpc.runtime.drafting.sampling import SamplingParams
from tolerance import gamma, log_softmax_error, softmax_error, unit_roundoff

from .harness import goodness_of_fit

V = 50


def greedy_match(logits: torch.Tensor, tokens: list[int]) -> tuple[list[int], int]:
    best = logits.argmax(dim=-1).tolist()
    m = 0
    while m < len(tokens) - 1 and tokens[m + 1] == best[m]:
        m += 1
    return list(range(m + 1)), best[m]


def random_case(g: torch.Generator, n: int, top_k: int = 8) -> tuple[torch.Tensor, list[int], torch.Tensor,
                                                                        torch.Tensor]:
    """Target logits [n+1, V] and a chain that follows the target's argmax for a random number of steps, then
    draws from a random sparse draft; every token lies in its draft row."""
    logits = torch.randn(n + 1, V, generator=g)
    ids, logprobs = draft_sparse_distribution(torch.randn(n, V, generator=g), 1.0, top_k)
    follow = int(torch.randint(0, n + 1, (), generator=g))
    tokens = [int(torch.randint(0, V, (), generator=g))]
    for k in range(n):
        x = int(logits[k].argmax()) if k < follow else int(sample_sparse(ids[k], logprobs[k], g))
        if x not in ids[k].tolist():  # keep x in its row: put it in place of the least likely id
            ids[k, -1] = x
            logprobs[k] = torch.cat([logprobs[k, :-1], logprobs[k, -1:]]).log_softmax(dim=-1)
        tokens.append(x)
    return logits, tokens, ids, logprobs


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, top_k=1)])
def test_greedy_is_plain_greedy_matching_and_draws_nothing(params: SamplingParams):
    g = torch.Generator().manual_seed(0)
    seen = set()
    for trial in range(200):
        logits, tokens, ids, logprobs = random_case(g, n=trial % 6)
        rng = torch.Generator().manual_seed(1)
        state = rng.get_state()
        got = accept_chain(logits, tokens, ids, logprobs, params, rng)
        assert got == greedy_match(logits, tokens)
        assert got == accept_tree(logits, tokens, list(range(-1, len(tokens) - 1)), params, None)
        assert torch.equal(rng.get_state(), state)
        seen.add(len(got[0]) - 1 == len(tokens) - 1)
    assert seen == {True, False}  # both full acceptance and early mismatches occurred


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(2, 4)
    ids, logprobs = torch.tensor([[3, -1]]), torch.tensor([[0.0, -math.inf]])
    assert accept_chain(logits, [1, 3], ids, logprobs, SamplingParams(), None) == ([0], 0)
    one_hot = torch.tensor([[0]]), torch.tensor([[0.0]])
    assert accept_chain(logits, [1, 0], *one_hot, SamplingParams(), None) == ([0, 1], 0)


def test_accept_chain_is_accept_chains_with_one_chain():
    params = SamplingParams(temperature=0.8, top_p=0.9)
    g = torch.Generator().manual_seed(2)
    for trial in range(50):
        logits, tokens, ids, logprobs = random_case(g, n=1 + trial % 5)
        one = accept_chain(logits, tokens, ids, logprobs, params, torch.Generator().manual_seed(trial))
        m, bonus = accept_chains(logits[None], torch.tensor([tokens]), ids[None], logprobs[None], params,
                                 torch.Generator().manual_seed(trial))
        assert one == (list(range(int(m[0]) + 1)), int(bonus[0]))


def test_a_draft_equal_to_the_target_is_always_accepted():
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, V, generator=g)
    ids, logprobs = draft_sparse_distribution(logits[:3], 1.0, 0)  # q = p on the whole vocabulary
    for _ in range(200):
        tokens = [7] + sample_sparse(ids, logprobs, g).tolist()
        path, bonus = accept_chain(logits, tokens, ids, logprobs, params, g)
        assert path == [0, 1, 2, 3] and 0 <= bonus < V


def test_a_rejection_never_emits_an_overdrafted_token():
    """The residual max(0, p - q) is 0 wherever q >= p, so after rejecting x the bonus is never x."""
    params = SamplingParams(temperature=1.0)
    logits = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # p uniform
    ids, logprobs = torch.tensor([[1, 2]]), torch.tensor([[math.log(0.9), math.log(0.1)]])
    g = torch.Generator().manual_seed(4)
    results = [accept_chain(logits, [0, 1], ids, logprobs, params, g) for _ in range(300)]
    rejected = [bonus for path, bonus in results if path == [0]]
    assert rejected and set(rejected) <= {0, 2}
    assert abs(len(rejected) / 300 - (1 - (1 / 3) / 0.9)) < 0.1


def _case() -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor]:
    logits = torch.randn(3, 5)
    ids = torch.tensor([[1, 2, -1], [0, 4, 3]])
    logprobs = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf], [math.log(0.2), math.log(0.3), math.log(0.5)]])
    return logits, [2, 1, 4], ids, logprobs


def logprob_rounding(logprobs: torch.Tensor) -> float:
    """Float32 log-probs are the exact ones within u |lp|: relative error of their exp (twice: a row renormalises)."""
    finite = logprobs[torch.isfinite(logprobs)]
    return 2 * unit_roundoff() * (1 + float(finite.abs().max()))


def _with(**changes):
    logits, tokens, ids, logprobs = _case()
    args = dict(logits=logits, tokens=tokens, draft_ids=ids, draft_logprobs=logprobs)
    args.update(changes)
    return args


@pytest.mark.parametrize("changes, match", [
    (dict(logits=torch.randn(3, 5, 1)), r"logits must be \[len\(tokens\)=3, V\]"),
    (dict(logits=torch.randn(4, 5)), r"logits must be \[len\(tokens\)=3, V\]"),
    (dict(tokens=[]), r"the chain needs its root"),
    (dict(tokens=[2, 1, 5]), r"chain tokens \[5\] are outside the target vocabulary \[0, 5\)"),
    (dict(draft_ids=torch.tensor([[1, 2, -1]]), draft_logprobs=torch.zeros(1, 3)),
     r"draft ids must be \[n=2, K\]: one row per drafted token"),
    (dict(draft_ids=torch.tensor([1, 2])), r"draft ids must be \[n=2, K\]"),
    (dict(draft_logprobs=torch.zeros(2, 2)), r"must have one shape \[\.\.\., K\]"),
    (dict(draft_ids=torch.tensor([[1.0, 2.0, -1.0], [0.0, 4.0, 3.0]])), r"draft ids must be an integer tensor"),
    (dict(draft_logprobs=torch.zeros(2, 3, dtype=torch.long)), r"draft log-probs must be a float tensor"),
    (dict(draft_ids=torch.tensor([[1, 2, -1], [0, 5, 3]])), r"draft id 5 in row 1, column 1 is outside the target "
                                                             r"vocabulary \[0, 5\) \(-1 marks padding\)"),
    (dict(draft_ids=torch.tensor([[1, 2, -2], [0, 4, 3]])), r"draft id -2 in row 0, column 2"),
    (dict(draft_logprobs=torch.tensor([[0.5, -0.1, -math.inf], [-1.0, -1.0, -1.0]])), r"<= 0 and not NaN; row 0"),
    (dict(draft_logprobs=torch.tensor([[-0.7, math.nan, 0.0], [-1.0, -1.0, -1.0]])), r"<= 0 and not NaN; row 0"),
    (dict(draft_logprobs=torch.tensor([[math.log(0.5), math.log(0.5), -math.inf], [-1.0, -1.0, -1.0]])),
     r"draft row 1 sums to 1\.10364, not 1: send the log-probs of the whole \(renormalized\) distribution"),
    (dict(draft_logprobs=torch.tensor([[-0.7, -0.7, 0.0], [-1.6, -1.2, -0.7]])), r"draft row 0 sums to"),
    (dict(tokens=[2, 1, 2]), r"chain token 2 \(2\) has no mass in its draft row 1: the row must be"),
    (dict(draft_logprobs=torch.tensor([[-math.inf, 0.0, -math.inf], [math.log(0.2), math.log(0.3), math.log(0.5)]])),
     r"chain token 1 \(1\) has no mass in its draft row 0"),
])
def test_bad_inputs_raise_value_errors_that_say_what_to_fix(changes: dict, match: str):
    with pytest.raises(ValueError, match=match):
        accept_chain(**_with(**changes), params=SamplingParams(temperature=1.0), generator=None)


def test_the_case_used_for_errors_is_valid_and_padding_is_ignored():
    args = _with()
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        path, bonus = accept_chain(**args, params=params, generator=torch.Generator().manual_seed(0))
        assert path[0] == 0 and 0 <= bonus < 5
    dense = dense_draft_probs(args["draft_ids"], args["draft_logprobs"], 5)
    torch.testing.assert_close(dense, torch.tensor([[0, 0.5, 0.5, 0, 0], [0.2, 0, 0, 0.5, 0.3]], dtype=torch.float64),
                               atol=0, rtol=logprob_rounding(args["draft_logprobs"]))


def test_dense_draft_probs_names_rows_of_a_batch():
    ids = torch.tensor([[[0, 1]], [[0, 1]]])
    logprobs = torch.tensor([[[0.5, 0.5]], [[0.5, 0.6]]]).log()
    with pytest.raises(ValueError, match=r"draft row \(1, 0\) sums to 1\.1"):
        dense_draft_probs(ids, logprobs, 3)


def test_dense_draft_probs_adds_repeated_ids_and_renormalizes():
    ids = torch.tensor([[3, 3, 0]])
    logprobs = torch.tensor([[0.25, 0.25, 0.5]]).log()
    want = torch.tensor([[0.5, 0, 0, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(dense_draft_probs(ids, logprobs, 4), want, atol=0, rtol=logprob_rounding(logprobs))
    nearly = torch.tensor([[0.2, 0.7995]]).log()
    assert float(dense_draft_probs(torch.tensor([[0, 1]]), nearly, 2).sum()) == pytest.approx(1.0, abs=1e-12)


def test_the_empty_chain_draws_the_bonus_from_the_root():
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    empty_ids, empty_lp = torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, 4)
    assert accept_chain(logits, [2], empty_ids, empty_lp, SamplingParams(), None) == ([0], 1)
    path, bonus = accept_chain(logits, [2], empty_ids, empty_lp, SamplingParams(temperature=1.0),
                               torch.Generator().manual_seed(0))
    assert path == [0] and 0 <= bonus < 3


# -- the drafter side ------------------------------------------------------------------------------------------------


def test_draft_sparse_distribution_is_the_renormalized_top_k_softmax_at_t():
    z = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    ids, logprobs = draft_sparse_distribution(z, 0.7, 4)
    assert ids.shape == logprobs.shape == (3, 4) and ids.dtype == torch.long and logprobs.dtype == torch.float32
    want = torch.softmax(z / 0.7, dim=-1).topk(4, dim=-1)
    assert torch.equal(ids, want.indices)
    # each side: softmax(z / T) (its divide: u |z| / T more), renormalised over 4 (gamma_5), and exp of a log-prob
    z_max = float(z.abs().max()) / 0.7
    error = softmax_error(10, z_max, unit_roundoff() * z_max) + gamma(5)
    torch.testing.assert_close(logprobs.exp(), want.values / want.values.sum(dim=-1, keepdim=True), atol=0,
                               rtol=2 * error + gamma(1))
    all_ids, all_lp = draft_sparse_distribution(z, 0.7, 0)
    assert all_ids.shape == (3, 10)
    atol = 2 * log_softmax_error(10, z_max, unit_roundoff() * z_max)
    torch.testing.assert_close(all_lp, torch.log_softmax(z / 0.7, dim=-1).gather(-1, all_ids), atol=atol, rtol=0)


def test_draft_sparse_distribution_pads_greedy_and_short_rows():
    z = torch.tensor([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]])
    ids, logprobs = draft_sparse_distribution(z, 0.0, 2)
    assert ids.tolist() == [[1, -1], [0, -1]]  # argmax, ties -> lowest id
    assert logprobs.tolist() == [[0.0, -math.inf], [0.0, -math.inf]]
    ids, logprobs = draft_sparse_distribution(z, 1.0, 5)
    assert ids[:, 3:].tolist() == [[-1, -1], [-1, -1]] and bool((logprobs[:, 3:] == -math.inf).all())
    # probabilities summing to 1: each off by softmax's relative error (and exp's rounding), 3 of them summed
    atol = softmax_error(3, float(z.abs().max())) + gamma(1) + gamma(3)
    torch.testing.assert_close(logprobs[:, :3].exp().sum(dim=-1), torch.ones(2), atol=atol, rtol=0)


def test_draft_sparse_distribution_maps_through_d2t():
    z = torch.tensor([[0.0, 4.0, 1.0]])
    d2t = torch.tensor([0, 5, 10])  # target = draft + d2t[draft]
    ids, _ = draft_sparse_distribution(z, 1.0, 2, d2t)
    assert ids.tolist() == [[6, 12]]
    assert draft_sparse_distribution(z, 0.0, 2, d2t)[0].tolist() == [[6, -1]]


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3), 1.0, 2), r"corrected logits must be \[n, V_d\]"),
    ((torch.zeros(1, 3), -1.0, 2), r"temperature must be finite and >= 0"),
    ((torch.zeros(1, 3), math.inf, 2), r"temperature must be finite and >= 0"),
    ((torch.zeros(1, 3), 1.0, -1), r"top_k must be an int >= 0"),
    ((torch.zeros(1, 3), 1.0, 2.0), r"top_k must be an int >= 0"),
])
def test_draft_sparse_distribution_rejects_bad_arguments(args: tuple, match: str):
    with pytest.raises(ValueError, match=match):
        draft_sparse_distribution(*args)


def test_sample_sparse_draws_from_the_rows():
    g = torch.Generator().manual_seed(6)
    ids = torch.tensor([[4, 1, 7, -1]])
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    logprobs = probs.log().float()[None]
    draws = sample_sparse(ids.expand(20_000, 4), logprobs.expand(20_000, 4), g)
    assert draws.shape == (20_000,)
    index = {4: 0, 1: 1, 7: 2}
    tv, p = goodness_of_fit(torch.tensor([index[d] for d in draws.tolist()]), probs[:3])
    assert p > 1e-3 and tv < 0.01
    assert sample_sparse(ids[0], logprobs[0], g).shape == ()
    with pytest.raises(ValueError, match="at least one id with probability > 0"):
        sample_sparse(torch.tensor([[-1, -1]]), torch.tensor([[0.0, 0.0]]), g)
    with pytest.raises(ValueError, match=r"same shape \[\.\.\., K\]"):
        sample_sparse(ids, logprobs[:, :2], g)


def test_the_sparse_rows_match_the_markov_chains_own_log_probs():
    """run_chain samples x_k ~ softmax(Z_k / T); with top_k = 0 the sparse row gives x_k that same log-prob."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(5, 12, generator=g)
    steps = run_chain(base, 3, None, temperature=0.8, generator=g)
    ids, logprobs = draft_sparse_distribution(steps.logits, 0.8, 0)
    x = torch.tensor(steps.draft_tokens)
    got = torch.where(ids == x[:, None], logprobs, 0.0).sum(dim=-1)
    z_max = float(steps.logits.abs().max()) / 0.8
    atol = 2 * log_softmax_error(12, z_max, unit_roundoff() * z_max)  # two log-softmaxes of Z / T
    torch.testing.assert_close(got, steps.logprobs, atol=atol, rtol=0)


def test_batched_errors_name_the_chain():
    logits, tokens, ids, logprobs = _case()
    batch = dict(logits=torch.stack([logits, logits]), tokens=torch.tensor([tokens, [2, 1, 2]]),
                 draft_ids=torch.stack([ids, ids]), draft_logprobs=torch.stack([logprobs, logprobs]))
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match=r"chain token 2 \(2\) of chain 1 has no mass in its draft row 1"):
        accept_chains(**batch, params=params, generator=None)
    bad_sum = batch | dict(draft_logprobs=torch.stack([logprobs, logprobs.flip(0)]))
    with pytest.raises(ValueError, match=r"draft row \(1, 0\) sums to"):
        accept_chains(**bad_sum, params=params, generator=None)
    with pytest.raises(ValueError, match=r"logits must be \[B, n\+1, V\] and tokens \[B, n\+1\]"):
        accept_chains(**batch | dict(tokens=torch.tensor([tokens])), params=params, generator=None)
    with pytest.raises(ValueError, match=r"chain tokens must be integers"):
        accept_chains(**batch | dict(tokens=batch["tokens"].float()), params=params, generator=None)
    with pytest.raises(ValueError, match=r"draft ids must be \[B=2, n=2, K\]"):
        accept_chains(**batch | dict(draft_ids=ids), params=params, generator=None)
    m, bonus = accept_chains(**batch | dict(tokens=torch.tensor([tokens, tokens])), params=params, generator=None)
    assert m.shape == bonus.shape == (2,)
