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
from dspark_grpc.runtime.kernels import cpu_kernels

if TYPE_CHECKING:
    from dspark_grpc.runtime.formats.gguf_reader import GGUFTensor

Q = gguf.GGMLQuantizationType
INT4_TYPES = (Q.Q4_0, Q.Q4_1)
BLOCK_TYPES = (*INT4_TYPES, Q.Q8_0)  # what runtime/kernels/gguf_matmul.cpp multiplies as stored
GROUP = 32
# a float matrix in the fast precision: its bf16 bits as "blocks" of runtime/kernels/gguf_matmul.cpp (bf16_blocks)
BF16 = Q.BF16


@dataclass(frozen=True)
class QuantBlocks:
    """One matrix's raw GGUF blocks: data uint8 [out, in / 32 * block bytes] for a weight of shape (out, in)."""

    qtype: gguf.GGMLQuantizationType
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        out, inp = self.shape
        assert block in (1, GROUP) and inp % GROUP == 0, (self.qtype, self.shape)
        assert self.data.dtype == torch.uint8 and self.data.shape == (out, inp // block * size), self.data.shape

    def with_rows(self, data: torch.Tensor) -> QuantBlocks:
        """The same matrix with its rows reordered (`data` = self.data with rows permuted)."""
        return QuantBlocks(self.qtype, data, self.shape)


def blocks_of(tensor: GGUFTensor, types: Sequence[gguf.GGMLQuantizationType] = INT4_TYPES) -> QuantBlocks | None:
    """A 2-D tensor's blocks (in torch order: [out, bytes per row]) if its type is one of `types`, else None."""
    qtype = Q(tensor.tensor_type)
    if qtype not in types or len(tensor.shape) != 2:
        return None
    inp, out = (int(n) for n in tensor.shape)  # GGUF's ne order
    data = torch.from_numpy(tensor.data.copy()).view(torch.uint8).reshape(out, -1)
    return QuantBlocks(qtype, data, (out, inp))


def quantize_q8_0(weight: torch.Tensor) -> QuantBlocks:
    """A float [out, in] weight (in % 32 == 0) as Q8_0 blocks, as llama.cpp's quantizer writes them (the gguf
    package's): d = max |w| / 127 per block of 32 in float16, q = round(w / d). For weights no file gave as blocks
    (a drafter's), so that they run on runtime/kernels/gguf_matmul.cpp."""
    assert weight.dim() == 2 and weight.shape[1] % GROUP == 0, weight.shape
    data = gguf.quantize(weight.detach().float().cpu().numpy(), Q.Q8_0)
    return QuantBlocks(Q.Q8_0, torch.from_numpy(data).view(torch.uint8).reshape(weight.shape[0], -1),
                       (int(weight.shape[0]), int(weight.shape[1])))


def bf16_blocks(weight: torch.Tensor) -> QuantBlocks:
    """A float [out, in] weight (in % 32 == 0) rounded to bf16, as BF16 blocks for runtime/kernels/gguf_matmul.cpp:
    a float matrix of the fast precision multiplied by our own kernel, whose rows are batch invariant by construction
    (oneDNN's packed bf16 GEMM is not on every CPU: its blocking follows the row count)."""
    assert weight.dim() == 2 and weight.shape[1] % GROUP == 0, weight.shape
    data = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.uint8)
    return QuantBlocks(BF16, data, (int(weight.shape[0]), int(weight.shape[1])))


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


