"""Weights as a GGUF file gives them: Q4_0/Q4_1 blocks straight into torch's int4 group-32 CPU layout.

A Q4_1 block holds 32 weights as w = d * q + m (q in 0..15; fp16 d and m); Q4_0 holds w = d * (q - 8). Torch's
`_weight_int4pack_mm_for_cpu` computes w = (q - 8) * scale + zero per group of 32, so a block maps onto it
with scale = d and zero = m + 8d (Q4_1) or zero = 0 (Q4_0): the codes are copied from the nibbles (low nibble of
byte j = element j, high nibble = element j + 16), never through float. The scales have to be in the activation
dtype, and only bf16 activations have a vectorized kernel on x86, so the fast precision rounds d and m + 8d to
bf16: that is the one inexact step (with float32 scales the weights are reproduced bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import gguf
import torch

if TYPE_CHECKING:
    from .gguf_reader import GGUFTensor

Q = gguf.GGMLQuantizationType
INT4_TYPES = (Q.Q4_0, Q.Q4_1)
GROUP = 32


@dataclass(frozen=True)
class QuantBlocks:
    """One matrix's raw GGUF blocks: data uint8 [out, in / 32 * block bytes] for a weight of shape (out, in)."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        out, inp = self.shape
        assert block == GROUP and inp % GROUP == 0, (self.qtype, self.shape)
        assert self.data.dtype == torch.uint8 and self.data.shape == (out, inp // GROUP * size), self.data.shape

    def with_rows(self, data: torch.Tensor) -> QuantBlocks:
        """The same matrix with its rows reordered (`data` = self.data with rows permuted)."""
        return QuantBlocks(self.qtype, data, self.shape)


def blocks_of(tensor: GGUFTensor) -> QuantBlocks | None:
    """A Q4_0/Q4_1 2-D tensor's blocks (in torch order: [out, bytes per row]); None for any other tensor."""
    qtype = Q(tensor.tensor_type)
    if qtype not in INT4_TYPES or len(tensor.shape) != 2:
        return None
    inp, out = (int(n) for n in tensor.shape)  # GGUF's ne order
    data = torch.from_numpy(tensor.data.copy()).view(torch.uint8).reshape(out, -1)
    return QuantBlocks(qtype, data, (out, inp))


def block_fields(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """d and m (None for Q4_0) float32 [out, in / 32], and the codes uint8 [out, in / 32, 32] in 0..15."""
    out, inp = blocks.shape
    b = blocks.data.view(out, inp // GROUP, -1)
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]
    m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if blocks.qtype == Q.Q4_1 else None
    qs = b[..., 4:] if blocks.qtype == Q.Q4_1 else b[..., 2:]
    assert qs.shape[-1] == GROUP // 2, qs.shape
    return d, m, torch.cat([qs & 0xF, qs >> 4], dim=-1)


def int4_codes(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes int32 [out, in] in 0..15, scale and zero float32 [out, in / 32] with w = (q - 8) * scale + zero."""
    d, m, codes = block_fields(blocks)
    zero = m + 8 * d if m is not None else torch.zeros_like(d)
    return codes.reshape(blocks.shape).to(torch.int32), d, zero


def dequantize_blocks(blocks: QuantBlocks) -> torch.Tensor:
    """float32 [out, in], bit for bit as the gguf package dequantizes them: d * q + m (Q4_1), d * (q - 8) (Q4_0),
    the same float32 operations in the same order."""
    d, m, codes = block_fields(blocks)
    if m is not None:
        w = d[..., None] * codes.float() + m[..., None]
    else:
        w = d[..., None] * (codes.to(torch.int8) - 8).float()
    return w.view(blocks.shape)


@dataclass(frozen=True)
class Int4Weight:
    """[out, in] weight in torch's int4 CPU layout (group 32) with its scales and zeros in the activation dtype."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [in / 32, out, 2]
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(cls, parts: Sequence[QuantBlocks], dtype: torch.dtype = torch.bfloat16,
           bias: torch.Tensor | None = None) -> Int4Weight:
        """Several matrices with the same input size stacked along out (a fused q/k/v or gate/up)."""
        codes, scale, zero = (torch.cat(t) for t in zip(*(int4_codes(p) for p in parts), strict=True))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(packed, scales_zeros, None if bias is None else bias.to(dtype), codes.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == self.scales_zeros.dtype, (x.dtype, self.scales_zeros.dtype)
        lead, x2 = x.shape[:-1], x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
