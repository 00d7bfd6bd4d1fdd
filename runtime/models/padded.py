"""A batch of sequences as one left-padded tensor on a dense K/V cache: one matmul per projection and one attention
call per layer for the whole batch.

For throughput where a row need not equal its 1-row step bitwise: writing a drafter's training data on a GPU, where
the serving forward's per-sequence segments would cost a launch per sequence per layer. Plain attention targets
(Llama, Qwen2, Qwen3) only; the hybrid family's linear-attention layers follow a tree and keep the serving forward.

Column j of row b holds the sequence's token j - pad[b] (pad[b] columns of padding first), so every sequence's next
token lands in the same column. A padding query attends to itself only (never to nothing: an all-masked softmax
would put NaN in its K/V, and 0 x NaN poisons the real rows that mask it out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dspark_grpc.runtime.models.rope import rope_cos_sin
from dspark_grpc.runtime.models.transformer import Transformer
from torch import Tensor


def supports(model: Transformer) -> bool:
    return not model.config.linear_layers


@dataclass
class PaddedCache:
    k: list[Tensor]  # per layer [B, num_kv_heads, S, head_dim]
    v: list[Tensor]
    valid: Tensor  # [B, S] bool: a real token's K/V
    length: int = 0  # columns written

    @classmethod
    def empty(cls, model: Transformer, batch: int, columns: int) -> PaddedCache:
        c = model.config
        shape = (batch, c.num_kv_heads, columns, c.head_dim)
        new = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_layers)]
        return cls(new, [torch.zeros_like(t) for t in new], torch.zeros(batch, columns, dtype=torch.bool,
                                                                         device=model.device))

    def select(self, rows: Tensor) -> PaddedCache:
        """The cache of these batch rows only (a batch that drops its finished sequences)."""
        return PaddedCache([k[rows] for k in self.k], [v[rows] for v in self.v], self.valid[rows], self.length)


@dataclass
class PaddedOutput:
    logits: Tensor  # [B, V] float32: the last column's
    captures: Tensor | None  # [B, T, m, H] outputs of the capture layers, every column


@torch.no_grad()
def padded_forward(model: Transformer, tokens: Tensor, positions: Tensor, valid: Tensor, cache: PaddedCache,
                   capture_layers: Sequence[int] = ()) -> PaddedOutput:
    """Run columns tokens [B, T] (positions [B, T]; valid [B, T] False for padding) on top of the cache's columns,
    write their K/V there, and return the last column's logits and the capture layers' outputs."""
    assert supports(model), "padded batches need a plain attention target"
    B, T = tokens.shape
    assert positions.shape == valid.shape == (B, T) and cache.valid.shape[0] == B, (tokens.shape, cache.valid.shape)
    start, end = cache.length, cache.length + T
    assert end <= cache.valid.shape[1], (end, cache.valid.shape)
    device = model.device
    cache.valid[:, start:end] = valid.to(device)
    keys = cache.valid[:, :end]
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    own = torch.eye(T, dtype=torch.bool, device=device)
    mask = torch.cat([keys[:, None, :start].expand(B, T, start), (keys[:, None, start:] & causal) | own], dim=2)
    x = model.tok_embeddings(tokens.to(device)).reshape(B * T, -1)
    cos, sin = rope_cos_sin(positions.reshape(-1).to(device), model.inv_freq, model.attention_scaling, x.dtype)
    captured: dict[int, Tensor] = {}
    for i, block in enumerate(model.layers):
        att = block.attention
        q, k, v, gate = att.project_qkv(block.attention_norm(x), cos, sin)  # rows b * T + t
        cache.k[i][:, :, start:end] = k.view(-1, B, T, k.shape[-1]).transpose(0, 1)
        cache.v[i][:, :, start:end] = v.view(-1, B, T, v.shape[-1]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.view(-1, B, T, q.shape[-1]).transpose(0, 1), cache.k[i][:, :, :end],
                                             cache.v[i][:, :, :end], attn_mask=mask[:, None], enable_gqa=True)
        x = block.mlp_half(x + att.output(out.transpose(0, 1).reshape(-1, B * T, out.shape[-1]), gate))
        if i in capture_layers:
            captured[i] = x
    cache.length = end
    last = x.view(B, T, -1)[:, -1]
    logits = model.lm_head(model.norm(last)).float()
    captures = (torch.stack([captured[i].view(B, T, -1) for i in capture_layers], dim=2) if capture_layers
                else None)
    return PaddedOutput(logits, captures)


def left_padded(prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """tokens, positions and valid [B, P] for prompts left-padded to the longest (padding: token 0, position 0)."""
    P = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), P, dtype=torch.long)
    valid = torch.zeros(len(prompts), P, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        valid[b, P - len(p):] = True
    positions = (valid.long().cumsum(dim=1) - 1).clamp(min=0)
    return tokens, positions, valid