def q8_fields(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 matrix's d float32 [out, in / 32] and codes int8 [out, in / 32, 32] (w = d * q)."""
    out, inp = blocks.shape
    b = blocks.data.view(out, inp // GROUP, -1)
    return b[..., 0:2].contiguous().view(torch.float16).float()[..., 0], b[..., 2:].contiguous().view(torch.int8)


def interleave_rows(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The layout runtime/kernels/gguf_matmul.cpp reads (its header says why): codes uint8 [out / 16, in / 32, 256 (Q4),
    512 (Q8) or 1024 (BF16)], d and m float16 [out / 16, in / 32, 16] (m: Q4_1's m, Q4_0's -8d; None for Q8_0; neither
    for BF16). out % 16 == 0."""
    out, inp = blocks.shape
    rows = cpu_kernels.ROWS
    nb, groups = inp // GROUP, out // rows
    assert out % rows == 0, blocks.shape
    if blocks.qtype == BF16:  # pairs of inputs: [group, block, pair, row, 4 bytes]
        pairs = blocks.data.view(groups, rows, nb, GROUP // 2, 4).permute(0, 2, 3, 1, 4)
        return pairs.reshape(groups, nb, -1).contiguous(), None, None
    if blocks.qtype == Q.Q8_0:
        d, q = q8_fields(blocks)
        codes = q.view(groups, rows, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1).view(torch.uint8)
        m = None
    else:
        d, m, q = block_fields(blocks)  # element e = 8 i + 4 half + k: chunk i, low (half 0) or high nibble
        q = q.view(groups, rows, nb, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        codes = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, nb, -1)
        m = m if m is not None else -8 * d

    def by_group(t: torch.Tensor) -> torch.Tensor:  # exact: d and m are float16 in the file (-8d too)
        return t.view(groups, rows, nb).transpose(1, 2).contiguous().to(torch.float16)

    return codes.contiguous(), by_group(d), None if m is None else by_group(m)


@dataclass(frozen=True)
class BlockWeight:
    """[out, in] weight from the file's blocks (Q4_0/Q4_1/Q8_0), interleaved for runtime/kernels/gguf_matmul.cpp's
    kernel (int8 activations per block of 32, as llama.cpp does), or a float matrix's BF16 blocks (bf16 activations)."""

    codes: torch.Tensor
    d: torch.Tensor | None
    m: torch.Tensor | None
    qtype: gguf.GGMLQuantizationType
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(cls, parts: Sequence[QuantBlocks], dtype: torch.dtype = torch.bfloat16,
           bias: torch.Tensor | None = None) -> BlockWeight:
        """Several matrices of one type with the same input size stacked along out (a fused q/k/v or gate/up);
        rows are padded with zero blocks to a multiple of 16. (`dtype`: as Int4Weight.of; any activation dtype
        the kernel takes works here.)"""
        qtype, inp = parts[0].qtype, parts[0].shape[1]
        assert all(p.qtype == qtype and p.shape[1] == inp for p in parts), parts
        data = torch.cat([p.data for p in parts])
        out = data.shape[0]
        pad = -out % cpu_kernels.ROWS
        if pad:
            data = torch.cat([data, data.new_zeros(pad, data.shape[1])])
        codes, d, m = interleave_rows(QuantBlocks(qtype, data, (out + pad, inp)))
        if bias is not None:
            bias = torch.cat([bias.float(), bias.new_zeros(pad, dtype=torch.float32)])
        return cls(codes, d, m, qtype, bias, out)

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        y = cpu_kernels.gguf_matmul(x, self.codes, self.d, self.m, int(self.qtype), self.bias, out_dtype or x.dtype)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]


def quantized_weight(parts: Sequence[QuantBlocks], dtype: torch.dtype = torch.bfloat16,
                     bias: torch.Tensor | None = None) -> BlockWeight | Int4Weight | None:
    """The fast precision's matmul for these blocks stacked along out: the GGUF block kernel where it builds on this
    machine (None when the parts are of different types: it multiplies one type per call), else torch's int4 kernel
    (Q4_0/Q4_1 only, mixed or not). BF16 blocks need the kernel."""
    if cpu_kernels.available():
        return BlockWeight.of(parts, dtype, bias) if len({p.qtype for p in parts}) == 1 else None
    return Int4Weight.of(parts, dtype, bias)


def block_types() -> tuple[gguf.GGMLQuantizationType, ...]:
    """The GGUF types the fast precision keeps as blocks on this machine."""
    return BLOCK_TYPES if cpu_kernels.available() else INT4_TYPES


def int4_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
