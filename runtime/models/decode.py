"""Model steps on one sequence: prefill a prompt, verify a token tree in one forward, commit a path.

Plain autoregressive decoding is verify_tree with a single root node, then commit_path([0]).
Each step takes an optional `forward` (a SequenceInput -> ForwardOutput callable, e.g. a StepBatcher's, which
runs it in a ragged batch with other sessions' steps); the default runs it alone.
Inputs are validated by the caller (target_service/engine.py checks a request's tokens, tree and path once, where
it enters); these functions only assert what they rely on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from dspark_grpc.runtime.models.kv_cache import KVCache
from dspark_grpc.runtime.models.transformer import ForwardOutput, SequenceInput, Transformer
from dspark_grpc.runtime.models.tree import ancestor_mask, is_root_path, tree_depths

Forward = Callable[[SequenceInput], ForwardOutput]


def run_alone(model: Transformer) -> Forward:
    return lambda inp: model.forward_batch([inp])[0]


def prefill(
    model: Transformer,
    cache: KVCache,
    tokens: Sequence[int],
    capture_layers: Sequence[int] = (),
    chunk_size: int = 512,
    forward: Forward | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run and commit `tokens` after the cache's committed rows, `chunk_size` rows per forward.

    Returns the last token's logits [V] (float32) and the captures [T, L, H] (None without capture layers).
    """
    assert tokens, "prefill needs at least one token"
    captures = []
    for begin in range(0, len(tokens), chunk_size):
        chunk = torch.tensor(tokens[begin : begin + chunk_size], dtype=torch.long)
        T = chunk.shape[0]
        positions = torch.arange(cache.length, cache.length + T)
        out = (forward or run_alone(model))(SequenceInput(
            chunk, positions, cache, logits_rows=torch.tensor([T - 1]), capture_layers=tuple(capture_layers)))
        cache.commit(range(T))
        captures.append(out.captures)
    if not capture_layers:
        return out.logits[0], None
    return out.logits[0], captures[0] if len(captures) == 1 else torch.cat(captures)


def verify_tree(
    model: Transformer,
    cache: KVCache,
    tokens: Sequence[int],
    parents: Sequence[int],
    capture_layers: Sequence[int] = (),
    forward: Forward | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over the N tree nodes, each at position cache.length + depth and attending to every
    committed row and to its own ancestors. The N rows stay pending in the cache until commit_path.

    The tree is validated by the caller (runtime/tree.validate_tree, as TargetEngine.verify does).
    Returns logits [N, V] (float32) and captures [N, L, H] (None without capture layers).
    """
    assert len(tokens) == len(parents) >= 1, (len(tokens), len(parents))
    out = (forward or run_alone(model))(tree_input(cache, tokens, parents, capture_layers))
    cache.pending_parents = list(parents)
    return out.logits, out.captures


def tree_input(cache: KVCache, tokens: Sequence[int], parents: Sequence[int],
               capture_layers: Sequence[int] = ()) -> SequenceInput:
    """The forward input of a (validated) tree on top of the cache's committed rows."""
    n, start = len(tokens), cache.length
    positions = torch.tensor(tree_depths(parents), dtype=torch.long) + start
    return SequenceInput(torch.tensor(list(tokens), dtype=torch.long), positions, cache,
                         new_rows_mask=ancestor_mask(parents) if n > 1 else None, capture_layers=tuple(capture_layers))


def commit_path(cache: KVCache, path: Sequence[int]) -> None:
    """Keep the pending rows of a root-to-node path (node indices of the last verify) as committed rows; the path is
    validated by the caller (TargetEngine.commit)."""
    parents = cache.pending_parents
    if parents is None:
        parents = [i - 1 for i in range(cache.pending)]  # rows of a plain causal forward form a chain
    assert is_root_path(parents, path), (list(path), parents)
    cache.commit(list(path))
