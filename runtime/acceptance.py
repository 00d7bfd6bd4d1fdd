"""Which part of a verified tree the target accepts.

Sample-and-match (SpecInfer's naive rule): at each visited node draw y from the target's own
distribution there; if y is a child of the node, move to it, otherwise y is the bonus token. Every
emitted token is a target sample, so the rule is exact for any tree at any temperature, and at
temperature 0 it is the greedy tree walk. One target sample is drawn per emitted token, in order,
exactly as AR decoding draws them.
"""

from __future__ import annotations

import torch
from dspark_grpc.runtime.sampling import SamplingParams, sample


def children_by_token(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    children: list[dict[int, int]] = [{} for _ in tokens]
    for node in range(1, len(tokens)):
        children[parents[node]].setdefault(tokens[node], node)
    return children


def accept_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Returns (accepted root-to-node path starting at 0, bonus token)."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens) == len(parents)
    children = children_by_token(tokens, parents)
    path = [0]
    while True:
        y = int(sample(logits[path[-1]], params, generator))
        child = children[path[-1]].get(y)
        if child is None:
            return path, y
        path.append(child)
