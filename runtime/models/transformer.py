"""Decoder-only transformer for llama / qwen2 / qwen3 checkpoints, the qwen35 hybrid (Qwen3.5: Gated DeltaNet
linear-attention layers between gated full-attention layers; runtime/models/linear_attention.py), and gemma3 (Gemma 3:
sliding-window layers between global ones, each with its own RoPE base; norms after attention and after the MLP too).

One forward runs one sequence's new rows, or several sequences' rows concatenated (a ragged batch): the
projections, MLPs and lm_head run once over all rows (one read of the weights), attention runs per sequence
against that sequence's own K/V, and a linear-attention layer runs its recurrence for all sequences at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import GROUP, BlockWeight, QuantBlocks, bf16_blocks, dequantize_rows
from dspark_grpc.runtime.models.batch_invariant import RowPlan, attention_by_row, plan_rows, row_keys
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.kv_cache import CacheFullError, HybridCache, KVCache
from dspark_grpc.runtime.models.linear import (
    FusedProjection,
    Linear,
    bf16_linears,
    linear,
    pack_linears,
    pack_weight,
    rows_one_by_one,
)
from dspark_grpc.runtime.models.linear_attention import GatedDeltaNet, parents_from_mask
from dspark_grpc.runtime.models.norm import RMSNorm
from dspark_grpc.runtime.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from torch import nn

if TYPE_CHECKING:
    from dspark_grpc.runtime.formats.checkpoint import Checkpoint
    from dspark_grpc.runtime.kernels.compiled_step import CompiledStep


class KVSource(Protocol):
    """Where an attention layer's keys and values come from and go to.

    `update` receives the new rows' K/V [num_kv_heads, T, head_dim] (RoPE applied) and returns every row the
    queries may attend to, [num_kv_heads, S, head_dim], in the column order of the attention mask.
    """

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Segment:
    """Rows [begin, end) of a ragged batch: one sequence's new rows, its mask [end - begin, S] (None: attend
    to all S rows) and where its K/V rows come from."""

    begin: int
    end: int
    mask: torch.Tensor | None
    kv: KVSource
    parents: list[int] | None = None  # the rows' tree, for linear-attention layers (None: a prompt chunk's chain)
    keys: RowPlan | None = None  # attend row by row to these key rows (Transformer.batch_invariant)


@dataclass
class SequenceInput:
    """One sequence's part of a (batched) forward; see Transformer.forward."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    cache: KVCache
    mask: torch.Tensor | None = None  # [T, cache.length + T] bool; None: committed rows + causal
    logits_rows: torch.Tensor | None = None  # which rows get logits; None: all
    capture_layers: tuple[int, ...] = ()
    # [T, T] bool instead of `mask`: the new rows among themselves, every committed row visible (built in the
    # forward, on the batcher's worker: a large mask built on a request thread costs it an OpenMP team)
    new_rows_mask: torch.Tensor | None = None


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [len(logits_rows), vocab] float32
    captures: torch.Tensor | None  # [T, len(capture_layers), hidden] in the model dtype


