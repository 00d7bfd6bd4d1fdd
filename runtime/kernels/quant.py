"""Weights as a GGUF file gives them, for the fast precision's matmuls: the file's blocks re-laid out once at load for
runtime/kernels/gguf_matmul.cpp (`BlockWeight`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, each multiplied as
llama.cpp multiplies it, and a float matrix's bf16 bits), or, where that kernel does not build, Q4_0/Q4_1 blocks
straight into torch's int4 group-32 CPU layout (`Int4Weight`; every other type is then dequantized). Read back as
floats only where needed: `dequantize_blocks` (the gguf package's float32 bits, in torch), and `dequantize_rows` for an
embedding kept as blocks (only the looked-up rows).

`interleave_rows` keeps the file's bits and about its bytes per weight (16 rows side by side; the K-quants' 6-bit
scales and mins one byte each): Q4_0 0.625 (file 0.5625: Q4_0's -8d is stored as an m), Q4_1 0.625, Q5_0 0.6875,
Q5_1 0.75, Q8_0 1.0625, Q4_K 0.578 (file 0.5625), Q5_K 0.703 (0.6875), Q6_K 0.8203, all as in the file otherwise.

Torch's int4 layout: a Q4_1 block holds 32 weights as w = d * q + m (q in 0..15; fp16 d and m); Q4_0 holds
w = d * (q - 8). Torch's `_weight_int4pack_mm_for_cpu` computes w = (q - 8) * scale + zero per group of 32, so a block
maps onto it with scale = d and zero = m + 8d (Q4_1) or zero = 0 (Q4_0): the codes are copied from the nibbles (low
nibble of byte j = element j, high nibble = element j + 16), never through float. The scales have to be in the
activation dtype, and only bf16 activations have a vectorized kernel on x86, so the fast precision rounds d and m + 8d
to bf16: that is the one inexact step (with float32 scales the weights are reproduced bit for bit).
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
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # super-blocks of 256
# what runtime/kernels/gguf_matmul.cpp multiplies as stored
BLOCK_TYPES = (*INT4_TYPES, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_TYPES)
GROUP = 32
QK_K = 256
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
        assert block in (1, GROUP, QK_K) and inp % max(block, GROUP) == 0, (self.qtype, self.shape)
        assert self.data.dtype == torch.uint8 and self.data.shape == (out, inp // block * size), self.data.shape

    def with_rows(self, data: torch.Tensor) -> QuantBlocks:
        """The same matrix with its rows reordered (`data` = self.data with rows permuted)."""
        return QuantBlocks(self.qtype, data, self.shape)

    def released(self) -> QuantBlocks:
        """Its type and shape, its bytes a meta tensor: what a module keeps once a `BlockWeight` holds the matrix."""
        return QuantBlocks(self.qtype, torch.empty(self.data.shape, dtype=torch.uint8, device="meta"), self.shape)


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


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes [..., 2] as the float16 they store, [...]."""
    return b.contiguous().view(torch.float16)[..., 0]


