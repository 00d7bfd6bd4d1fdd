"""The DFlash/DSpark drafter backbone: target features injected as context K/V, one block forward per proposal
(several sessions' blocks may share one pass: `forward_blocks`).

Context rows (committed positions 0..n-1) have no queries: their target features go through `fc` + `hidden_norm`
and then each layer's k/v projections (k_norm, RoPE at the absolute position). A block [anchor, MASK x (B-1)] at
positions n..n+B-1 attends to those rows and to itself (bidirectionally in full-attention layers; sliding layers
see a window of context and are causal inside the block unless the checkpoint says otherwise).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from dspark_grpc.runtime.drafting.markov import ConfidenceHead, MarkovHead
from dspark_grpc.runtime.formats.drafter_config import DrafterConfig
from dspark_grpc.runtime.models.kv_cache import CacheFullError, KVCache
from dspark_grpc.runtime.models.linear import Linear, pack_linears, quantize_linears
from dspark_grpc.runtime.models.norm import RMSNorm
from dspark_grpc.runtime.models.rope import rope_cos_sin, rope_inv_freq
from dspark_grpc.runtime.models.transformer import Block, Embedding, Segment
from torch import Tensor, nn

MARKOV_BIAS_CACHE = 1024  # previous tokens whose Markov bias a packed drafter keeps (32 MB at 8192 draft tokens)


@dataclass
class BlockOutput:
    hidden_pre_norm: Tensor  # [n_drafts, H] before the final norm
    hidden_post_norm: Tensor  # [n_drafts, H]
    base_logits: Tensor  # [n_drafts, draft_vocab] float32, without the Markov bias


class BlockKV:
    """KVSource for a block: attends to [context K/V ; block K/V] and stores nothing."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)


def sliding_mask(query_pos: Tensor, key_pos: Tensor, window: int, causal: bool) -> Tensor:
    """[T, S] bool: keys within `window` positions of each query (only earlier ones when causal)."""
    delta = query_pos[:, None] - key_pos[None, :]
    mask = delta < window
    return mask & (delta >= 0) if causal else mask & (-delta < window)


def confidence_head(config: DrafterConfig) -> ConfidenceHead:
    temps = None if config.confidence_temperatures is None else list(config.confidence_temperatures)
    # Small, and its temperature buffer must hold real values even when the drafter is built on "meta".
    device = "cpu" if torch.get_default_device().type == "meta" else None
    with torch.device(device) if device else contextlib.nullcontext():
        return ConfidenceHead(config.hidden_size, config.markov_rank, config.confidence_with_markov,
                              config.confidence_pre_norm, temps)


