"""Token trees as (tokens, parents) in topological order: node 0 is the root (parent -1), parent[i] < i."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TreeError(ValueError):
    """A token tree that cannot be verified; the message says what to fix."""


def validate_tree(tokens: Sequence[int], parents: Sequence[int], vocab_size: int, max_nodes: int) -> None:
    n = len(tokens)
    if n == 0:
        raise TreeError("the tree is empty: send at least the root token")
    if len(parents) != n:
        raise TreeError(f"tokens has {n} entries but parents has {len(parents)}; give one parent per token")
    if n > max_nodes:
        raise TreeError(f"the tree has {n} nodes, more than the limit of {max_nodes}")
    if parents[0] != -1:
        raise TreeError(f"node 0 is the root and its parent must be -1, got {parents[0]}")
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise TreeError(
                f"node {i} has parent {parents[i]}; every non-root node's parent must be an earlier node "
                f"(0 <= parent < {i}): list nodes in topological order"
            )
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise TreeError(f"node {i} has token id {t}, outside the vocabulary [0, {vocab_size})")


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node (the root has depth 0)."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def path_to_root(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root down to `node`."""
    if not 0 <= node < len(parents):
        raise ValueError(f"node {node} is not in a tree of {len(parents)} nodes")
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def is_root_path(parents: Sequence[int], path: Sequence[int]) -> bool:
    """Whether `path` starts at the root and each node is the child of the one before it."""
    if not path or path[0] != 0:
        return False
    n = len(parents)
    return all(0 <= b < n and parents[b] == a for a, b in zip(path, path[1:], strict=False))
