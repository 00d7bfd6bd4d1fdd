"""Attention whose every row equals a 1-row step over the same keys, bitwise (the fast precision's verify).

Greedy speculation is lossless only if a row of an M-row verify computes exactly what a 1-row AR step computes.
The matmuls on the fast path (int4pack, oneDNN-packed bf16) and the row-wise ops are invariant in the row count,
but CPU scaled_dot_product_attention is not: its result for a row depends on how many query rows it runs with
and on the key length (its blocking), masked or not. So every row runs in a batch element of one fixed shape:
QROWS query rows (its chain neighbours, or copies of it whose results are dropped) over keys padded to its visible
count rounded up to BUCKET, masked per row. With the shape fixed, a row's result depends only on its own query,
its mask row and the key rows it sees, at their positions: not on its place among the query rows, on the other
rows, on masked keys (finite values) or on the other batch elements (tested in bf16 with 1 and 2 threads, not so
in float32; tests/runtime/test_batch_invariance.py). A chain row (an AR step, a chain verify, a tree's first
branch) sees a prefix of the cache at the positions its AR step sees, so chain rows share the cache's keys; any
other tree row gets its visible rows gathered to the front, an element of its own. QROWS = 4: single-thread SDPA
costs per layer (256 keys) 98 us for an AR step (a plain 1-row call: ~250 us), 350 us for 16 chain rows and 1.4
ms for 16 tree rows (QROWS 16: 200 us, 190 us, 3.2 ms). Prompt chunks keep one plain causal call: AR and
speculation prefill a prompt alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

RowKeys = list[int | torch.Tensor]
BUCKET = 64
QROWS = 4


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


@dataclass(frozen=True)
class _Call:
    """One SDPA call over `length` keys: G batch elements of QROWS query rows each, giving output rows `rows`."""

    length: int
    rows: list[int]
    queries: torch.Tensor  # [G, QROWS] query row indices
    mask: torch.Tensor  # [G, 1, QROWS, length]
    gather: list[torch.Tensor] | None = None  # tree rows (one per element, first query row): their key rows


@dataclass(frozen=True)
class RowPlan:
    """How a segment's rows attend (built once per forward, used by every layer)."""

    rows: int
    calls: list[_Call]


def _visible(counts: list[int], length: int) -> torch.Tensor:
    """[QROWS, length] bool: row j sees keys [0, counts[j]); padding rows see key 0 (on the CPU: plan_rows moves
    the plan to the model's device once)."""
    n = torch.tensor(counts + [1] * (QROWS - len(counts)))
    return torch.arange(length) < n[:, None]


def _padded_rows(rows: list[int]) -> list[int]:
    """Query row indices padded to QROWS by repeating the first (padding rows' results are dropped)."""
    return rows + [rows[0]] * (QROWS - len(rows))


def plan_rows(keys: RowKeys, device: torch.device | str | None = None) -> RowPlan:
    """The plan of rows with these keys (`row_keys`, computed from a mask on the CPU), its index and mask tensors on
    `device` (the model's; None: the CPU), where `attention_by_row` uses them in every layer."""
    chains: dict[int, list[int]] = {}
    trees: dict[int, list[int]] = {}
    for i, n in enumerate(keys):
        if isinstance(n, int):
            chains.setdefault(padded_length(n), []).append(i)
        else:
            trees.setdefault(padded_length(n.numel()), []).append(i)
    calls = []
    for length, rows in chains.items():
        chunks = [rows[c : c + QROWS] for c in range(0, len(rows), QROWS)]
        calls.append(_Call(length, rows, torch.tensor([_padded_rows(c) for c in chunks], device=device),
                           torch.stack([_visible([keys[i] for i in c], length) for c in chunks])[:, None].to(device)))
    for length, rows in trees.items():
        calls.append(_Call(length, rows, torch.tensor([_padded_rows([i]) for i in rows], device=device),
                           torch.stack([_visible([keys[i].numel()], length) for i in rows])[:, None].to(device),
                           [keys[i].to(device) for i in rows]))
    return RowPlan(len(keys), calls)


def attention_by_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowPlan | RowKeys) -> torch.Tensor:
    """q [H, T, D], k/v [KV, S, D] -> [H, T, D]; row i attends to its keys exactly as a 1-row step would."""
    plan = plan if isinstance(plan, RowPlan) else plan_rows(plan, q.device)
    H, T, D = q.shape
    assert T == plan.rows and k.shape == v.shape and k.shape[-1] == D, (q.shape, plan.rows, k.shape, v.shape)
    out = None
    for call in plan.calls:
        G = call.queries.shape[0]
        qg = q.index_select(1, call.queries.flatten()).view(H, G, QROWS, D).transpose(0, 1)
        if call.gather is None:  # chain chunks share the cache's keys, as they are
            kp, vp = _keys_padded(k, call.length), _keys_padded(v, call.length)
            kg, vg = kp[None].expand(G, -1, -1, -1), vp[None].expand(G, -1, -1, -1)
        else:
            kg, vg = (t.new_zeros(G, t.shape[0], call.length, D) for t in (k, v))
            for j, idx in enumerate(call.gather):
                kg[j, :, : idx.numel()], vg[j, :, : idx.numel()] = k[:, idx], v[:, idx]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=call.mask, enable_gqa=True)  # [G, H, QROWS, D]
        o = o.transpose(0, 1).reshape(H, G * QROWS, D)[:, : len(call.rows)] if call.gather is None else \
            o[:, :, 0].transpose(0, 1)
        if out is None and call.rows == list(range(T)):
            return o
        out = q.new_empty(H, T, D) if out is None else out
        out[:, call.rows] = o
    return out
