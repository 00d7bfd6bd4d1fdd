"""Trees from n-gram candidates and the merge with a DDTree: dedup by path, best-first budget, sources."""

from __future__ import annotations

import math
import random

import pytest
import torch
from dspark_grpc.runtime.drafting.ddtree import DraftTree, build_ddtree
from dspark_grpc.runtime.drafting.ngram import (
    SOURCE_BASE,
    SOURCE_BOTH,
    SOURCE_NGRAM,
    SOURCE_ROOT,
    Candidate,
    NgramIndex,
    candidates_tree,
    merge_trees,
    ngram_tree,
)
from dspark_grpc.runtime.models.tree import path_to_root, tree_depths, validate_tree

ANCHOR = 9


def check_tree(tree: DraftTree) -> None:
    validate_tree(tree.tokens, tree.parents, vocab_size=10**9, max_nodes=10**9)
    assert len(tree.tokens) == len(tree.parents) == len(tree.logprobs) == len(tree.depths)
    assert tree.tokens[0] == ANCHOR and tree.logprobs[0] == 0.0 and tree.depths == tree_depths(tree.parents)


def token_path(tree: DraftTree, node: int) -> tuple[int, ...]:
    return tuple(tree.tokens[i] for i in path_to_root(tree.parents, node)[1:])


def paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Non-root token path -> best log-prob of its last node."""
    out: dict[tuple[int, ...], float] = {}
    for i in range(1, len(tree.tokens)):
        p = token_path(tree, i)
        out[p] = max(out.get(p, -math.inf), tree.logprobs[i])
    return out


def path_score(tree: DraftTree, node: int) -> float:
    return sum(tree.logprobs[i] for i in path_to_root(tree.parents, node))


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    tree = DraftTree([ANCHOR], [-1], [0.0], [0])
    for i in range(1, n + 1):
        parent = rng.randrange(i)
        tree.tokens.append(rng.randrange(vocab))
        tree.parents.append(parent)
        tree.logprobs.append(-rng.choice([0.0, 0.5, 1.0, 2.0, rng.uniform(0, 6)]))
        tree.depths.append(tree.depths[parent] + 1)
    return tree


def random_candidates(rng: random.Random, k: int, vocab: int) -> list[Candidate]:
    out = []
    for _ in range(k):
        n = rng.randint(1, 4)
        out.append(Candidate([rng.randrange(vocab) for _ in range(rng.randint(1, 6))], math.log(n / (n + 1)), n))
    return out


def test_one_candidate_is_a_chain():
    c = Candidate([4, 5, 6, 7], math.log(0.75), 3)
    tree = ngram_tree(ANCHOR, [c], budget=16)
    check_tree(tree)
    assert tree == DraftTree([ANCHOR, 4, 5, 6, 7], [-1, 0, 1, 2, 3], [0.0] + [math.log(0.75)] * 4, [0, 1, 2, 3, 4])
    assert ngram_tree(ANCHOR, [c], budget=2) == DraftTree([ANCHOR, 4, 5], [-1, 0, 1], [0.0] + [math.log(0.75)] * 2,
                                                          [0, 1, 2])
    assert ngram_tree(ANCHOR, [c], budget=0) == DraftTree([ANCHOR], [-1], [0.0], [0])
    assert ngram_tree(ANCHOR, [], budget=8) == DraftTree([ANCHOR], [-1], [0.0], [0])


def test_candidates_share_prefixes_and_the_budget_keeps_the_best_paths():
    good, weak = math.log(0.8), math.log(0.5)
    cands = [Candidate([1, 2, 3], good, 4), Candidate([1, 4], weak, 1), Candidate([5, 6], weak, 1)]
    full = ngram_tree(ANCHOR, cands, budget=16)
    check_tree(full)
    assert full.tokens == [ANCHOR, 1, 2, 3, 4, 5, 6] and full.parents == [-1, 0, 1, 2, 1, 0, 5]
    assert full.logprobs == [0.0, good, good, good, weak, weak, weak]
    # path scores: 1: -0.22, 1-2: -0.45, 1-2-3: -0.67, 1-4: -0.92, 5: -0.69, 5-6: -1.39
    assert ngram_tree(ANCHOR, cands, budget=4).tokens == [ANCHOR, 1, 2, 3, 5]
    assert ngram_tree(ANCHOR, cands, budget=5).tokens == [ANCHOR, 1, 2, 3, 4, 5]


def test_merge_dedups_by_token_path_and_attributes_sources():
    base = DraftTree([ANCHOR, 1, 2, 3], [-1, 0, 1, 0], [0.0, -0.1, -0.2, -1.5], [0, 1, 2, 1])
    cands = [Candidate([1, 2, 7], math.log(0.8), 4), Candidate([8], math.log(0.5), 1)]
    merged, sources = merge_trees(base, cands, budget=16)
    check_tree(merged)
    assert merged.tokens == [ANCHOR, 1, 2, 3, 7, 8]
    assert merged.parents == [-1, 0, 1, 0, 2, 0]
    assert merged.logprobs == [0.0, -0.1, -0.2, -1.5, math.log(0.8), math.log(0.5)]
    assert sources == [SOURCE_ROOT, SOURCE_BOTH, SOURCE_BOTH, SOURCE_BASE, SOURCE_NGRAM, SOURCE_NGRAM]
    # the same from an n-gram tree instead of candidates
    assert merge_trees(base, candidates_tree(ANCHOR, cands), budget=16) == (merged, sources)
    # budget 3: 1 (-0.1), 1-2 (-0.3), 1-2-7 (-0.52) beat 8 (-0.69) and 3 (-1.5)
    small, small_sources = merge_trees(base, cands, budget=3)
    assert small.tokens == [ANCHOR, 1, 2, 7] and small.parents == [-1, 0, 1, 2]
    assert small_sources == [SOURCE_ROOT, SOURCE_BOTH, SOURCE_BOTH, SOURCE_NGRAM]
    assert merge_trees(base, cands, budget=0) == (DraftTree([ANCHOR], [-1], [0.0], [0]), [SOURCE_ROOT])


def test_merge_keeps_a_base_tree_with_nothing_to_add():
    base = DraftTree([ANCHOR, 1, 2, 3], [-1, 0, 1, 0], [0.0, -0.1, -0.2, -1.5], [0, 1, 2, 1])
    assert merge_trees(base, [], budget=3) == (base, [SOURCE_ROOT] + [SOURCE_BASE] * 3)
    assert merge_trees(base, base, budget=3) == (base, [SOURCE_ROOT] + [SOURCE_BOTH] * 3)


def test_merge_errors():
    base = DraftTree([ANCHOR, 1], [-1, 0], [0.0, -0.1], [0, 1])
    with pytest.raises(ValueError, match="different roots"):
        merge_trees(base, DraftTree([ANCHOR + 1], [-1], [0.0], [0]), budget=4)
    for budget in (-1, 1.5, True):
        with pytest.raises(ValueError, match="budget"):
            merge_trees(base, [], budget=budget)


@pytest.mark.parametrize("seed", range(40))
def test_merge_properties_on_random_trees(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 6])
    base = random_tree(rng, rng.randint(0, 25), vocab)
    extra = random_tree(rng, rng.randint(0, 25), vocab) if rng.random() < 0.5 else random_candidates(rng, 5, vocab)
    extra_tree = extra if isinstance(extra, DraftTree) else candidates_tree(ANCHOR, extra)
    base_paths, extra_paths = paths(base), paths(extra_tree)
    union = base_paths.keys() | extra_paths.keys()

    merged, sources = merge_trees(base, extra, budget=len(union) + rng.randint(0, 3))
    check_tree(merged)
    merged_paths = [token_path(merged, i) for i in range(1, len(merged.tokens))]
    assert len(merged_paths) == len(set(merged_paths)) and set(merged_paths) == union
    assert sources[0] == SOURCE_ROOT
    for i, p in enumerate(merged_paths, start=1):
        assert sources[i] == (SOURCE_BASE if p in base_paths else 0) | (SOURCE_NGRAM if p in extra_paths else 0)
        assert merged.logprobs[i] == max(base_paths.get(p, -math.inf), extra_paths.get(p, -math.inf))

    budget = rng.randint(0, len(union))
    trimmed, trimmed_sources = merge_trees(base, extra, budget=budget)
    check_tree(trimmed)
    assert len(trimmed.tokens) - 1 == budget
    kept = {token_path(trimmed, i): i for i in range(1, len(trimmed.tokens))}
    full = {p: i for i, p in enumerate(merged_paths, start=1)}
    for p, i in kept.items():
        assert trimmed_sources[i] == sources[full[p]] and trimmed.logprobs[i] == merged.logprobs[full[p]]
    # all log-probs are <= 0, so best-first == the `budget` best path scores
    kept_scores = [path_score(merged, full[p]) for p in kept]
    dropped_scores = [path_score(merged, i) for p, i in full.items() if p not in kept]
    if kept_scores and dropped_scores:
        assert min(kept_scores) >= max(dropped_scores) - 1e-9
    # union order is kept: the trimmed tree's nodes appear in the merged tree's order
    assert sorted(kept.values()) == list(range(1, len(trimmed.tokens)))
    order = [full[token_path(trimmed, i)] for i in range(1, len(trimmed.tokens))]
    assert order == sorted(order)


@pytest.mark.parametrize("seed", range(4))
def test_hybrid_with_a_ddtree(seed: int):
    gen = torch.Generator().manual_seed(seed)
    base = build_ddtree(torch.randn(6, 20, generator=gen) * 3, ANCHOR, budget=12, top_k=4)
    deepest = max(range(len(base.tokens)), key=lambda i: (base.depths[i], -i))
    drafted = list(token_path(base, deepest))
    context = [1, 2, ANCHOR, *drafted, 25, 26, 1, 2, ANCHOR]
    cands = NgramIndex(4, context).candidates()
    assert cands[0] == Candidate([*drafted, 25, 26, 1, 2, ANCHOR][:8], math.log(3 / 4), 3)
    merged, sources = merge_trees(base, cands, budget=64)
    check_tree(merged)
    node, walked = 0, []
    for t in cands[0].tokens:
        node = next(i for i in range(1, len(merged.tokens)) if merged.parents[i] == node and merged.tokens[i] == t)
        walked.append(sources[node])
    assert walked == [SOURCE_BOTH] * len(drafted) + [SOURCE_NGRAM] * (len(cands[0].tokens) - len(drafted))
    assert sources.count(SOURCE_BASE) + sources.count(SOURCE_BOTH) == 12
    assert merged.tokens[:13] == base.tokens and merged.parents[:13] == base.parents
