"""Gated DeltaNet linear attention (the `linear_attention` layers of Qwen3.5) over token trees.

Per sequence a layer carries a recurrent state [Hv, dk, dv] (float32) and a conv window (the last K-1 rows of the
pre-convolution q/k/v projection) instead of a K/V row per token. The new rows of a forward form a forest over
the committed state: row i continues from its parent row, or from the committed state when its parent is -1.
So every node of a verified tree gets exactly the state of its own root-to-node path (shared prefixes computed
once), and a chain (prefill, AR, a chain draft) is the case parent = i - 1. The per-row states and windows stay
pending in the cache (kv_cache.LinearState) until a commit picks the accepted path's last row.

The math is transformers' Qwen3_5GatedDeltaNet: causal depthwise conv + SiLU, l2-normed q/k (q scaled by
dk^-0.5), decay g = A * softplus(a + dt_bias) with A = -exp(A_log), beta = sigmoid(b), the delta rule
S = S * exp(g); S += k (beta (v - k S)); o = q S; then RMSNorm(o) * silu(z) per value head and out_proj.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import FusedProjection, Linear

if TYPE_CHECKING:
    from .transformer import Segment


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
    expected = torch.eye(T, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            expected[i] |= expected[p]
    if not torch.equal(expected, new_rows.cpu()) or (committed is not None and not bool(committed.all())):
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


def tree_levels(parents: Sequence[int]) -> list[int]:
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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
        from .transformer import RMSNorm  # one RMSNorm; transformer.py imports this module

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
        pieces, index, parent, depth, offset = [], [], [], [], 0
        for s, seg in enumerate(segments):
            n = seg.end - seg.begin
            parents = seg.parents if seg.parents is not None else chain_parents(n)
            assert len(parents) == n, (len(parents), n)
            pieces += [seg.kv.conv, qkv[seg.begin : seg.end]]
            index.append(window_index(parents, K) + offset)
            offset += K - 1 + n
            parent += [seg.begin + p if p >= 0 else T + s for p in parents]
            depth += tree_levels(parents)
        windows = torch.cat(pieces).index_select(0, torch.cat(index).view(-1).to(x.device)).view(T, K, self.conv_dim)
        mixed = F.silu((windows * self.conv.t()[None]).sum(dim=1))

        q, k, v = mixed.split([self.num_k_heads * self.k_dim] * 2 + [self.num_v_heads * self.v_dim], dim=-1)
        q = l2norm(q.reshape(T, self.num_k_heads, self.k_dim).float()) / self.k_dim**0.5
        k = l2norm(k.reshape(T, self.num_k_heads, self.k_dim).float())
        v = v.reshape(T, self.num_v_heads, self.v_dim).float()
        if self.num_v_heads != self.num_k_heads:
            q = q.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
            k = k.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)
        beta = b.sigmoid().float()
        decay = (self.A.float() * F.softplus(a.float() + self.dt_bias)).exp()

        # The delta rule, one tree level at a time over every segment's rows at that depth.
        states = x.new_empty((T + len(segments), self.num_v_heads, self.k_dim, self.v_dim), dtype=torch.float32)
        for s, seg in enumerate(segments):
            states[T + s] = seg.kv.state
        out = torch.empty_like(v)
        parent_t = torch.tensor(parent, device=x.device)
        levels: list[list[int]] = [[] for _ in range(max(depth) + 1)]
        for r, d in enumerate(depth):
            levels[d].append(r)
        for level in levels:
            rows = torch.tensor(level, device=x.device)
            S = states.index_select(0, parent_t.index_select(0, rows)) * decay.index_select(0, rows)[..., None, None]
            k_r = k.index_select(0, rows)
            kv_mem = torch.matmul(k_r.unsqueeze(-2), S).squeeze(-2)  # [n, Hv, dv]
            delta = (v.index_select(0, rows) - kv_mem) * beta.index_select(0, rows)[..., None]
            S = S + k_r[..., None] * delta[..., None, :]
            out.index_copy_(0, rows, torch.matmul(q.index_select(0, rows).unsqueeze(-2), S).squeeze(-2))
            states.index_copy_(0, rows, S)
        for seg in segments:
            seg.kv.set_pending(states[seg.begin : seg.end], windows[seg.begin : seg.end])

        o = self.norm(out.to(x.dtype)) * F.silu(z.reshape(T, self.num_v_heads, self.v_dim).float())
        return self.out(o.to(x.dtype).reshape(T, self.num_v_heads * self.v_dim))
