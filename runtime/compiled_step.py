"""The fast precision's decode step as one compiled graph (torch.compile, inductor): AR steps and verifies.

A step is R rows of any number of sequences, each sequence in its own slot of a SlotStore (runtime/slot_cache.py).
Per layer the graph writes the rows' K/V into their slots by index and runs attention with every row as its own
batch element: the row's query against its slot's first C keys, masked by its mask row. So a row computes the
same thing whatever the other rows are, and C only adds masked keys. One graph serves every shape (dynamic R and C,
R = 1 not specialized): AR steps and verifies run the same code. Batch invariance (a verify row equals its
1-row AR step bitwise) then rests on the kernels and on the inductor rounding every bf16 intermediate as eager does
(`emulate_precision_casts`; without it, fused kernels keep float32 intermediates and the two graphs fuse
differently). Attention is two float32 matmuls and a softmax, not SDPA: with the CPU flash kernel a row of a 5-row
step at one position of a SmolLM2 run differed from its AR step (rows of 2-4 did not), with the matmuls none did.
tests/runtime/test_compiled_step.py checks it for 1-row and wider steps, several C and tree masks.

Prompt chunks do not come here: the per-row gather of keys suits a few rows, not hundreds; they run eagerly
(the same for AR and speculation). Hybrid (linear-attention) models are not compiled.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .batch_invariant import BUCKET
from .rope import rope_cos_sin, rotate_half
from .slot_cache import SlotCache, SlotStore

if TYPE_CHECKING:
    from .transformer import ForwardOutput, SequenceInput, Transformer

COMPILE_MODES = ("off", "fast")
WARMUP_ROWS = (1, 2)  # one graph serves both (R is never specialized); the second call checks it


def step_graph(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               write_rows: torch.Tensor, mask: torch.Tensor, logit_rows: torch.Tensor, rope: torch.Tensor,
               ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots/write_rows [R]; mask [R, C] bool over the first C rows of each row's slot (its own
    new row included: rows are written before attention); logit_rows [N]; rope [2, max_positions, head_dim] (cos,
    sin: looked up, since a compiled cos differs in its last bits with the row's place in a vector). Returns
    the normed rows [N, hidden] for the head, and every layer's output [R, num_layers, hidden]. The head runs
    after the graph: its oneDNN-packed weight (Transformer.lm_head) is faster than any matmul the graph makes."""
    c = model.config
    R, C = mask.shape
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    x = model.tok_embeddings(tokens)
    cos, sin = rope[0, positions], rope[1, positions]
    bias = torch.where(mask, 0.0, float("-inf"))[:, None, None, :]  # [R, 1, 1, C]
    hidden = []
    for i, layer in enumerate(model.layers):
        a = layer.attention
        q, k, v = a.qkv(layer.attention_norm(x))
        q, k, v = q.view(R, H, D), k.view(R, KV, D), v.view(R, KV, D)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = (t * cos[:, None] + rotate_half(t) * sin[:, None] for t in (q, k))
        ks[i][slots, :, write_rows] = k
        vs[i][slots, :, write_rows] = v
        keys, values = ks[i][slots, :, :C], vs[i][slots, :, :C]  # [R, KV, C, D]
        scores = torch.matmul(q.view(R, KV, H // KV, D).float(), keys.float().transpose(-1, -2)) * D**-0.5
        o = torch.matmul(torch.softmax(scores + bias, dim=-1), values.float()).to(x.dtype)
        h = x + a.wo(o.reshape(R, H * D))
        x = h + layer.feed_forward(layer.ffn_norm(h))
        hidden.append(x)
    return model.norm(x[logit_rows]), torch.stack(hidden, dim=1)


def can_compile(model: Transformer) -> str | None:
    """Why this model cannot take the compiled step, or None."""
    c = model.config
    if c.linear_layers:
        return "hybrid (linear-attention) models are not compiled"
    if c.attention_output_gate or (c.rotary_dim or c.head_dim) != c.head_dim:
        return "gated or partial-rotary attention is not compiled"
    if model.dtype != torch.bfloat16:
        return "only the fast precision (bf16 activations) is compiled"
    if any(layer.attention.qkv is None for layer in model.layers):
        return "the compiled step needs the fused q/k/v projections of a packed model"
    return None


class CompiledStep:
    """The model's step graph and the slot store every session's cache lives in."""

    def __init__(self, model: Transformer) -> None:
        reason = can_compile(model)
        if reason is not None:
            raise ValueError(reason)
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False  # R, C, slots and capacity are unrelated sizes: no equality guards
        fx_config.backed_size_oblivious = True  # R = 1 too: one graph for AR steps and verifies
        self.model = model
        self.store = SlotStore(model.config, model.dtype, model.device)
        positions = torch.arange(model.config.max_position_embeddings, device=model.device)
        self.rope = torch.stack(rope_cos_sin(positions, model.inv_freq, model.attention_scaling, model.dtype))
        self.graph = torch.compile(step_graph, fullgraph=True, dynamic=True,
                                   options={"emulate_precision_casts": True})

    def new_cache(self, max_length: int) -> SlotCache:
        return SlotCache(self.store, max_length)

    def accepts(self, b: SequenceInput) -> bool:
        """A step (AR row, chain or tree verify) on a slot of this store; prompt chunks run eagerly."""
        step = b.mask is not None or b.new_rows_mask is not None or b.tokens.shape[0] == 1
        return step and isinstance(b.cache, SlotCache) and b.cache.store is self.store

    @torch.no_grad()
    def warm_up(self, progress: bool = True) -> float:
        """Compile the graph now (a throwaway slot), showing progress; returns the seconds it took."""
        t0 = time.perf_counter()
        cache = self.new_cache(max_length=BUCKET)
        from .transformer import SequenceInput

        if progress:
            print("[dspark] compiling the step graph (AR steps and verifies; minutes on 2 cores, less from torch's "
                  "inductor cache)...", file=sys.stderr, flush=True)
        for rows in WARMUP_ROWS:
            tokens = torch.zeros(rows, dtype=torch.long)
            self(self.model, [SequenceInput(tokens, torch.arange(rows), cache,
                                            new_rows_mask=torch.ones(rows, rows, dtype=torch.bool).tril())])
            cache.discard()
        seconds = time.perf_counter() - t0
        if progress:
            print(f"[dspark] step graph ready ({seconds:.1f} s)", file=sys.stderr, flush=True)
        return seconds

    @torch.no_grad()
    def __call__(self, model: Transformer, batch: Sequence[SequenceInput]) -> list[ForwardOutput]:
        from .transformer import ForwardOutput

        masks, slots, write_rows, logit_rows, begin = [], [], [], [], 0
        starts = [b.cache.begin(b.tokens.shape[0]) for b in batch]
        C = -(-max(s + b.tokens.shape[0] for s, b in zip(starts, batch, strict=True)) // BUCKET) * BUCKET
        self.store.reserve(C)
        for b, start in zip(batch, starts, strict=True):
            T = b.tokens.shape[0]
            mask = torch.zeros(T, C, dtype=torch.bool)
            if b.mask is not None:
                mask[:, : start + T] = b.mask
            else:
                mask[:, :start] = True
                mask[:, start : start + T] = (b.new_rows_mask if b.new_rows_mask is not None
                                              else torch.ones(T, T, dtype=torch.bool).tril())
            masks.append(mask)
            slots.append(torch.full((T,), b.cache.slot))
            write_rows.append(torch.arange(start, start + T))
            rows = torch.arange(T) if b.logits_rows is None else b.logits_rows.cpu()
            logit_rows.append(rows + begin)
            begin += T
        args = (model, torch.cat([b.tokens for b in batch]), torch.cat([b.positions for b in batch]),
                torch.cat(slots), torch.cat(write_rows), torch.cat(masks), torch.cat(logit_rows), self.rope,
                self.store.k, self.store.v)
        last, hidden = self.graph(*args)
        logits = model.lm_head(last).float()
        outputs, row, offset = [], 0, 0
        for b, rows in zip(batch, logit_rows, strict=True):
            T = b.tokens.shape[0]
            captures = hidden[row : row + T, list(b.capture_layers)] if b.capture_layers else None
            outputs.append(ForwardOutput(logits[offset : offset + len(rows)], captures))
            row, offset = row + T, offset + len(rows)
        return outputs