class Embedding(nn.Embedding):
    """nn.Embedding; given a GGUF's `blocks` (the fast precision; its weight is then a meta tensor in the model dtype)
    it dequantizes only the rows it looks up, as the whole matrix would have been (runtime/kernels/quant.py): from the
    file's blocks, or once packed from the tied head's `table` (the same bits, the blocks then let go)."""

    blocks: QuantBlocks | None = None
    table: BlockWeight | None = None

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # on meta, normal_ would load torch's Python reference ops: seconds at start-up
            super().reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.table is not None:
            return self.table.rows(tokens).to(self.weight.dtype)
        if self.blocks is None:
            return super().forward(tokens)
        return dequantize_rows(self.blocks, tokens).to(self.weight.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.output_gate = c.attention_output_gate  # wq gives [q, gate] per head; out = attn * sigmoid(gate)
        self.rotary_dim = c.rotary_dim or c.head_dim
        # SDPA scales scores by 1/sqrt(head_dim): a query_pre_attn_scalar is folded into q
        self.q_scale = (c.head_dim / c.query_pre_attn_scalar) ** 0.5 if c.query_pre_attn_scalar else 1.0
        self.wq = Linear(c.hidden_size, 2 * q_dim if self.output_gate else q_dim, bias=c.attention_bias)
        self.wk = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.wv = Linear(c.hidden_size, kv_dim, bias=c.attention_bias)
        self.wo = Linear(q_dim, c.hidden_size, bias=c.attention_out_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.qkv: FusedProjection | None = None

    def pack_fused(self) -> None:
        self.qkv = FusedProjection.of([self.wq, self.wk, self.wv])

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (normed, rotated) and V [num_kv_heads, T, head_dim] for rows x [T, hidden]."""
        return self._rotate_kv(self.wk(x), self.wv(x), cos, sin)

    def _rotate_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[0]
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self._rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rope(x, cos, sin)
        r = self.rotary_dim
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, kv: KVSource
    ) -> torch.Tensor:
        """x [T, hidden]; mask [T, S] bool (True = may attend) or None (attend to all S rows)."""
        return self.forward_segments(x, cos, sin, [Segment(0, x.shape[0], mask, kv)])

    def forward_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: Sequence[Segment]) -> torch.Tensor:
        """x [T, hidden] = the segments' rows, in order and covering [0, T); each attends only to its own K/V."""
        T = x.shape[0]
        assert segments[0].begin == 0 and segments[-1].end == T, (segments[0].begin, segments[-1].end, T)
        q, k_new, v_new, gate = self.project_qkv(x, cos, sin)
        outs = []
        for seg in segments:
            k, v = seg.kv.update(k_new[:, seg.begin : seg.end], v_new[:, seg.begin : seg.end])
            assert seg.mask is None or seg.mask.shape == (seg.end - seg.begin, k.shape[1]), (seg.mask.shape, k.shape)
            if seg.keys is not None:
                outs.append(attention_by_row(q[:, seg.begin : seg.end], k, v, seg.keys))
                continue
            out = F.scaled_dot_product_attention(q[None, :, seg.begin : seg.end], k[None], v[None],
                                                 attn_mask=seg.mask, enable_gqa=True)
            outs.append(out[0])
        return self.output(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1), gate)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rows x [T, hidden] -> q [num_heads, T, head_dim] and K, V [num_kv_heads, T, head_dim] (normed, rotated),
        and the output gate [T, num_heads * head_dim] (None without one)."""
        T = x.shape[0]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        gate = None
        if self.output_gate:
            q, gate = q.reshape(T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(T, self.num_heads * self.head_dim)
        q = q.reshape(T, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        k, v = self._rotate_kv(k, v, cos, sin)
        q = self._rope(q.transpose(0, 1), cos, sin)
        return (q * self.q_scale if self.q_scale != 1.0 else q), k, v, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention's result [num_heads, T, head_dim] -> [T, hidden] through the gate and wo."""
        out = out.transpose(0, 1).reshape(out.shape[1], self.num_heads * self.head_dim)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.wo(out)


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = Linear(config.hidden_size, config.intermediate_size, bias=False)  # gate
        self.w3 = Linear(config.hidden_size, config.intermediate_size, bias=False)  # up
        self.w2 = Linear(config.intermediate_size, config.hidden_size, bias=False)  # down
        self.gelu = config.architecture == "gemma3"  # GELU (tanh approximation) instead of SiLU
        self.gate_up: FusedProjection | None = None

    def pack_fused(self) -> None:
        self.gate_up = FusedProjection.of([self.w1, self.w3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.w1(x), self.w3(x))
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.w2(act * up)


class Block(nn.Module):
    """Pre-norm residual block; its token mixer is attention, or linear attention (layer_types of a hybrid). Gemma 3
    also norms the mixer's and the MLP's outputs before their residual adds."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.attention_norm = RMSNorm(d, eps)
        linear = config.is_linear(layer)
        self.attention = None if linear else Attention(config)
        self.linear_attention = GatedDeltaNet(config) if linear else None
        self.ffn_norm = RMSNorm(d, eps)
        self.feed_forward = FeedForward(config)
        post = config.architecture == "gemma3"
        self.post_attention_norm = RMSNorm(d, eps) if post else None
        self.post_ffn_norm = RMSNorm(d, eps) if post else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None, kv: KVSource
    ) -> torch.Tensor:
        return self.forward_segments(x, cos, sin, [Segment(0, x.shape[0], mask, kv)])

    def forward_segments(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         segments: Sequence[Segment]) -> torch.Tensor:
        return self.mlp_half(self.mixer_half(x, cos, sin, segments))

    def mixer_half(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   segments: Sequence[Segment]) -> torch.Tensor:
        if self.linear_attention is not None:
            return x + self.linear_attention.forward_segments(self.attention_norm(x), segments)
        out = self.attention.forward_segments(self.attention_norm(x), cos, sin, segments)
        return x + (self.post_attention_norm(out) if self.post_attention_norm is not None else out)

    def mlp_half(self, h: torch.Tensor) -> torch.Tensor:
        out = self.feed_forward(self.ffn_norm(h))
        return h + (self.post_ffn_norm(out) if self.post_ffn_norm is not None else out)


def causal_mask(num_committed: int, num_new: int, device: torch.device | None = None) -> torch.Tensor:
    """[num_new, num_committed + num_new]: every committed row, and the new rows causally."""
    mask = torch.ones(num_new, num_committed + num_new, dtype=torch.bool, device=device)
    mask[:, num_committed:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril()
    return mask


def window_mask(mask: torch.Tensor | None, start: int, positions: torch.Tensor, window: int) -> torch.Tensor | None:
    """A sliding-window layer's mask (on the CPU): `mask` [T, start + T] (None: every committed row and the new rows
    causally) less the keys `window` or more positions behind the query. Committed row j is at position j (prefill
    and commits keep them so), the T new rows at `positions`. `mask` itself when no query reaches that far."""
    T = positions.shape[0]
    if int(positions.max()) < window:
        return mask
    keys = torch.cat([torch.arange(start), positions])
    near = positions[:, None] - keys[None, :] < window
    return near & (mask if mask is not None else causal_mask(start, T))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.packed_lm_head: torch.Tensor | None = None
        self.head_blocks: QuantBlocks | None = None  # a tied embedding as the file stores it (fast precision)
        self.quantized_lm_head: BlockWeight | None = None
        # Verify rows and AR steps attend row by row, so that a verify row equals its 1-row step bitwise
        # (runtime/models/batch_invariant.py); prompt chunks (no mask given) run whole. Set for the fast precision.
        self.batch_invariant = False
        self.compiled: CompiledStep | None = None  # the fast precision's compiled steps
        # (runtime/kernels/compiled_step.py)
        self.init_rope()

    def init_rope(self) -> None:
        c = self.config
        device = self.device
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(
                c.rotary_dim or c.head_dim, c.rope_theta, c.rope_scaling, c.rope_freq_factors
            )
            local = rope_inv_freq(c.head_dim, c.rope_local_theta, None)[0] if c.sliding_window else inv_freq
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.register_buffer("local_inv_freq", local.to(device), persistent=False)  # sliding-window layers'

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> Transformer:
        """Build the model around the checkpoint's tensors (shared, not copied, when dtype is float32)."""
        with torch.device("meta"):
            model = cls(ckpt.config)
        weights = {k: v.to(dtype) for k, v in ckpt.weights.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        for name, blocks in ckpt.blocks.items():  # quantized matmuls once packed (runtime/models/linear.py)
            model.get_submodule(name.removesuffix(".weight")).blocks = blocks
        model.head_blocks = ckpt.head_blocks
        model.init_rope()
        return model.eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.config.architecture == "gemma3":  # sqrt(hidden) rounded to the model dtype first, as Gemma does
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed rows h [T, hidden] -> float32 logits [T, vocab] (soft-capped where the config says)."""
        z = self.lm_head(h).float()
        cap = self.config.final_logit_softcapping
        return torch.tanh(z / cap) * cap if cap else z

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device  # (an embedding kept as blocks has a meta weight)

    def new_cache(self, max_length: int | None = None, initial_capacity: int = 256) -> KVCache:
        if self.compiled is not None:
            return self.compiled.new_cache(self.config.max_position_embeddings if max_length is None else max_length)
        if self.config.linear_layers:
            max_length = self.config.max_position_embeddings if max_length is None else max_length
            return HybridCache(self.config, max_length, self.dtype, self.device, initial_capacity)
        return KVCache.for_config(self.config, max_length, self.dtype, self.device, initial_capacity)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.output is not None:
            return self.output(x)
        if self.quantized_lm_head is not None:
            return self.quantized_lm_head(x, out_dtype=torch.float32)
        if self.batch_invariant and x.device.type == "cpu":
            return rows_one_by_one(lambda row: F.linear(row, self.tok_embeddings.weight), x)
        return linear(x, self.tok_embeddings.weight, packed=self.packed_lm_head)

    def pack(self) -> Transformer:
        """Pre-pack the projections and the (tied) lm_head for CPU inference (runtime/models/linear.py); frozen models
        only. A batch-invariant model's float matrices first go to our bf16 kernel (`bf16_linears`), a tied head
        without blocks too."""
        if self.batch_invariant:
            bf16_linears(self)
            if self.output is None and self.head_blocks is None and self.dtype == torch.bfloat16 and (
                    self.config.hidden_size % GROUP == 0 and cpu_kernels.available() and self.device.type == "cpu"):
                self.head_blocks = bf16_blocks(self.tok_embeddings.weight)
        pack_linears(self)
        if self.output is None and self.head_blocks is not None and self.quantized_lm_head is None:
            self.quantized_lm_head = BlockWeight.of([self.head_blocks])
            if self.tok_embeddings.blocks is self.head_blocks:  # one copy of the table: the head's layout
                self.tok_embeddings.table = self.quantized_lm_head
                self.head_blocks = self.tok_embeddings.blocks = self.head_blocks.released()
        elif self.output is None and not self.batch_invariant:
            self.packed_lm_head = pack_weight(self.tok_embeddings.weight)
        return self

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        mask: torch.Tensor | None = None,
        logits_rows: torch.Tensor | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run T new tokens on top of the cache's committed rows; their K/V rows stay pending in the cache.

        mask [T, cache.length + T] bool (True = may attend); None: all committed rows, new rows causally.
        logits_rows: which of the T rows get logits (None: all). capture_layers: decoder layer ids whose
        outputs are returned: HF's `hidden_states[l + 1]`, except that HF applies the final norm to the
        last layer's entry and we never do.
        """
        return self.forward_batch([SequenceInput(tokens, positions, cache, mask, logits_rows, capture_layers)])[0]

    @torch.no_grad()
    def forward_batch(self, batch: Sequence[SequenceInput]) -> list[ForwardOutput]:
        """`forward` for several sequences (distinct caches) in one pass over the weights; outputs in order."""
        if not batch:
            raise ValueError("forward_batch needs at least one sequence")
        if len({id(b.cache) for b in batch}) != len(batch):
            raise ValueError("each sequence of a batch needs its own cache")
        for b in batch:
            self._check_input(b)
        if self.compiled is None:
            return self._forward_eager(batch)
        with self.compiled.store.lock:
            steps = [i for i, b in enumerate(batch) if self.compiled.accepts(b)]
            outputs = dict(zip(steps, self.compiled(self, [batch[i] for i in steps]), strict=True)) if steps else {}
            chunks = [i for i in range(len(batch)) if i not in outputs]
            if chunks:
                outputs.update(zip(chunks, self._forward_eager([batch[i] for i in chunks]), strict=True))
            return [outputs[i] for i in range(len(batch))]

    @torch.no_grad()
    def forward_by_layers(self, batch: Sequence[SequenceInput]) -> Generator[int, None, list[ForwardOutput]]:
        """`forward_batch` run eagerly half a layer at a time: yields a layer's index after its token mixer and again
        after its feed-forward, returns the outputs. Run in slices with other forwards between them (under
        `step_lock`), it computes exactly what one call does: the same ops on the same tensors (a layer's cache rows
        are looked up when it runs: the store may grow)."""
        if len({id(b.cache) for b in batch}) != len(batch):
            raise ValueError("each sequence of a batch needs its own cache")
        for b in batch:
            self._check_input(b)
        return (yield from self._eager_layers(batch))

    def step_lock(self) -> contextlib.AbstractContextManager:
        """What a forward holds while it runs on the compiled step's cache store (nothing without one)."""
        return self.compiled.store.lock if self.compiled is not None else contextlib.nullcontext()

    def _forward_eager(self, batch: Sequence[SequenceInput]) -> list[ForwardOutput]:
        layers = self._eager_layers(batch)
        while True:
            try:
                next(layers)
            except StopIteration as done:
                return done.value

    def _eager_layers(self, batch: Sequence[SequenceInput]) -> Generator[int, None, list[ForwardOutput]]:
        trees = [self._tree(b) for b in batch] if self.config.linear_layers else None
        window = self.config.sliding_window
        masks, bounds, keys, begin = [], [], [], 0
        local_masks, local_keys = [], []  # sliding-window layers' (the same objects where the window cuts nothing)
        for b in batch:
            T = b.tokens.shape[0]
            start = b.cache.begin(T)
            # the masks come from the host (the plan of row-by-row attention reads them there), then move once
            host_mask = b.mask.cpu() if b.mask is not None else None
            if b.new_rows_mask is not None:
                host_mask = torch.cat([torch.ones(T, start, dtype=torch.bool), b.new_rows_mask.cpu()], dim=1)
            mask = host_mask.to(self.device) if host_mask is not None else None
            masks.append(causal_mask(start, T, self.device) if mask is None and T > 1 else mask)
            row_by_row = self.batch_invariant and (mask is not None or T == 1)  # verify rows, AR steps
            if row_by_row:
                keys.append(plan_rows(row_keys(host_mask) if host_mask is not None else [start + 1], self.device))
            else:  # a prompt chunk: one causal call
                keys.append(None)
            host_local = window_mask(host_mask, start, b.positions.cpu(), window) if window else host_mask
            if host_local is host_mask:
                local_masks.append(masks[-1])
                local_keys.append(keys[-1])
            else:
                local_masks.append(host_local.to(self.device))
                local_keys.append(plan_rows(row_keys(host_local), self.device) if row_by_row else None)
            bounds.append((begin, begin + T))
            begin += T
        tokens = torch.cat([b.tokens for b in batch]).to(self.device)
        positions = torch.cat([b.positions for b in batch]).to(self.device)
        x = self.embed(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.attention_scaling, x.dtype)
        local_rope = rope_cos_sin(positions, self.local_inv_freq, 1.0, x.dtype) if window else (cos, sin)
        wanted = sorted({i for b in batch for i in b.capture_layers})
        captured: dict[int, torch.Tensor] = {}
        for i, block in enumerate(self.layers):
            sliding = self.config.is_sliding(i)
            segments = [Segment(lo, hi, m, b.cache.layer(i), keys=rk) for (lo, hi), m, b, rk in zip(
                bounds, local_masks if sliding else masks, batch, local_keys if sliding else keys, strict=True)]
            if trees is not None:
                for seg, parents in zip(segments, trees, strict=True):
                    seg.parents = parents
            x = block.mixer_half(x, *(local_rope if sliding else (cos, sin)), segments)
            yield i
            x = block.mlp_half(x)
            if i in wanted:
                captured[i] = x
            yield i
        rows = [torch.arange(lo, hi) if b.logits_rows is None else b.logits_rows.cpu() + lo
                for (lo, hi), b in zip(bounds, batch, strict=True)]
        logits = self.logits(self.norm(x[torch.cat(rows).to(self.device)]))
        outputs, offset = [], 0
        for (lo, hi), r, b in zip(bounds, rows, batch, strict=True):
            captures = (torch.stack([captured[i][lo:hi] for i in b.capture_layers], dim=1)
                        if b.capture_layers else None)
            outputs.append(ForwardOutput(logits[offset : offset + len(r)], captures))
            offset += len(r)
        return outputs

    @staticmethod
    def _tree(b: SequenceInput) -> list[int] | None:
        """The new rows' parents (linear-attention layers follow them; attention follows the mask); None for a
        plain causal forward (a prompt chunk: a chain that may run the chunked form of the delta rule)."""
        T = b.tokens.shape[0]
        if b.new_rows_mask is not None:
            return parents_from_mask(b.new_rows_mask)
        if b.mask is not None:
            start = b.mask.shape[1] - T
            return parents_from_mask(b.mask[:, start:], b.mask[:, :start])
        return None

    def _check_input(self, b: SequenceInput) -> None:
        """What a forward relies on, checked for every sequence of a batch before any cache is touched. The caller
        validates what a request brings (token ids, capture layers, the tree: target_service/engine.py); only the
        cache's bound is an error here, since no caller's check covers every cache."""
        tokens, positions, cache, mask, rows_mask = b.tokens, b.positions, b.cache, b.mask, b.new_rows_mask
        T = tokens.shape[0]
        assert tokens.ndim == 1 and positions.shape == tokens.shape and T >= 1, (tokens.shape, positions.shape)
        assert all(0 <= i < self.config.num_layers for i in b.capture_layers), b.capture_layers
        assert mask is None or (mask.dtype == torch.bool and mask.shape == (T, cache.length + T)), (mask.shape, T)
        assert rows_mask is None or (mask is None and rows_mask.dtype == torch.bool and rows_mask.shape == (T, T)), (
            rows_mask.shape, T)
        assert cache.dtype == self.dtype, (cache.dtype, self.dtype)
        if cache.length + T > cache.max_length:
            raise CacheFullError(f"sequence would reach {cache.length + T} tokens, over the cache's max_length "
                                 f"{cache.max_length}")
