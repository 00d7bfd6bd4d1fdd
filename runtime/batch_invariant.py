"""Attention whose every row equals a 1-row step over the same keys, bitwise (the fast precision's verify).

Greedy speculation is lossless only if a row of an M-row verify computes exactly what a 1-row AR step computes.
The matmuls on the fast path (int4pack, oneDNN-packed bf16) and the row-wise ops are invariant in the row count,
but CPU scaled_dot_product_attention is not: its result for a row depends on how many query rows it runs with
and on the key length (its blocking), masked or not. So every call has one shape per key bucket: QROWS query
rows (a row's neighbours, or zeros that see key 0 only) over keys padded to the row's visible count rounded up
to BUCKET, masked per row. With the shape fixed, a row's result depends only on its own query, its mask row and
the key rows it sees, at their positions — not on its place among the query rows nor on masked keys (finite
values; tested in bf16 with 1 and 2 threads, tests/runtime/test_batch_invariance.py). A chain row (an AR step,
a chain verify, a tree's first branch) sees a prefix of the cache at the positions its AR step sees, so rows
share a call; any other tree row gets its visible rows gathered to the front, one batch element each. Prompt
chunks keep one plain causal call: AR and speculation prefill a prompt alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RowKeys = list[int | torch.Tensor]
BUCKET = 64
QROWS = 16


def row_keys(mask: torch.Tensor) -> RowKeys:
    """For mask [T, S] bool: per row, the key rows it sees as a prefix length n or as an index tensor."""
    T, S = mask.shape
    counts = mask.sum(dim=1)
    prefix = (mask == (torch.arange(S, device=mask.device) < counts[:, None])).all(dim=1).tolist()
    return [int(n) if p else mask[i].nonzero().flatten()
            for i, (n, p) in enumerate(zip(counts.tolist(), prefix, strict=True))]


def padded_length(visible: int) -> int:
    return max(BUCKET, -(-visible // BUCKET) * BUCKET)


def _keys_padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """[KV, S, D] -> its first `length` rows. Past S: the rows behind it in its storage when it is a view of a
    longer buffer (a KVCache's: zero-initialized, so finite; they are masked), else zeros (a copy)."""
    if length <= t.shape[1]:
        return t[:, :length]
    kv, _, d = t.shape
    if t.stride(2) == 1 and t.stride(1) == d and t.stride(0) >= length * d:
        end = t.storage_offset() + (kv - 1) * t.stride(0) + length * d
        if end * t.element_size() <= t.untyped_storage().nbytes():
            return t.as_strided((kv, length, d), t.stride())
    return F.pad(t, (0, 0, 0, length - t.shape[1]))


def _queries(q: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """q's `rows` as a [H, QROWS, D] block, zeros after them."""
    block = q.new_zeros(q.shape[0], QROWS, q.shape[2])
    block[:, : len(rows)] = q[:, rows]
    return block


def _visible(counts: list[int], length: int) -> torch.Tensor:
    """[QROWS, length] bool: row j sees keys [0, counts[j]); padding rows see key 0."""
    n = torch.tensor(counts + [1] * (QROWS - len(counts)))
    return torch.arange(length) < n[:, None]


def attention_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: RowKeys) -> torch.Tensor:
    """q [H, T, D], k/v [KV, S, D] -> [H, T, D]; row i attends to keys[i] exactly as a 1-row step would."""
    H, T, D = q.shape
    assert T == len(keys) and k.shape == v.shape and k.shape[-1] == D, (q.shape, len(keys), k.shape, v.shape)
    out = q.new_empty(H, T, D)
    chains: dict[int, list[int]] = {}
    for i, n in enumerate(keys):
        if isinstance(n, int):
            chains.setdefault(padded_length(n), []).append(i)
    for length, rows in chains.items():
        kp, vp = _keys_padded(k, length), _keys_padded(v, length)
        for c in range(0, len(rows), QROWS):
            chunk = rows[c : c + QROWS]
            o = F.scaled_dot_product_attention(_queries(q, chunk)[None], kp[None], vp[None],
                                               attn_mask=_visible([keys[i] for i in chunk], length), enable_gqa=True)
            out[:, chunk] = o[0, :, : len(chunk)]
    trees: dict[int, list[int]] = {}
    for i, n in enumerate(keys):
        if not isinstance(n, int):
            trees.setdefault(padded_length(n.numel()), []).append(i)
    for length, rows in trees.items():
        kg, vg = (k.new_zeros(len(rows), k.shape[0], length, D) for _ in range(2))
        for j, i in enumerate(rows):
            kg[j, :, : keys[i].numel()], vg[j, :, : keys[i].numel()] = k[:, keys[i]], v[:, keys[i]]
        qg = torch.stack([_queries(q, [i]) for i in rows])
        mask = torch.stack([_visible([keys[i].numel()], length) for i in rows])[:, None]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, enable_gqa=True)
        out[:, rows] = o[:, :, 0].transpose(0, 1)
    return out
