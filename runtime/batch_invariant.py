"""Attention whose every row equals a 1-row step over the same keys, bitwise (the fast precision's verify).

Greedy speculation is lossless only if a row of an M-row verify computes exactly what a 1-row AR step computes.
The matmuls on the fast path (int4pack, oneDNN-packed bf16) and the row-wise ops are invariant in the row count,
but CPU scaled_dot_product_attention is not: with a mask and several query rows it blocks the softmax
differently than with one row (bf16 and float32 alike). So each masked row runs alone, unmasked, over the key
rows it may see: a prefix of the cache (a chain) as a slice, anything else (a tree) gathered in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RowKeys = list[int | torch.Tensor]


def row_keys(mask: torch.Tensor) -> RowKeys:
    """For mask [T, S] bool: per row, the key rows it sees as a prefix length n or as an index tensor."""
    T, S = mask.shape
    counts = mask.sum(dim=1)
    prefix = (mask == (torch.arange(S, device=mask.device) < counts[:, None])).all(dim=1).tolist()
    return [int(n) if p else mask[i].nonzero().flatten()
            for i, (n, p) in enumerate(zip(counts.tolist(), prefix, strict=True))]


def attention_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: RowKeys) -> torch.Tensor:
    """q [H, T, D], k/v [KV, S, D] -> [H, T, D]; row i attends to keys[i] exactly as a 1-row step would."""
    assert q.shape[1] == len(keys) and k.shape == v.shape, (q.shape, len(keys), k.shape, v.shape)
    outs = []
    for i, n in enumerate(keys):
        ki, vi = (k[:, :n], v[:, :n]) if isinstance(n, int) else (k.index_select(1, n), v.index_select(1, n))
        outs.append(F.scaled_dot_product_attention(q[None, :, i : i + 1], ki[None], vi[None], enable_gqa=True)[0])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
