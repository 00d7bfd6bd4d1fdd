"""Gated DeltaNet linear attention (the `linear_attention` layers of Qwen3.5) over token trees.

Per sequence a layer carries a recurrent state [Hv, dk, dv] (float32) and a conv window (the last K-1 rows of the
pre-convolution q/k/v projection) instead of a K/V row per token. The new rows of a forward form a forest over
the committed state: row i continues from its parent row, or from the committed state when its parent is -1.
So every node of a verified tree gets exactly the state of its own root-to-node path (shared prefixes computed
once), and a chain (prefill, AR, a chain draft) is the case parent = i - 1. The rows stay pending in the cache
(PendingRows in kv_cache.LinearState) until a commit keeps the state after the accepted path's last row.

The math is transformers' Qwen3_5GatedDeltaNet: causal depthwise conv + SiLU, l2-normed q/k (q scaled by
dk^-0.5), decay g = A * softplus(a + dt_bias) with A = -exp(A_log), beta = sigmoid(b), the delta rule
S = S * exp(g); S += k (beta (v - k S)); o = q S; then RMSNorm(o) * silu(z) per value head and out_proj.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.linear import FusedProjection, Linear
from dspark_grpc.runtime.models.norm import RMSNorm
from dspark_grpc.runtime.models.tree import ancestor_mask, tree_depths
from torch import nn

if TYPE_CHECKING:
    from dspark_grpc.runtime.models.transformer import Segment


CHUNKED_MIN_ROWS = 64  # a prompt chunk this long (plus TAIL) runs the chunked form of the delta rule
TAIL = 8  # a chunked chain's last rows run one at a time, their states kept (a commit's and the snapshots')


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def parents_from_mask(new_rows: torch.Tensor, committed: torch.Tensor | None = None) -> list[int]:
    """The parent of each new row from an attention mask: new_rows [T, T] must be an ancestor mask (each row sees
    itself and exactly its parent's rows), committed [T, S] (optional) all True. A recurrent layer cannot skip
    rows, so other masks are refused."""
    T = new_rows.shape[0]
    assert new_rows.shape == (T, T), new_rows.shape
    idx = torch.arange(T)
    earlier = new_rows.cpu() & (idx[None, :] < idx[:, None])
    parents = ((earlier * (idx + 1)[None, :]).amax(dim=1) - 1).tolist() if T > 1 else [-1]
    if not torch.equal(ancestor_mask(parents), new_rows.cpu()) or (committed is not None and not bool(committed.all())):
        raise ValueError("models with linear-attention layers need a tree mask: every committed row visible and "
                         "each new row attending to itself and its ancestors (a root-to-node path)")
    return parents


def window_index(parents: Sequence[int], kernel: int) -> torch.Tensor:
    """[T, K] indices into [committed window (K-1 rows); new rows (T)]: row i's conv input along its path, oldest
    first (its K-1 ancestors, reaching into the committed window, then itself)."""
    T = len(parents)
    if list(parents) == chain_parents(T):
        return torch.arange(kernel)[None, :] + torch.arange(T)[:, None]
    root = list(range(-1, kernel - 1))  # the committed window, as if it ended at row K-2
    rows: list[list[int]] = []
    for i, p in enumerate(parents):
        rows.append((rows[p] if p >= 0 else root)[1:] + [kernel - 1 + i])
    return torch.tensor(rows, dtype=torch.long)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor,
               q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One gated delta-rule step for n rows from their parents' states S [n, Hv, dk, dv] (float32): k/q [n, Hv, dk]
    (l2-normed, q scaled), v [n, Hv, dv], beta/decay [n, Hv]. Returns the new states and, given q, the outputs
    [n, Hv, dv]."""
    assert S.shape[:2] == k.shape[:2] == v.shape[:2] == beta.shape == decay.shape, (S.shape, k.shape, beta.shape)
    S = S * decay[..., None, None]
    kv_mem = torch.matmul(k.unsqueeze(-2), S).squeeze(-2)
    delta = (v - kv_mem) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return S, None if q is None else torch.matmul(q.unsqueeze(-2), S).squeeze(-2)


def chunk_delta_rule(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     g: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over a chain of T rows from state S [Hv, dk, dv] in chunks of `chunk` rows (transformers'
    torch_chunk_gated_delta_rule, the WY/UT form): q/k [T, Hv, dk] (normed, q scaled), v [T, Hv, dv], beta and
    g = log decay [T, Hv]. Returns the outputs [T, Hv, dv] and the state after the last row."""
    T = q.shape[0]
    assert k.shape == q.shape and v.shape[:2] == beta.shape == g.shape == q.shape[:2] and T > 0, (q.shape, g.shape)
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [Hv, T + pad, d]
    beta, g = (F.pad(t.transpose(0, 1), (0, pad)) for t in (beta, g))
    H, n = q.shape[0], (T + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(H, n, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    cum = g.reshape(H, n, chunk).cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_v)
    for i in range(n):
        v_i = new_v[:, i] - k_cum[:, i] @ S
        out[:, i] = q[:, i] @ S + intra[:, i] @ v_i
        S = S * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    return out.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1), S


@dataclass
class PendingRows:
    """A forward's new rows in one linear-attention layer of one sequence, until a commit keeps a path of them."""

    inputs: torch.Tensor  # [K-1 + T, C]: the committed conv window, then the rows' pre-conv q/k/v projection
    windows: torch.Tensor  # [T, K]: row r's conv window as indices into `inputs`
    parents: list[int]
    states: torch.Tensor | None  # [T - first_state, Hv, dk, dv] the states of rows first_state.., or None
    rule: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # the rows' k, v, beta, decay
    first_state: int = 0  # rows before it have no state kept: a path's states are recomputed from `rule`


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.k_dim, self.v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.kernel = c.linear_conv_kernel
        key_dim, value_dim = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_qkv = Linear(c.hidden_size, self.conv_dim, bias=False)
        self.in_z = Linear(c.hidden_size, value_dim, bias=False)
        self.in_b = Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.in_a = Linear(c.hidden_size, self.num_v_heads, bias=False)
        self.conv = nn.Parameter(torch.empty(self.conv_dim, self.kernel))  # HF conv1d.weight[:, 0, :]
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A = nn.Parameter(torch.empty(self.num_v_heads))  # -exp(A_log), as GGUF stores it
        self.norm = RMSNorm(self.v_dim, c.rms_norm_eps)
        self.out = Linear(value_dim, c.hidden_size, bias=False)
        self.proj: FusedProjection | None = None

    def pack_fused(self) -> None:
        self.proj = FusedProjection.of([self.in_qkv, self.in_z, self.in_b, self.in_a])

    def forward_segments(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """x [T, hidden] = the segments' rows; each segment's `kv` is its sequence's LinearState for this layer and
        `parents` its rows' tree (None: a chain). The per-row states become the states' pending rows."""
        T, K = x.shape[0], self.kernel
        assert segments[0].begin == 0 and segments[-1].end == T, (segments[0].begin, segments[-1].end, T)
        qkv, z, b, a = self.proj(x) if self.proj is not None else (self.in_qkv(x), self.in_z(x), self.in_b(x),
                                                                   self.in_a(x))
        # Causal conv along each row's path: gather its K inputs from [committed window; new rows] per segment.
        pieces, index, parent, depth, seg_of, offset = [], [], [], [], [], 0
        trees = []
        for s, seg in enumerate(segments):
            n = seg.end - seg.begin
            parents = seg.parents if seg.parents is not None else chain_parents(n)
            assert len(parents) == n, (len(parents), n)
            trees.append((offset, window_index(parents, K), parents))
            pieces += [seg.kv.conv, qkv[seg.begin : seg.end]]
            index.append(trees[-1][1] + offset)
            offset += K - 1 + n
            parent += [seg.begin + p if p >= 0 else -1 for p in parents]
            depth += tree_depths(parents)
            seg_of += [s] * n
        inputs = torch.cat(pieces)
        windows = inputs.index_select(0, torch.cat(index).view(-1).to(x.device)).view(T, K, self.conv_dim)
        mixed = F.silu((windows * self.conv.t()[None]).sum(dim=1))

        q, k, v = mixed.split([self.num_k_heads * self.k_dim] * 2 + [self.num_v_heads * self.v_dim], dim=-1)
        q = l2norm(q.reshape(T, self.num_k_heads, self.k_dim).float()) / self.k_dim**0.5
        k = l2norm(k.reshape(T, self.num_k_heads, self.k_dim).float())
        v = v.reshape(T, self.num_v_heads, self.v_dim).float()
        if self.num_v_heads != self.num_k_heads:
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
        beta = b.sigmoid().float()
        g = self.A.float() * F.softplus(a.float() + self.dt_bias)  # log of the decay

        out = recur_segments(segments, trees, inputs, parent, depth, seg_of, q, k, v, beta, g)
        o = self.norm(out.to(x.dtype)) * F.silu(z.reshape(T, self.num_v_heads, self.v_dim).float())
        return self.out(o.to(x.dtype).reshape(T, self.num_v_heads * self.v_dim))


def recur_segments(segments: Sequence[Segment], trees: list[tuple[int, torch.Tensor, list[int]]], inputs: torch.Tensor,
                   parent: list[int], depth: list[int], seg_of: list[int], q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The delta rule over every segment's rows (q/k [T, Hv, dk], v [T, Hv, dv], beta and log decay g [T, Hv]),
    each row from its parent's state (`parent`: global row, -1 = its segment's committed state; `depth` in its tree;
    `seg_of`: its segment); sets each segment's pending rows (`trees`: (offset of its conv inputs in `inputs`, its
    [n, K] conv windows, its parents)). Returns the outputs [T, Hv, dv]."""
    T, K = q.shape[0], trees[0][1].shape[1]
    decay = g.exp()
    # A long prompt chunk runs the chunked form over all but its last TAIL rows (a verified chain does not: its
    # rows compute what AR steps compute, row by row). Those and every other row go one tree level at a time,
    # over every segment's rows at that depth: a level starts from the level above (or, at depth 0, its
    # segment's state), so only two levels' states are live, plus the rows' states that the cache keeps pending
    # (LinearState.keeps_states; a chunked chain's last TAIL rows).
    out = torch.empty_like(v)
    init = [seg.kv.state for seg in segments]
    first = [0] * len(segments)  # a segment's first row for the level loop, and its first row with a state
    for s, seg in enumerate(segments):
        lo, n = seg.begin, seg.end - seg.begin
        if n >= CHUNKED_MIN_ROWS + TAIL and seg.parents is None:
            m = first[s] = n - TAIL
            out[lo : lo + m], init[s] = chunk_delta_rule(init[s], q[lo : lo + m], k[lo : lo + m],
                                                         v[lo : lo + m], beta[lo : lo + m], g[lo : lo + m])
            for r in range(lo, lo + m):
                depth[r] = -1
            for r in range(lo + m, lo + n):
                depth[r] -= m
            parent[lo + m] = -1
    keep = [first[s] > 0 or seg.kv.keeps_states(seg.end - seg.begin) for s, seg in enumerate(segments)]
    levels: list[list[int]] = [[] for _ in range(max(depth) + 1)]
    pos = [0] * T
    for r, d in enumerate(depth):
        if d >= 0:
            pos[r] = len(levels[d])
            levels[d].append(r)
    src = [seg_of[r] if parent[r] < 0 else pos[parent[r]] for r in range(T)]
    slot, n_kept = [-1] * T, 0
    for s, seg in enumerate(segments):
        if keep[s]:
            rows = range(seg.begin + first[s], seg.end)
            slot[rows.start : rows.stop] = range(n_kept, n_kept + len(rows))
            n_kept += len(rows)
    kept = q.new_empty((n_kept, *segments[0].kv.state.shape), dtype=torch.float32)
    prev = torch.stack(init)
    for level in levels:
        if T == len(segments):  # one row per segment (AR steps): every row, in order, from its segment's state
            S, o = delta_rule(prev, k, v, beta, decay, q)
            out = o
        else:
            rows = torch.tensor(level, device=q.device)
            S, o = delta_rule(prev.index_select(0, torch.tensor([src[r] for r in level], device=q.device)),
                              k.index_select(0, rows), v.index_select(0, rows), beta.index_select(0, rows),
                              decay.index_select(0, rows), q.index_select(0, rows))
            out.index_copy_(0, rows, o)
        sel = [i for i, r in enumerate(level) if slot[r] >= 0]
        if sel:
            kept_rows = S if len(sel) == len(level) else S.index_select(0, torch.tensor(sel, device=q.device))
            kept.index_copy_(0, torch.tensor([slot[level[i]] for i in sel], device=q.device), kept_rows)
        prev = S
    for s, (seg, (off, win, parents)) in enumerate(zip(segments, trees, strict=True)):
        lo, hi = seg.begin, seg.end
        states = kept[slot[lo + first[s]] : slot[lo + first[s]] + hi - lo - first[s]] if keep[s] else None
        rule = None if keep[s] and not first[s] else (k[lo:hi], v[lo:hi], beta[lo:hi], decay[lo:hi])
        seg.kv.set_pending(PendingRows(inputs[off : off + K - 1 + hi - lo], win, parents, states, rule, first[s]))
    return out
