"""DDTree: a best-first draft tree over per-depth top-K candidates (Ringel & Romano), optionally Markov-biased.

The score of a path is the sum of its per-depth log-probs log q_d(token). Candidates come from one heap:
popping a node appends it and pushes its next sibling (same parent, next rank) and its first child (next
depth, rank 0), so the tree is always the best `budget` paths that form a prefix-closed set.

Deterministic ties: the ranks at a depth order tokens by (log-prob desc, draft id asc), and equal path
scores pop in lexicographic order of their rank tuples (so a parent, and an earlier sibling, pop first).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from dspark_grpc.runtime.drafting.markov import MarkovHead, run_chain, to_target
from torch import Tensor


@dataclass
class DraftTree:
    tokens: list[int]  # target ids; node 0 is the root = the anchor
    parents: list[int]  # parents[0] == -1, parents[i] < i
    logprobs: list[float]  # node 0: 0.0; others: log q_d(token), the per-depth log-softmax used for scoring
    depths: list[int]  # root 0


def depth_logprobs(base_logits: Tensor, anchor: int, markov: MarkovHead | None = None,
                   hidden_post: Tensor | None = None, d2t: Tensor | None = None) -> Tensor:
    """[D, V_d] per-depth log-softmax; with a Markov head depth d is biased by the argmax of depth d-1 (§2.4)."""
    assert base_logits.dim() == 2, f"base_logits must be [D, V_d], got {tuple(base_logits.shape)}"
    logits = base_logits.float() if markov is None else run_chain(base_logits, anchor, markov, hidden_post, d2t).logits
    return torch.log_softmax(logits, dim=-1)


def build_ddtree(base_logits: Tensor, anchor: int, budget: int, top_k: int, markov: MarkovHead | None = None,
                 hidden_post: Tensor | None = None, d2t: Tensor | None = None, chain_seed: bool = False) -> DraftTree:
    """base_logits [D, V_d] (row d-1 drafts depth d) -> a tree of at most `budget` nodes below the anchor.

    chain_seed inserts the full top-1 chain (rank 0 at every depth, up to the budget) first.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be an int >= 1 (nodes below the root), got {budget!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
    logp = depth_logprobs(base_logits, anchor, markov, hidden_post, d2t)
    n_depths, vocab = logp.shape
    k = min(top_k, vocab)
    ranked = torch.sort(logp, dim=-1, descending=True, stable=True)
    lp = ranked.values[:, :k].tolist()
    ids = ranked.indices[:, :k].tolist()

    tree = DraftTree([anchor], [-1], [0.0], [0])
    if n_depths == 0:
        return tree
    scores = [0.0]  # path score per node
    # heap entries: (-score, rank tuple, parent node, depth, rank)
    heap: list[tuple[float, tuple[int, ...], int, int, int]] = []

    def add_node(parent: int, depth: int, rank: int) -> int:
        tree.tokens.append(to_target(ids[depth - 1][rank], d2t))
        tree.parents.append(parent)
        tree.logprobs.append(lp[depth - 1][rank])
        tree.depths.append(depth)
        scores.append(scores[parent] + lp[depth - 1][rank])
        return len(tree.tokens) - 1

    def push(parent: int, depth: int, rank: int, ranks: tuple[int, ...]) -> None:
        heapq.heappush(heap, (-(scores[parent] + lp[depth - 1][rank]), ranks, parent, depth, rank))

    if chain_seed:
        parent = 0
        for depth in range(1, min(n_depths, budget) + 1):
            if k > 1:
                push(parent, depth, 1, (0,) * (depth - 1) + (1,))
            parent = add_node(parent, depth, 0)
    else:
        push(0, 1, 0, (0,))
    while heap and len(tree.tokens) - 1 < budget:
        _, ranks, parent, depth, rank = heapq.heappop(heap)
        node = add_node(parent, depth, rank)
        if rank + 1 < k:
            push(parent, depth, rank + 1, ranks[:-1] + (rank + 1,))
        if depth < n_depths:
            push(node, depth + 1, 0, ranks + (0,))
    return tree