def _bits(b: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """Fields of `width` bits, lowest first: [..., n] uint8 -> [..., n * 8 / width] (byte 0's fields, then byte 1's
    ...)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return ((b[..., None] >> shifts) & ((1 << width) - 1)).flatten(-2)[..., :count]


@dataclass(frozen=True)
class Fields:
    """A matrix's blocks decoded (the file's values, no arithmetic): codes uint8 [out, in] as stored (unsigned), d and
    m float16 [out, blocks] (m as the kernel adds it: Q4_1's and Q5_1's m, Q4_0's -8d, Q4_K's and Q5_K's -dmin; None
    for Q5_0, Q8_0 and Q6_K), and for K-quants the sub-block scales (and Q4_K/Q5_K's mins) uint8 [out, blocks, 8]
    (Q6_K: int8 [out, blocks, 16])."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    scales: torch.Tensor | None = None
    mins: torch.Tensor | None = None


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins: j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 as a nibble
    of byte j + 4 (scale low, min high) with their top 2 bits in the top bits of bytes j - 4 (scale) and j (min)."""
    lo, hi = s[..., 0:4], s[..., 4:8]
    scales = torch.cat([lo & 63, (s[..., 8:12] & 0xF) | ((lo >> 6) << 4)], dim=-1)
    mins = torch.cat([hi & 63, (s[..., 8:12] >> 4) | ((hi >> 6) << 4)], dim=-1)
    return scales, mins


def block_codes(blocks: QuantBlocks) -> Fields:
    """The fields of a Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (codes as q + 128), Q4_K, Q5_K or Q6_K matrix, from the file's
    layout (ggml-common.h's block_q*):
      Q4_0 d, qs[16]; Q4_1 d, m, qs[16]; Q5_0 d, qh[4], qs[16]; Q5_1 d, m, qh[4], qs[16]: element j < 16 the low
        nibble of qs[j], j >= 16 the high nibble of qs[j - 16]; bit 4 = bit j of qh (little-endian);
      Q4_K d, dmin, scales[12], qs[128]; Q5_K the same with qh[32] before qs: 64 elements per 32 bytes of qs (low
        nibbles the first 32, high the next), bit 4 of element 32 s + l = bit s of qh[l];
      Q6_K ql[128], qh[64], scales[16] (int8, one per 16 elements), d: per half of 128, element 32 k + l (k < 4) has
        its low 4 bits in ql[l + 32 (k % 2)] (low nibble for k < 2, high for k >= 2) and bits 4-5 in qh[l] >> 2 k."""
    qtype, (out, inp) = blocks.qtype, blocks.shape
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    b = blocks.data.view(out, inp // block, -1)
    if qtype == Q.Q8_0:
        d, q = q8_fields(blocks)
        return Fields((q.reshape(out, inp).to(torch.int16) + 128).to(torch.uint8), _fp16(b[..., 0:2]), None)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = _fp16(b[..., 0:2])
        m = _fp16(b[..., 2:4]) if qtype in (Q.Q4_1, Q.Q5_1) else -8 * d if qtype == Q.Q4_0 else None
        qs = b[..., -16:]
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)
        if qtype in (Q.Q5_0, Q.Q5_1):
            codes = codes | (_bits(b[..., -20:-16], 32) << 4)
        return Fields(codes.reshape(out, inp), d, m)
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
        scales, mins = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(out, -1, 4, 1, 32)  # [.., 64-element chunk, nibble, l]
        codes = torch.cat([qs & 0xF, qs >> 4], dim=-2).reshape(out, -1, 256)
        if qtype == Q.Q5_K:  # bit s of qh[l] -> element 32 s + l
            high = _bits(b[..., 16:48], 256).view(out, -1, 32, 8).transpose(-1, -2)
            codes = codes | (high.reshape(out, -1, 256) << 4)
        return Fields(codes.reshape(out, inp), d, -dmin, scales, mins)
    assert qtype == Q.Q6_K, qtype
    ql = b[..., 0:128].reshape(out, -1, 2, 1, 2, 32)  # [.., half, nibble, 32-byte group, l]
    low = torch.cat([ql & 0xF, ql >> 4], dim=-3).reshape(out, -1, 2, 128)
    qh = b[..., 128:192].reshape(out, -1, 2, 1, 32)  # [.., half, k, l]
    high = ((qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3).reshape(out, -1, 2, 128)
    codes = (low | (high << 4)).reshape(out, inp)
    return Fields(codes, _fp16(b[..., 208:210]), None, b[..., 192:208].contiguous().view(torch.int8))


def int4_codes(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0/Q4_1 matrix's codes int32 [out, in] in 0..15, scale and zero float32 [out, in / 32] with
    w = (q - 8) * scale + zero."""
    assert blocks.qtype in INT4_TYPES, blocks.qtype
    f = block_codes(blocks)
    d = f.d.float()
    zero = f.m.float() + 8 * d if blocks.qtype == Q.Q4_1 else torch.zeros_like(d)
    return f.codes.to(torch.int32), d, zero


_CODE_OFFSETS = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128, Q.Q6_K: 32}  # stored code - offset = the signed q


def dequantize_blocks(blocks: QuantBlocks) -> torch.Tensor:
    """float32 [out, in] from `block_codes`' fields, bit for bit as the gguf package dequantizes them, the same float32
    operations in the same order: d q (+ m for Q4_1/Q5_1) per block of 32, q signed for Q4_0, Q5_0 and Q8_0;
    (d sc) q - (dmin mn) per sub-block of 32 for Q4_K/Q5_K (+ (m mn) with m = -dmin: the same bits), (d sc) q per
    sub-block of 16 for Q6_K (q signed). Every product is exact in float32 (fp16 times small integers), so only the add
    rounds: a fused multiply-add would give the same bits."""
    return dequantize_fields(block_codes(blocks), blocks.qtype, blocks.shape)


def dequantize_fields(f: Fields, qtype: gguf.GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    """`dequantize_blocks` from the decoded fields (`block_codes`, or `BlockWeight.rows`' de-interleaved ones)."""
    out, inp = shape
    q = (f.codes.to(torch.int16) - _CODE_OFFSETS.get(qtype, 0)).float()
    if qtype in K_TYPES:
        sub = 16 if qtype == Q.Q6_K else 32
        w = (f.d.float()[..., None] * f.scales.float()).view(out, inp // sub, 1) * q.view(out, inp // sub, sub)
        if f.mins is not None:
            w = w + (f.m.float()[..., None] * f.mins.float()).view(out, inp // sub, 1)
    else:
        w = f.d.float()[..., None] * q.view(out, inp // GROUP, GROUP)
        if qtype in (Q.Q4_1, Q.Q5_1):
            w = w + f.m.float()[..., None]
    return w.view(out, inp)


def dequantize_rows(blocks: QuantBlocks, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [...] of the matrix as float32 [..., in] (an embedding lookup): only those rows' blocks are
    gathered and dequantized (`dequantize_blocks`), never the whole matrix."""
    rows = blocks.data[index.reshape(-1)]
    w = dequantize_blocks(QuantBlocks(blocks.qtype, rows, (rows.shape[0], blocks.shape[1])))
    return w.view(*index.shape, blocks.shape[1])


def _interleave_codes(codes: torch.Tensor, bits: int, groups: int, blocks32: int) -> torch.Tensor:
    """codes uint8 [out, in] (unsigned, < 2^bits) as runtime/kernels/gguf_matmul.cpp's blocks of 32 for 16 rows:
    [groups, in / 32, bytes] with bytes = the nibbles [4 chunks][16 rows][4] (element 4 j + k, j = 2 i + half: chunk
    i, low (half 0) or high nibble), then per bit above 4 a plane [16 rows][4] (bit j of byte (row, k) = that bit of
    element 4 j + k; 6 bits: planes p = 0, 1, bits 2 j', 2 j' + 1 = bits 4, 5 of element 4 (4 p + j') + k)."""
    rows = cpu_kernels.ROWS
    q = codes.view(groups, rows, blocks32, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [g, b, chunk, row, k, half]
    parts = [((q[..., 0] & 0xF) | ((q[..., 1] & 0xF) << 4)).reshape(groups, blocks32, -1)]
    if bits == 4:
        return parts[0]
    high = (codes >> 4).view(groups, rows, blocks32, 8, 4)  # [g, row, b, j, k]
    per_plane = 8 // (bits - 4)  # registers j per plane: 8 (5 bits), 4 (6 bits)
    for first in range(0, 8, per_plane):
        plane = high[..., first, :].clone()
        for j in range(first + 1, first + per_plane):
            plane |= high[..., j, :] << ((j - first) * (bits - 4))
        parts.append(plane.permute(0, 2, 1, 3).reshape(groups, blocks32, -1))  # [g, b, row, k]
    return torch.cat(parts, dim=-1)


CODE_BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}


def interleave_rows(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The layout runtime/kernels/gguf_matmul.cpp reads (its header says why): codes uint8 [out / 16, blocks, bytes]
    with blocks = in / 32 (in / 256 for K-quants) and bytes = 256 (Q4), 320 (Q5), 512 (Q8), 1024 (BF16), 2304 (Q4_K),
    2816 (Q5_K), 3328 (Q6_K); d and m float16 [out / 16, blocks, 16] (m as `Fields` says; None for Q5_0, Q8_0, Q6_K;
    neither for BF16). out % 16 == 0."""
    out, inp = blocks.shape
    rows = cpu_kernels.ROWS
    groups = out // rows
    assert out % rows == 0, blocks.shape
    if blocks.qtype == BF16:  # pairs of inputs: [group, block, pair, row, 4 bytes]
        nb = inp // GROUP
        pairs = blocks.data.view(groups, rows, nb, GROUP // 2, 4).permute(0, 2, 3, 1, 4)
        return pairs.reshape(groups, nb, -1).contiguous(), None, None
    if blocks.qtype == Q.Q8_0:
        nb = inp // GROUP
        d, q = q8_fields(blocks)
        codes = q.view(groups, rows, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1).view(torch.uint8)
        m = None
    else:
        f = block_codes(blocks)
        d, m, nb = f.d, f.m, f.d.shape[1]
        codes = _interleave_codes(f.codes, CODE_BITS[blocks.qtype], groups, inp // GROUP)
        if blocks.qtype in K_TYPES:  # per super-block: its 8 blocks of codes, then the scales (and mins) in pairs

            def pairs(t: torch.Tensor) -> torch.Tensor:  # [out, nb, n] -> [groups, nb, n / 2 pairs, 16 rows, 2]
                return t.view(torch.uint8).view(groups, rows, nb, -1, 2).permute(0, 2, 3, 1, 4).reshape(groups, nb, -1)

            extra = [pairs(f.scales)] + ([] if f.mins is None else [pairs(f.mins)])
            codes = torch.cat([codes.reshape(groups, nb, -1), *extra], dim=-1)

    def by_group(t: torch.Tensor) -> torch.Tensor:  # exact: d and m are float16 in the file (-8d and -dmin too)
        return t.view(groups, rows, nb).transpose(1, 2).contiguous().to(torch.float16)

    return codes.contiguous(), by_group(d), None if m is None else by_group(m)


def _row_of(t: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """From n groups laid out [n, a, b, 16 rows, c], row `row[i]` of group i: [n, a, b, c]."""
    return t.permute(0, 3, 1, 2, 4)[torch.arange(t.shape[0]), row]


def _deinterleave_codes(codes: torch.Tensor, bits: int, row: torch.Tensor) -> torch.Tensor:
    """`_interleave_codes` undone for one row of each group: codes [n, in / 32, bytes] of n groups, `row` [n] the row
    of each to read -> uint8 [n, in]."""
    rows, (n, blocks32) = cpu_kernels.ROWS, codes.shape[:2]
    nib = _row_of(codes[..., :256].reshape(n, blocks32, 4, rows, 4), row)  # [n, b, chunk, k]
    q = torch.stack([nib & 0xF, nib >> 4], dim=-2).reshape(n, blocks32 * GROUP)  # element 8 chunk + 4 half + k
    if bits == 4:
        return q
    width = bits - 4
    per_plane = 8 // width
    planes = _row_of(codes[..., 256:].reshape(n, blocks32, -1, rows, 4), row)  # [n, b, p, k]
    shifts = (torch.arange(per_plane, dtype=torch.uint8) * width).view(1, 1, 1, per_plane, 1)
    high = (planes[..., None, :] >> shifts) & ((1 << width) - 1)  # [n, b, p, j', k]: element 4 (p per_plane + j') + k
    return q | (high.reshape(n, blocks32 * GROUP) << 4)


@dataclass(frozen=True)
class BlockWeight:
    """[out, in] weight from the file's blocks (BLOCK_TYPES), interleaved for runtime/kernels/gguf_matmul.cpp's kernel
    (int8 activations per block of 32, or per super-block of 256 for K-quants, as llama.cpp does), or a float matrix's
    BF16 blocks (bf16 activations)."""

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

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * (QK_K if self.qtype in K_TYPES else GROUP)

    def part(self, start: int, size: int) -> BlockWeight:
        """Rows [start, start + size) as a BlockWeight sharing this one's memory (a fused projection's member); start
        a multiple of 16, and size too unless the part runs to the end."""
        rows = cpu_kernels.ROWS
        assert start % rows == 0 and (size % rows == 0 or start + size == self.out_features), (start, size)
        g0, g1 = start // rows, -(-(start + size) // rows)
        return BlockWeight(self.codes[g0:g1], None if self.d is None else self.d[g0:g1],
                           None if self.m is None else self.m[g0:g1], self.qtype,
                           None if self.bias is None else self.bias[g0 * rows:g1 * rows], size)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [...] of the weight as float32 [..., in], bit for bit `dequantize_rows` of the file's blocks
        (an embedding looked up in its tied head's blocks: no second copy of the table). Only the looked-up rows'
        16-row groups are read back from the interleaved layout."""
        rows, flat = cpu_kernels.ROWS, index.reshape(-1)
        n, inp = flat.shape[0], self.in_features
        g, r = flat // rows, flat % rows
        codes = self.codes[g]
        if self.qtype == BF16:  # [n, block, pair, row, 4 bytes]
            w = _row_of(codes.view(n, -1, GROUP // 2, rows, 4), r).reshape(n, -1).view(torch.bfloat16).float()
            return w.view(*index.shape, inp)
        d = self.d[g].transpose(1, 2)[torch.arange(n), r]  # [n, blocks, 16] -> the looked-up row's [n, blocks]
        m = None if self.m is None else self.m[g].transpose(1, 2)[torch.arange(n), r]
        if self.qtype == Q.Q8_0:  # [n, block, 8, row, 4] int8
            q = _row_of(codes.view(torch.int8).view(n, -1, 8, rows, 4), r).reshape(n, inp)
            f = Fields((q.to(torch.int16) + 128).to(torch.uint8), d, None)
        elif self.qtype in K_TYPES:  # per super-block: 8 blocks of codes, then scales (and mins) in [pair, row, 2]
            nb, bits, scale_bytes = inp // QK_K, CODE_BITS[self.qtype], rows * (16 if self.qtype == Q.Q6_K else 8)
            at = 8 * 64 * bits  # a block of 32's codes: 64 bytes per bit for its 16 rows

            def unpaired(t: torch.Tensor) -> torch.Tensor:  # [n, nb, pairs * 16 * 2] -> the row's [n, nb, bytes]
                return _row_of(t.reshape(n, nb, -1, rows, 2), r).reshape(n, nb, -1)

            scales = unpaired(codes[..., at:at + scale_bytes])
            mins = None if self.m is None else unpaired(codes[..., at + scale_bytes:])
            q = _deinterleave_codes(codes[..., :at].reshape(n, nb * 8, -1), bits, r)
            f = Fields(q, d, m, scales.view(torch.int8) if self.qtype == Q.Q6_K else scales, mins)
        else:
            f = Fields(_deinterleave_codes(codes, CODE_BITS[self.qtype], r), d, m)
        return dequantize_fields(f, self.qtype, (n, inp)).view(*index.shape, inp)

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
