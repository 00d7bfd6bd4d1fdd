"""DDTree: best-first construction == exhaustive enumeration; budget, topology, chain seed, Markov chaining."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.drafting.ddtree import DraftTree, build_ddtree, depth_logprobs
from dspark_grpc.runtime.drafting.markov import MarkovHead, run_chain
from dspark_grpc.runtime.models.tree import path_to_root, validate_tree
from tolerance import log_softmax_error

from .reference import brute_force_tree, chain_tolerances, path_score, reference_bias, reference_step

ANCHOR = 3


def per_depth_table(logits: torch.Tensor, top_k: int) -> tuple[list[list[float]], list[list[int]]]:
    lp = torch.log_softmax(logits.float(), -1)
    ranked = torch.sort(lp, dim=-1, descending=True, stable=True)
    return ranked.values[:, :top_k].tolist(), ranked.indices[:, :top_k].tolist()


def rank_tuples(tree: DraftTree, ids: list[list[int]]) -> list[tuple[int, ...]]:
    out = []
    for node in range(1, len(tree.tokens)):
        path = path_to_root(tree.parents, node)[1:]
        out.append(tuple(ids[tree.depths[n] - 1].index(tree.tokens[n]) for n in path))
    return out


def check_structure(tree: DraftTree, n_depths: int) -> None:
    validate_tree(tree.tokens, tree.parents, vocab_size=10**9, max_nodes=10**9)
    assert tree.tokens[0] == ANCHOR and tree.logprobs[0] == 0.0 and tree.depths[0] == 0
    assert len(tree.tokens) == len(tree.parents) == len(tree.logprobs) == len(tree.depths)
    for i in range(1, len(tree.tokens)):
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1 <= n_depths
    siblings = [(p, t) for p, t in zip(tree.parents, tree.tokens, strict=True)]
    assert len(set(siblings)) == len(siblings), "two children of one node carry the same token"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("chain_seed", [False, True])
def test_equals_exhaustive_best_first(seed: int, top_k: int, chain_seed: bool):
    n_depths, vocab = 4, 6
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(n_depths, vocab, generator=g)
    lp, ids = per_depth_table(logits, top_k)
    n_paths = sum(top_k**d for d in range(1, n_depths + 1))
    for budget in (1, 2, 5, 17, n_paths, n_paths + 10):
        tree = build_ddtree(logits, ANCHOR, budget, top_k, chain_seed=chain_seed)
        check_structure(tree, n_depths)
        assert len(tree.tokens) - 1 == min(budget, n_paths)
        got = rank_tuples(tree, ids)
        assert got == brute_force_tree(lp, budget, chain_seed)
        for node, ranks in enumerate(got, start=1):
            assert tree.logprobs[node] == pytest.approx(lp[len(ranks) - 1][ranks[-1]])
        if not chain_seed:
            # best-first: nothing left out scores above anything kept
            left_out = [path_score(lp, t) for t in brute_force_tree(lp, n_paths) if t not in set(got)]
            assert not left_out or min(path_score(lp, t) for t in got) >= max(left_out)


def test_chain_seed_puts_the_top1_chain_first():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 8, generator=g)
    top1 = logits.argmax(-1).tolist()
    for budget in (3, 5, 12):
        tree = build_ddtree(logits, ANCHOR, budget, 4, chain_seed=True)
        n = min(budget, 5)
        assert tree.tokens[1 : n + 1] == top1[:n]
        assert tree.parents[1 : n + 1] == list(range(n))
        assert len(tree.tokens) == budget + 1


def test_equal_scores_pop_in_rank_order():
    logits = torch.zeros(2, 4)  # every token at every depth ties
    tree = build_ddtree(logits, ANCHOR, 6, 3)
    assert tree.tokens[1:] == [0, 1, 2, 0, 1, 2]
    assert tree.parents[1:] == [0, 0, 0, 1, 1, 1]


def test_budget_validation():
    logits = torch.zeros(2, 4)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="budget"):
            build_ddtree(logits, ANCHOR, bad, 2)
    with pytest.raises(ValueError, match="top_k"):
        build_ddtree(logits, ANCHOR, 2, 0)
    assert build_ddtree(torch.zeros(0, 4), ANCHOR, 4, 2).tokens == [ANCHOR]
    assert len(build_ddtree(logits, ANCHOR, 100, 10).tokens) == 1 + 4 + 16  # top_k is capped at the vocab


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_markov_bias_chained_along_the_argmax_path(kind: str):
    n_depths, v_d, v_t, r, h = 4, 12, 20, 4, 8
    torch.manual_seed(10)
    markov = MarkovHead(kind, v_t, v_d, r, h).requires_grad_(False)
    base = torch.randn(n_depths, v_d)
    hidden = torch.randn(n_depths, h)
    d2t = torch.randperm(v_t)[:v_d].sort().values - torch.arange(v_d)

    # manual: depth 1 is biased by the anchor, depth d by the argmax of the corrected depth d-1
    prev, state, rows = ANCHOR, [0.0] * r, []
    for d in range(n_depths):
        _, v, state = reference_step(markov, prev, hidden[d].tolist(), state)
        z = base[d] + torch.tensor(reference_bias(markov, v), dtype=torch.float32)
        rows.append(torch.log_softmax(z, -1))
        x = int(z.argmax())
        prev = x + int(d2t[x])
    expected = torch.stack(rows)
    # float32 both: the chain's Z = U + W2 v against U + (float64 bias rounded to float32), each log-softmaxed
    atol = chain_tolerances(base, markov, None, hidden, hidden, sides=2)[0]
    torch.testing.assert_close(depth_logprobs(base, ANCHOR, markov, hidden, d2t), expected, atol=atol, rtol=0)
    steps = run_chain(base, ANCHOR, markov, hidden, d2t)
    torch.testing.assert_close(torch.log_softmax(steps.logits, -1), expected, atol=atol, rtol=0)

    tree = build_ddtree(base, ANCHOR, 10, 3, markov=markov, hidden_post=hidden, d2t=d2t, chain_seed=True)
    assert tree.tokens[1 : n_depths + 1] == steps.tokens  # target ids, not draft ids
    log_probs = torch.log_softmax(steps.logits, -1)
    lp, ids = per_depth_table(log_probs, 3)
    again = log_softmax_error(v_d, float(log_probs.abs().max()))  # the table log-softmaxes the log-probs once more
    for node in range(1, len(tree.tokens)):
        d = tree.depths[node]
        draft = [i + int(d2t[i]) for i in ids[d - 1]].index(tree.tokens[node])
        assert tree.logprobs[node] == pytest.approx(lp[d - 1][draft], abs=again)
    plain = build_ddtree(base, ANCHOR, 10, 3, d2t=d2t, chain_seed=True)
    assert plain.tokens[1 : n_depths + 1] == [int(x) + int(d2t[x]) for x in base.argmax(-1)]