class Drafter(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        layer_config = c.layer_model_config()
        self.fc = Linear(c.fc_in_features, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(Block(layer_config) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.embed = Embedding(c.vocab_size, c.hidden_size)  # a frozen copy of the target's
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        d2t = torch.zeros(c.draft_vocab_size, dtype=torch.long) if c.draft_vocab_size < c.vocab_size else None
        self.register_buffer("d2t", d2t)  # target id = draft id + d2t[draft id]
        self.markov = (
            MarkovHead(c.markov_head_type, c.vocab_size, c.draft_vocab_size, c.markov_rank, c.hidden_size)
            if c.markov_rank
            else None
        )
        self.confidence = confidence_head(c) if c.confidence_enabled else None
        # float32 and outside the state: `.to(bfloat16)` must not round the frequencies.
        with torch.device("cpu"):
            self.inv_freq, self.attention_scaling = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def pack(self, quantize: bool = False) -> Drafter:
        """Pre-pack the projections for CPU inference (runtime/models/linear.py; `quantize`: as Q8_0 blocks on our CPU
        kernels, where they build) and cache a vanilla Markov head's biases (MarkovHead.cache_biases); frozen
        drafters only."""
        if quantize:
            quantize_linears(self)
        pack_linears(self)
        if self.markov is not None and self.markov.kind == "vanilla" and not self.markov.w2.weight.requires_grad:
            self.markov.cache_biases(MARKOV_BIAS_CACHE)
        return self

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def new_context(self, max_length: int | None = None, initial_capacity: int = 256) -> DraftContext:
        return DraftContext(self, max_length, initial_capacity)

    def rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions.to(self.device), self.inv_freq.to(self.device), self.attention_scaling, dtype)

    def context_rows(self, features: Tensor) -> Tensor:
        """The target's features [n, m, target_hidden] or [n, m * target_hidden] at target_layer_ids, as the
        [n, m * target_hidden] rows `context_kv` takes (in the drafter's dtype, on its device)."""
        n, m, width = features.shape[0], len(self.config.target_layer_ids), self.config.target_hidden_size
        assert features.shape[1:] in ((m, width), (m * width,)), (features.shape, m, width)
        return features.reshape(n, -1).to(device=self.device, dtype=self.dtype)

    def context_kv(self, rows: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per layer (K, V) [num_kv_heads, n, head_dim] of context rows [n, m * target_hidden] (`context_rows`) at
        `positions` [n]. Every step is per row, so rows of several sessions project in one call."""
        assert rows.dim() == 2 and positions.shape == (rows.shape[0],), (rows.shape, positions.shape)
        x = self.hidden_norm(self.fc(rows))
        cos, sin = self.rope(positions, x.dtype)
        return [layer.attention.project_kv(x, cos, sin) for layer in self.layers]

    @torch.no_grad()
    def forward_block(self, ctx: DraftContext, anchor_token: int) -> BlockOutput:
        """The block [anchor, MASK x (B-1)] at positions ctx.length .. ctx.length + B - 1; rows = the draft slots."""
        return self.forward_blocks([(ctx, anchor_token)])[0]

    @torch.no_grad()
    def forward_blocks(self, items: Sequence[tuple[DraftContext, int]]) -> list[BlockOutput]:
        """`forward_block` for several sessions in one pass over the draft layers: their blocks' rows are
        concatenated (projections, MLPs and lm_head run once), attention runs per block against its own context.
        The anchors are validated by the caller (DraftEngine.propose)."""
        c = self.config
        if not items:
            raise ValueError("forward_blocks needs at least one (context, anchor) item")
        assert all(0 <= a < c.vocab_size for _, a in items), [a for _, a in items]
        B, S = c.block_size, len(items)
        project_waiting([ctx for ctx, _ in items])
        tokens = torch.full((S, B), c.mask_token_id, dtype=torch.long, device=self.device)
        tokens[:, 0] = torch.tensor([a for _, a in items], device=self.device)
        starts = [ctx.length for ctx, _ in items]
        positions = [torch.arange(n, n + B, device=self.device) for n in starts]
        rows, post, logits = self.draft_rows(tokens, torch.cat(positions), lambda i: [
            Segment(j * B, (j + 1) * B, *self._block_kv(ctx, i, pos))
            for j, ((ctx, _), pos) in enumerate(zip(items, positions, strict=True))])
        return [BlockOutput(rows[j], post[j], logits[j]) for j in range(S)]

    def draft_rows(self, tokens: Tensor, positions: Tensor, segments: Callable[[int], Sequence[Segment]]
                   ) -> tuple[Tensor, Tensor, Tensor]:
        """The draft layers over S blocks: tokens [S, B] at positions [S * B], each layer's K/V sources
        `segments(layer)` -> the draft slots' hidden states before and after the final norm [S, K, H] and their
        base logits [S, K, V_d] fp32."""
        c = self.config
        S, B = tokens.shape
        x = self.embed(tokens.reshape(S * B))
        cos, sin = self.rope(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer.forward_segments(x, cos, sin, segments(i))
        x = x.view(S, B, c.hidden_size)
        rows = x if c.slot_convention == "dspark" else x[:, 1:]
        assert rows.shape == (S, c.num_drafts, c.hidden_size), rows.shape
        post = self.norm(rows)
        return rows, post, self.lm_head(post).float()

    def _block_kv(self, ctx: DraftContext, layer: int, positions: Tensor) -> tuple[Tensor | None, BlockKV]:
        """Layer `layer`'s mask (None: every row) and K/V source for a block at `positions` over `ctx`."""
        c, n = self.config, ctx.length
        k, v = ctx.layer_kv(layer)
        if c.layer_types[layer] != "sliding_attention":
            return None, BlockKV(k, v)
        assert c.sliding_window is not None
        first = max(0, n - c.sliding_window + 1)  # the earliest row any block query can see
        key_pos = torch.cat([torch.arange(first, n, device=self.device), positions])
        mask = sliding_mask(positions, key_pos, c.sliding_window, c.causal_sliding)
        return mask, BlockKV(k[:, first:], v[:, first:])


class DraftContext:
    """One session's context K/V for every draft layer: rows 0..length-1, RoPE at their absolute positions.

    Appended rows wait, unprojected, until the next drafter pass (or `layer_kv`) projects them: a pass projects the
    waiting rows of all its sessions at once, however many appends brought them. Positions, lengths and feature
    shapes are validated by the caller (DraftEngine.append/truncate); only the cache's bound is an error here."""

    def __init__(self, drafter: Drafter, max_length: int | None = None, initial_capacity: int = 256) -> None:
        c = drafter.config
        self.drafter = drafter
        max_length = c.max_position_embeddings if max_length is None else max_length
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_length, drafter.dtype, drafter.device,
                             initial_capacity)
        self.waiting: list[Tensor] = []  # appended rows not projected yet ([n, m * target_hidden] each)

    @property
    def length(self) -> int:
        return self.cache.length + sum(rows.shape[0] for rows in self.waiting)

    def append(self, features: Tensor, start: int) -> None:
        """Context rows start..start+n-1 from the target's features [n, m, target_hidden] (or [n, m*target_hidden])."""
        assert start == self.length, (start, self.length)
        rows = self.drafter.context_rows(features)
        if rows.shape[0] == 0:
            return
        if self.length + rows.shape[0] > self.cache.max_length:
            raise CacheFullError(f"the context would reach {self.length + rows.shape[0]} rows, over its max_length "
                                 f"{self.cache.max_length}")
        self.waiting.append(rows)

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length, (length, self.length)
        if length <= self.cache.length:
            self.cache.rollback(length)
            self.waiting = []
            return
        keep, kept = length - self.cache.length, []
        for rows in self.waiting:
            if keep > 0:
                kept.append(rows[:keep])
            keep -= rows.shape[0]
        self.waiting = kept

    def waiting_rows(self) -> Tensor:
        """The rows appended since the last projection, as one [n, m * target_hidden] tensor."""
        return torch.cat(self.waiting) if len(self.waiting) > 1 else self.waiting[0]

    def store(self, kv: Sequence[tuple[Tensor, Tensor]]) -> None:
        """The waiting rows' K/V, per layer [num_kv_heads, n, head_dim] (`Drafter.context_kv` of `waiting_rows`),
        into the cache: they are projected."""
        n = kv[0][0].shape[1]
        assert n == self.length - self.cache.length, (n, self.length, self.cache.length)
        self.cache.begin(n)
        for i, (k, v) in enumerate(kv):
            self.cache.layer(i).update(k.to(self.cache.dtype), v.to(self.cache.dtype))
        self.cache.commit(range(n))
        self.waiting = []

    def layer_kv(self, index: int) -> tuple[Tensor, Tensor]:
        """Layer `index`'s context K, V [num_kv_heads, length, head_dim] (views)."""
        project_waiting([self])
        n = self.length
        return self.cache.k[index][:, :n], self.cache.v[index][:, :n]


@torch.no_grad()
def project_waiting(contexts: Sequence[DraftContext]) -> None:
    """The waiting rows of `contexts` (of one drafter) into their K/V caches, in one `context_kv` call."""
    todo = list({id(ctx): ctx for ctx in contexts if ctx.waiting}.values())  # (a context may come twice)
    if not todo:
        return
    drafter = todo[0].drafter
    assert all(ctx.drafter is drafter for ctx in todo)
    rows = [ctx.waiting_rows() for ctx in todo]
    positions = torch.cat([torch.arange(ctx.cache.length, ctx.cache.length + r.shape[0])
                           for ctx, r in zip(todo, rows, strict=True)])
    kv = drafter.context_kv(torch.cat(rows) if len(rows) > 1 else rows[0], positions)
    offset = 0
    for ctx, r in zip(todo, rows, strict=True):
        n = r.shape[0]
        ctx.store([(k[:, offset: offset + n], v[:, offset: offset + n]) for k, v in kv])
        offset += n
