"""Attention whose every row equals a 1-row step over the same keys, bitwise (the fast precision's verify).

Greedy speculation is lossless only if a row of an M-row verify computes exactly what a 1-row AR step computes.
The matmuls on the fast path (int4pack, oneDNN-packed bf16) and the row-wise ops are invariant in the row count,
but CPU scaled_dot_product_attention is not: its result for a row depends on how many query rows it runs with
and on the key length (its blocking), masked or not. So every row, in a verify and in an AR step alike, runs as
its own batch element with one query row, over its visible key rows moved to the front (a prefix of the cache
as it is; a tree row's ancestors gathered in order) and padded to a length that depends on the row only (its
visible count rounded up to BUCKET), the padding masked. Identical inputs per row, and in bf16 the kernel
computes a batch element the same whatever the batch size (tested; not so in float32 with 2 threads). Rows that
share a padded length run in one call. Prompt chunks keep one plain causal call:
AR and speculation prefill a prompt alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RowKeys = list[int | torch.Tensor]
BUCKET = 64


def row_keys(mask: torch.Tensor) -> RowKeys:
    """For mask [T, S] bool: per row, the key rows it sees as a prefix length n or as an index tensor."""
    T, S = mask.shape
    counts = mask.sum(dim=1)
    prefix = (mask == (torch.arange(S, device=mask.device) < counts[:, None])).all(dim=1).tolist()
    return [int(n) if p else mask[i].nonzero().flatten()
            for i, (n, p) in enumerate(zip(counts.tolist(), prefix, strict=True))]


def padded_length(visible: int) -> int:
    return max(BUCKET, -(-visible // BUCKET) * BUCKET)


def attention_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: RowKeys) -> torch.Tensor:
    """q [H, T, D], k/v [KV, S, D] -> [H, T, D]; row i attends to keys[i] exactly as a 1-row step would."""
    H, T, D = q.shape
    assert T == len(keys) and k.shape == v.shape and k.shape[-1] == D, (q.shape, len(keys), k.shape, v.shape)
    counts = [n if isinstance(n, int) else int(n.numel()) for n in keys]
    out = q.new_empty(T, H, D)
    for length in sorted({padded_length(n) for n in counts}):
        rows = [i for i, n in enumerate(counts) if padded_length(n) == length]
        pad = max(0, length - k.shape[1])
        kp, vp = (F.pad(t[:, :length], (0, 0, 0, pad)) for t in (k, v))  # [KV, length, D], zeros past S
        gathered = [i for i in rows if not isinstance(keys[i], int)]
        if gathered:
            kg, vg = kp[None].repeat(len(rows), 1, 1, 1), vp[None].repeat(len(rows), 1, 1, 1)
            for j, i in enumerate(rows):
                if i in gathered:
                    n = counts[i]
                    kg[j, :, :n], vg[j, :, :n] = k.index_select(1, keys[i]), v.index_select(1, keys[i])
        else:
            kg, vg = kp[None].expand(len(rows), -1, -1, -1), vp[None].expand(len(rows), -1, -1, -1)
        visible = torch.arange(length) < torch.tensor([counts[i] for i in rows])[:, None]
        idx = torch.tensor(rows)
        o = F.scaled_dot_product_attention(q.index_select(1, idx).transpose(0, 1)[:, :, None], kg, vg,
                                           attn_mask=visible[:, None, None], enable_gqa=True)
        out.index_copy_(0, idx, o[:, :, 0])
    return out.transpose(0, 1)
