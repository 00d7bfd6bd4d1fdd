"""Linear layers with weights pre-packed once for oneDNN (CPU inference).

On this kind of CPU (AMD EPYC, MKL) `F.linear` with 2-16 rows costs 1.5-2x one row: every call re-packs the
weight, and the 1-row path is a slow GEMV. oneDNN's blocked layout, reordered once at load, makes a forward of
1-16 rows cost about the same as 1 row, which is what makes verifying a draft cheap (docs/PERFORMANCE.md,
"packed weights"). The packed copy is an extra copy of each weight; the original stays for state_dict, training
and reading. Only frozen inference models are packed: the packed copy does not follow later weight updates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import (
    GROUP,
    BlockWeight,
    Int4Weight,
    QuantBlocks,
    bf16_blocks,
    quantize_q8_0,
    quantized_weight,
)
from dspark_grpc.runtime.models import fixed_rows
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
MIN_ROWS = 3


def packing_available(weight: torch.Tensor) -> bool:
    """bf16 needs a CPU with oneDNN's bf16 path (AVX-512 or AVX-NE-CONVERT); an AVX2-only CPU multiplies it
    unpacked."""
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES and weight.ndim == 2
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (weight.dtype != torch.bfloat16 or _bf16_packing()))


@functools.cache
def _bf16_packing() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-packed copy of a [out, in] weight, or None where packing does not apply (GPU, other dtypes)."""
    if not packing_available(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through `packed` (from pack_weight(weight)) when given and no grad is needed."""
    if fixed_rows.applies(x):
        return fixed_rows.by_fixed_rows(lambda rows: F.linear(rows, weight, bias), x)
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    if packed is None or x.dtype != weight.dtype or x.device.type != "cpu" or needs_grad:
        return F.linear(x, weight, bias)
    return packed_matmul(x, packed, bias, weight.shape[0])


def packed_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if rows < MIN_ROWS:
        x2 = torch.cat([x2, x2.new_zeros(MIN_ROWS - rows, x2.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return y[:rows].view(*lead, out_features)


@dataclass(frozen=True)
class FusedProjection:
    """Several projections of the same input (q/k/v, gate/up) as one packed matmul: one pass over the rows."""

    packed: torch.Tensor | None
    bias: torch.Tensor | None
    sizes: tuple[int, ...]
    quantized: BlockWeight | Int4Weight | None = None  # instead of packed, when every layer came as GGUF blocks

    @classmethod
    def of(cls, layers: Sequence[nn.Linear]) -> FusedProjection | None:
        if any(getattr(layer, "row_by_row", False) for layer in layers):
            return None
        blocks = [getattr(layer, "blocks", None) for layer in layers]
        if any(b is not None for b in blocks):
            quantized = None if any(b is None for b in blocks) else quantized_weight(
                blocks, layers[0].weight.dtype, _fused_bias(layers))
            if quantized is None:
                return None
            if isinstance(quantized, BlockWeight):
                _share_parts(layers, quantized)
            return cls(None, None, tuple(layer.out_features for layer in layers), quantized)
        weight = torch.cat([layer.weight.detach() for layer in layers])
        packed = pack_weight(weight)
        if packed is None or any(layer.weight.requires_grad for layer in layers):
            return None
        return cls(packed, _fused_bias(layers), tuple(layer.out_features for layer in layers))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.quantized(x) if self.quantized is not None else packed_matmul(x, self.packed, self.bias,
                                                                                sum(self.sizes))
        return y.split(self.sizes, dim=-1)


def _share_parts(layers: Sequence[Linear], fused: BlockWeight) -> None:
    """Each member whose rows start a 16-row group runs (alone, as `project_kv` runs wk and wv) on its part of the
    fused weight, and lets its own copy of the file's blocks go."""
    start = 0
    for layer in layers:
        if start % cpu_kernels.ROWS == 0 and (layer.out_features % cpu_kernels.ROWS == 0 or layer is layers[-1]):
            layer.quantized = fused.part(start, layer.out_features)
            layer.blocks = layer.blocks.released()
        start += layer.out_features


def _fused_bias(layers: Sequence[nn.Linear]) -> torch.Tensor | None:
    like = next((layer.bias for layer in layers if layer.bias is not None), None)
    if like is None:
        return None
    return torch.cat([layer.bias.detach() if layer.bias is not None
                      else like.new_zeros(layer.out_features) for layer in layers])


class Linear(nn.Linear):
    """nn.Linear that uses a packed copy of its weight once `pack_linears` has made one.

    A Linear given a GGUF's `blocks` (runtime/kernels/quant.py; its weight is then a meta tensor) runs on them
    (`quantized_weight`: its part of a fused projection's weight, or its own, made by `pack_linears` or on first
    use); once a `BlockWeight` holds the matrix, `blocks` keeps only its type and shape. One `row_by_row` multiplies
    one row per call (`bf16_linears`)."""

    packed: torch.Tensor | None = None
    blocks: QuantBlocks | None = None
    quantized: BlockWeight | Int4Weight | None = None
    row_by_row = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            if self.quantized is None:
                self.quantized = quantized_weight([self.blocks], self.weight.dtype, self.bias)
            return self.quantized(x)
        if self.row_by_row:
            return rows_one_by_one(lambda row: F.linear(row, self.weight, self.bias), x)
        return linear(x, self.weight, self.bias, self.packed)


def rows_one_by_one(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (a row-wise op) over x [..., d] one row per call: every call has one shape, so a row never depends on how
    many rows came with it, whatever kernel torch picks (slow for many rows: the weights are read once per row)."""
    return fixed_rows.by_fixed_rows(fn, x, rows=1)


def matmul_kind(model: nn.Module) -> str:
    """"gguf-blocks" when its Linears run on GGUF blocks with runtime/kernels/gguf_matmul.cpp, "int4-g32" with torch's
    int4 kernel, "onednn-packed" when `pack_linears` packed the model, else "aten" (cost tables are keyed by it, so a
    table profiled on one kind is never reused for another)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if any(m.blocks is not None for m in linears):
        kind = "gguf-blocks" if cpu_kernels.available() else "int4-g32"
        return kind + ("-compiled" if getattr(model, "compiled", None) is not None else "")
    return "onednn-packed" if any(m.packed is not None for m in linears) else "aten"


def quantize_linears(model: nn.Module) -> int:
    """Give every frozen `Linear` of `model` whose input size is a multiple of 32 its weight as Q8_0 blocks
    (`quantize_q8_0`), so that it runs on runtime/kernels/gguf_matmul.cpp (int8 weights and activations; another
    precision,
    for a model whose rounding decides no output token: a drafter). Nothing without the CPU kernels. Call before
    `pack_linears`; returns how many Linears got blocks."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is None and not m.weight.requires_grad
               and m.in_features % GROUP == 0 and m.weight.device.type == "cpu"]
    if not linears or not cpu_kernels.available():  # off the CPU nothing is built
        return 0
    for module in linears:
        module.blocks, module.packed = quantize_q8_0(module.weight), None
    return len(linears)


def bf16_linears(model: nn.Module) -> int:
    """The fast precision's float matrices, batch invariant by construction: every frozen bf16 `Linear` without
    blocks gets its weight as BF16 blocks for runtime/kernels/gguf_matmul.cpp (`bf16_blocks`; its weight becomes a
    meta tensor, as a GGUF's block matrices' are); one whose input size is
    not a multiple of 32, or every one where the CPU kernels do not build, multiplies row by row (`row_by_row`).
    Call before `pack_linears`; returns how many got blocks."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is None and not m.weight.requires_grad
               and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    with_blocks = 0
    for module in linears:
        if module.in_features % GROUP == 0 and cpu_kernels.available():
            module.blocks, module.packed = bf16_blocks(module.weight), None
            # the blocks are the weight now: no second copy kept (as a GGUF's block matrices)
            module.weight = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                                         requires_grad=False)
            with_blocks += 1
        else:
            module.row_by_row, module.packed = True, None
    return with_blocks


def pack_linears(model: nn.Module) -> int:
    """Pack every `Linear` of a frozen model in place, and let modules with a `pack_fused()` (attention's q/k/v,
    the MLP's gate/up) build their fused projections; returns how many Linears were packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.blocks is not None:
            if module.quantized is None and cpu_kernels.available():  # (a fused member has its part: parents first)
                module.quantized = quantized_weight([module.blocks], module.weight.dtype, module.bias)
                if isinstance(module.quantized, BlockWeight):  # it holds the matrix now
                    module.blocks = module.blocks.released()
            count += 1
        elif isinstance(module, Linear) and not module.row_by_row:
            module.packed = None if module.weight.requires_grad else pack_weight(module.weight)
            count += module.packed is not None
        pack_fused = getattr(module, "pack_fused", None)
        if callable(pack_fused):
            pack_fused()
    return count
