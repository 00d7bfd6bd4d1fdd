"""The GGUF block kernel (runtime/kernels/gguf_matmul.cpp) against llama.cpp's arithmetic written out independently in
float64: for blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) int8 activations per block of 32 (scale max|x| / 127, codes
rounded half to even), exact integer block dots, scaled by d_w * d_x, plus Q4_0/Q4_1/Q5_1's m times the block's float
sum of x; for the K-quants (Q4_K, Q5_K, Q6_K) llama.cpp's Q8_K activations per 256 and the super-blocks' exact integer
sums. The weights' values come from the gguf package's dequantize (K-quant blocks are made by
tests/runtime/block_quants.py: the package cannot quantize them)."""

from __future__ import annotations

import os
import platform
import shutil

import gguf
import numpy as np
import pytest
import torch
from block_quants import extreme_blocks, quantize_blocks, random_blocks
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import (
    BLOCK_TYPES,
    K_TYPES,
    BlockWeight,
    Int4Weight,
    QuantBlocks,
    bf16_blocks,
    block_codes,
    dequantize_blocks,
    dequantize_rows,
    quantized_weight,
)
from dspark_grpc.runtime.models.linear import FusedProjection, Linear
from isa_checks import bf16_within_bound
from tolerance import assert_within, gamma, linear_error_bound, unit_roundoff

Q = gguf.GGMLQuantizationType
LEGACY_TYPES = tuple(t for t in BLOCK_TYPES if t not in K_TYPES)  # blocks of 32
NEW_TYPES = (Q.Q5_0, Q.Q5_1, *K_TYPES)


def test_the_kernels_build_on_an_x86_machine_with_gcc():
    """Not skipped: a build error would otherwise only show as skipped tests and a slower fallback."""
    if platform.machine() != "x86_64" or shutil.which("g++") is None or os.environ.get("DSPARK_CPU_KERNELS") == "0":
        pytest.skip("no x86 CPU or no g++: the fast precision uses torch's kernels")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def quantized(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantBlocks:
    return quantize_blocks(weight, qtype)


def llama_cpp_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64 y [R, out] for blocks of 32; the weights' d, m and codes decoded with the gguf package (Q5_0 and Q8_0
    dot their signed codes, m = 0)."""
    out, inp = blocks.shape
    nb = inp // 32
    w = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), blocks.qtype)).reshape(out, nb, 32).double()
    raw = blocks.data.view(out, nb, -1)
    d = raw[..., 0:2].contiguous().view(torch.float16).double()[..., 0]
    if blocks.qtype in (Q.Q4_1, Q.Q5_1):
        m = raw[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
    else:
        m = torch.zeros_like(d) if blocks.qtype in (Q.Q5_0, Q.Q8_0) else -8 * d
    q = torch.where(d[..., None] != 0, (w - m[..., None]) / d[..., None], 0).round()  # integer codes
    xb = x.float().view(-1, nb, 32)
    dx = xb.abs().amax(-1) / 127  # float32, as the kernel
    inv = torch.where(dx > 0, 1 / dx, 0)
    qx = torch.round(xb * inv[..., None]).double()  # half to even
    dots = torch.einsum("rbe,obe->rob", qx, q)
    return (dots * d[None] * dx.double()[:, None]).sum(-1) + (m[None] * xb.double().sum(-1)[:, None]).sum(-1)


def block_arithmetic_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The kernel's float32 arithmetic of llama.cpp's formula against the same formula in float64 (the same codes):
    per block d_w * d_x * (exact integer dot), then a sum over the blocks (gamma_{blocks+3} of their magnitudes,
    |d_w q_w| <= |w| + |m| with |m| <= the block's max |w|, |x'| <= |x| + max|x| / 254), plus m times the block's
    float sum of x (gamma_{blocks+34}), the bias and the output."""
    def block_max(t: torch.Tensor) -> torch.Tensor:
        b = t.double().abs().unflatten(-1, (-1, 32))
        return b.amax(-1, keepdim=True).expand(b.shape).flatten(-2)

    nb, x_abs = x.shape[-1] // 32, x.double().abs()
    codes = (x_abs + block_max(x) / 254) @ (w.abs() + block_max(w)).T
    offsets = x_abs @ block_max(w).T
    return (gamma(nb + 3) * codes + gamma(nb + 34) * offsets
            + unit_roundoff() * (2 * bias.double().abs() + codes + offsets))


@needs_kernels
@pytest.mark.parametrize("qtype", LEGACY_TYPES)
@pytest.mark.parametrize("shape", [(64, 96), (40, 64), (960, 576), (576, 1536)])  # odd block counts, padded rows
def test_kernel_computes_llama_cpp_arithmetic(qtype, shape):
    g = torch.Generator().manual_seed(shape[0] + int(qtype))
    blocks = quantized(torch.randn(*shape, generator=g) * 0.05, qtype)
    bias = torch.randn(shape[0], generator=g)
    weight = BlockWeight.of([blocks], bias=bias)
    x = torch.randn(13, shape[1], generator=g)  # a full tile of rows and a partial one
    x[0, :32] = 0  # an all-zero block (scale 0)
    expected = llama_cpp_reference(x, blocks) + bias.double()
    got = weight(x, out_dtype=torch.float32).double()
    assert got.shape == (13, shape[0])
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), qtype)).double().reshape(shape)
    assert_within(got, expected, block_arithmetic_bound(x, dequantized, bias))
    exact = x.double() @ dequantized.T + bias.double()
    # int8 activations: not the float matmul (outside its float32 rounding bound somewhere)...
    assert not bool(((got - exact).abs() <= linear_error_bound(x, dequantized, bias)).all())
    assert (got - exact).norm() < 0.05 * exact.norm()  # ...but close to it


def q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's quantize_row_q8_K in float32 as there: per 256 inputs the first element of largest |x| sets
    iscale = -127 / it (its code is -127), codes round(iscale x) half to even (nearest_int), at most 127, scale
    1 / iscale (0 and codes 0 for an all-zero block). codes float64 [R, K / 256, 256], scales float64 [R, K / 256]."""
    xb = x.float().reshape(x.shape[0], -1, 256)
    top = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))[..., 0]  # argmax: the first of equal maxima
    # a tensor divided (torch computes scalar / tensor as a reciprocal times the scalar: another rounding, which moves
    # codes at a tie, e.g. an element half the largest)
    iscale = torch.where(top != 0, torch.full_like(top, -127.0) / top, 0)
    codes = torch.round(xb * iscale[..., None]).clamp(max=127)
    return codes.double(), torch.where(top != 0, 1 / iscale, 0).double()


def k_quant_weights(blocks: QuantBlocks) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 [out, in]: each weight exactly d sc q - dmin mn (Q4_K, Q5_K) or d sc (q - 32) (Q6_K), and the
    magnitude |d sc q| + |dmin mn| of its two terms. The values come from the gguf package's dequantize, the 6-bit
    scales and mins from its Q4_K.get_scale_min (d, dmin and Q6_K's int8 scales are plain fields); the codes are
    recovered from the values, and the exact weights checked to round to the package's float32 ones."""
    (out, inp), qtype = blocks.shape, blocks.qtype
    raw = blocks.data.numpy().reshape(out * inp // 256, -1)
    w32 = torch.from_numpy(gguf.quants.dequantize(raw, qtype)).double()  # [super-blocks, 256]

    def fp16(offset: int) -> torch.Tensor:
        return torch.from_numpy(raw[:, offset : offset + 2].copy().view(np.float16)).double()

    if qtype == Q.Q6_K:
        step = (fp16(208) * torch.from_numpy(raw[:, 192:208].copy().view(np.int8)).double()).repeat_interleave(16, -1)
        offset = torch.zeros_like(step)
    else:
        scales, mins = (torch.from_numpy(t.astype(np.float64)) for t in gguf.quants.Q4_K.get_scale_min(raw[:, 4:16]))
        step, offset = (fp16(0) * scales).repeat_interleave(32, -1), (fp16(2) * mins).repeat_interleave(32, -1)
    q = torch.where(step != 0, ((w32 + offset) / step).round(), 0)  # Q6_K: q - 32
    exact = step * q - offset
    assert torch.equal(exact.float().double(), w32)
    return exact.reshape(out, inp), ((step * q).abs() + offset).reshape(out, inp)


def k_quant_reference(x: torch.Tensor, blocks: QuantBlocks, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_K/Q5_K/Q6_K x Q8_K dot products in float64, and the kernel's bound around them.

    Per super-block b the kernel forms the exact integers S_b (Q6_K: sum_s sc_s (q_s - 32) . x_s; Q4_K/Q5_K:
    sum_s sc_s q_s . x_s) and M_b (sum_s mn_s times x_s's code sum), so sum_b d_x (d S_b - dmin M_b) equals
    sum_e w_e d_x x'_e with w_e the exact weights. The float32 side: each of the 2 B terms (B super-blocks) takes S_b or
    M_b to float (<= 1 rounding) times the float product d_w d_x (1 rounding) and is accumulated by a fused multiply-add
    (1 rounding each, 2 B in all): within gamma_{2B+2} of the sum of the terms' magnitudes, which is at most
    sum_e |d_x x'_e| (|d sc q|_e + |dmin mn|_e); the bias add rounds once more (u times |y| + |bias|)."""
    w, magnitude = k_quant_weights(blocks)
    codes, scales = q8_k(x)
    xq = (codes * scales[..., None]).reshape(x.shape[0], -1)
    terms = xq.abs() @ magnitude.T
    bound = gamma(2 * x.shape[-1] // 256 + 2) * terms + unit_roundoff() * (2 * bias.double().abs() + terms)
    return xq @ w.T + bias.double(), bound


@needs_kernels
@pytest.mark.parametrize("qtype", K_TYPES)
@pytest.mark.parametrize("shape", [(64, 256), (40, 768), (960, 1536), (256, 3072)])  # padded rows, 1-12 super-blocks
@pytest.mark.parametrize("source", ["quantized", "random bytes"])
def test_k_quant_kernel_computes_llama_cpp_arithmetic(qtype, shape, source):
    g = torch.Generator().manual_seed(shape[0] + int(qtype))
    weight = torch.randn(*shape, generator=g) * 0.05
    blocks = quantized(weight, qtype) if source == "quantized" else random_blocks(shape, qtype, seed=shape[0])
    bias = torch.randn(shape[0], generator=g)
    x = torch.randn(13, shape[1], generator=g)  # a full tile of rows and a partial one
    x[0, :256] = 0  # an all-zero super-block (scale 0)
    x[1, 7] = -2 * x[1, :256].abs().max()  # a negative largest element (positive codes, negative scale)
    expected, bound = k_quant_reference(x, blocks, bias)
    got = BlockWeight.of([blocks], bias=bias)(x, out_dtype=torch.float32).double()
    assert got.shape == (13, shape[0])
    assert_within(got, expected, bound)
    dequantized, _ = k_quant_weights(blocks)
    exact = x.double() @ dequantized.T + bias.double()
    # 8-bit activations: not the float matmul (outside its float32 rounding bound somewhere)...
    assert not bool(((got - exact).abs() <= linear_error_bound(x, dequantized, bias)).all())
    assert (got - exact).norm() < 0.05 * (exact - bias.double()).norm()  # ...but close to it
    assert torch.equal(BlockWeight.of([blocks], bias=bias)(x.bfloat16(), out_dtype=torch.float32),
                       BlockWeight.of([blocks], bias=bias)(x.bfloat16().float(), out_dtype=torch.float32))


@needs_kernels
@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("high", [True, False], ids=["largest codes", "smallest codes"])
def test_largest_integer_sums_are_exact(qtype, high):
    """Every code, scale and min at an extreme and activations of one magnitude (codes +-127): the integer sums at
    their largest (the AVX2 path's int16 sums included: 5-bit codes 8 products, 6-bit 4, at most 31496 and 32004)."""
    shape = (32, 512)
    blocks = extreme_blocks(shape, qtype, high)
    x = torch.ones(4, shape[1])
    x[1] = -1
    x[2, ::3] = -1  # mixed signs
    x[3] = torch.randn(shape[1], generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(shape[0])
    got = BlockWeight.of([blocks])(x, out_dtype=torch.float32).double()
    if qtype in K_TYPES:
        expected, bound = k_quant_reference(x, blocks, bias)
    else:
        dequantized = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), qtype)).double().reshape(shape)
        expected, bound = llama_cpp_reference(x, blocks), block_arithmetic_bound(x, dequantized, bias)
    assert expected[:3].abs().min() > 0
    assert_within(got, expected, bound)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_block_fields_decode_like_the_gguf_package(qtype):
    """runtime/kernels/quant.py's reading of every type's layout (on random bytes: every field value) against the gguf
    package's dequantize: d sc q - dmin mn, d sc (q - 32), d (q - offset) + m rebuilt from the fields in float64 round
    to the package's float32 weights exactly."""
    shape = (32, 512)
    blocks = random_blocks(shape, qtype, seed=int(qtype))
    f = block_codes(blocks)
    q, d = f.codes.double(), f.d.double()
    if qtype in K_TYPES:
        sub = 16 if qtype == Q.Q6_K else 32
        step = (d[..., None] * f.scales.double()).repeat_interleave(sub, -1).reshape(shape)
        offset = 0 if f.mins is None else (f.m.double()[..., None] * f.mins.double()).repeat_interleave(32, -1)
        w = step * (q - 32 * (qtype == Q.Q6_K)) + (0 if f.mins is None else offset.reshape(shape))
    else:
        m = 0 if f.m is None else f.m.double().repeat_interleave(32, -1)
        w = d.repeat_interleave(32, -1) * (q - {Q.Q5_0: 16, Q.Q8_0: 128}.get(qtype, 0)) + m
    reference = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), qtype)).double()
    assert torch.equal(w.float().double(), reference)


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_blocks_and_rows_dequantize_like_the_gguf_package(qtype):
    """runtime/kernels/quant.py's dequantize (the fast precision's embedding lookup: only the looked-up rows' blocks,
    decoded in torch) against the gguf package's, on random bytes and on extreme blocks: the same float32 bits, and
    in bf16 the rows of the whole matrix dequantized then cast (the embedding the fast precision kept before)."""
    shape = (64, 512)
    for blocks in (random_blocks(shape, qtype, seed=100 + int(qtype)), extreme_blocks(shape, qtype),
                   extreme_blocks(shape, qtype, high=False)):
        whole = gguf.quants.dequantize(blocks.data.numpy(), qtype).reshape(shape)
        assert np.array_equal(dequantize_blocks(blocks).numpy().view(np.uint32), whole.view(np.uint32))
        index = torch.tensor([[7, 0, 63, 7], [31, 2, 2, 40]])  # repeats, the first and last rows
        rows = gguf.quants.dequantize(blocks.data[index.flatten()].numpy(), qtype).reshape(2, 4, shape[1])
        got = dequantize_rows(blocks, index)
        assert got.dtype == torch.float32 and got.shape == (2, 4, shape[1])
        assert np.array_equal(got.numpy().view(np.uint32), rows.view(np.uint32))
        assert torch.equal(got.bfloat16(), torch.from_numpy(whole).bfloat16()[index])
        assert dequantize_rows(blocks, torch.tensor(5)).shape == (shape[1],)  # one id: one row


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_rows_read_back_from_the_kernels_layout_are_the_files(qtype):
    """A tied embedding looks its rows up in the head's interleaved weight (`BlockWeight.rows`, no second copy of the
    table): the gguf package's float32 bits of those rows, on random and extreme blocks, with a row count that is
    not a multiple of 16 (the layout's last group padded)."""
    for shape in ((64, 512), (40, 256)):
        for blocks in (random_blocks(shape, qtype, seed=200 + int(qtype)), extreme_blocks(shape, qtype)):
            index = torch.tensor([[7, 0, shape[0] - 1, 7], [31, 2, 2, 17]])
            want = gguf.quants.dequantize(blocks.data[index.flatten()].numpy(), qtype).reshape(2, 4, shape[1])
            got = BlockWeight.of([blocks]).rows(index)
            assert got.dtype == torch.float32 and got.shape == (2, 4, shape[1])
            assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), (qtype, shape)
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    index = torch.tensor([23, 0, 16])
    assert torch.equal(BlockWeight.of([bf16_blocks(weight)]).rows(index), weight[index].float())


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quant_test_blocks_follow_the_format(qtype):
    """tests/runtime/block_quants.py's K-quant writer, read back by the gguf package: near the weights it quantized."""
    weight = torch.randn(16, 1024, generator=torch.Generator().manual_seed(3)) * 0.05
    back = torch.from_numpy(gguf.quants.dequantize(quantized(weight, qtype).data.numpy(), qtype))
    assert not torch.equal(back, weight)
    assert (back - weight).norm() < {Q.Q4_K: 0.1, Q.Q5_K: 0.05, Q.Q6_K: 0.025}[qtype] * weight.norm()


@needs_kernels
@pytest.mark.parametrize(("qtype", "file_bytes", "ours"), [
    (Q.Q4_0, 18 / 32, 20 / 32), (Q.Q4_1, 20 / 32, 20 / 32), (Q.Q5_0, 22 / 32, 22 / 32), (Q.Q5_1, 24 / 32, 24 / 32),
    (Q.Q8_0, 34 / 32, 34 / 32), (Q.Q4_K, 144 / 256, 148 / 256), (Q.Q5_K, 176 / 256, 180 / 256),
    (Q.Q6_K, 210 / 256, 210 / 256)])
def test_layouts_keep_about_the_files_bytes(qtype, file_bytes, ours):
    """Bytes per weight of the kernel's layout (codes, d and m): the file's, but for Q4_0's m (-8d) and the K-quants'
    6-bit scales and mins at a byte each."""
    shape = (64, 512)
    blocks = random_blocks(shape, qtype, seed=1)
    assert blocks.data.numel() == file_bytes * shape[0] * shape[1]
    w = BlockWeight.of([blocks])
    stored = sum(t.numel() * t.element_size() for t in (w.codes, w.d, w.m) if t is not None)
    assert stored == ours * shape[0] * shape[1]


@needs_kernels
def test_fused_parts_and_bf16_rows():
    g = torch.Generator().manual_seed(5)
    parts = [quantized(torch.randn(n, 64, generator=g) * 0.05, Q.Q4_1) for n in (32, 16, 16)]
    fused = BlockWeight.of(parts)
    x = torch.randn(3, 2, 64, generator=g).bfloat16()  # leading dims kept, bf16 in and out
    got = fused(x)
    assert got.shape == (3, 2, 64) and got.dtype == torch.bfloat16
    one_by_one = torch.cat([BlockWeight.of([p])(x) for p in parts], dim=-1)
    assert torch.equal(got, one_by_one)
    for start, p in zip((0, 32, 48), parts, strict=True):  # each part a view of the fused weight
        part = fused.part(start, p.shape[0])
        assert part.codes.data_ptr() == fused.codes[start // 16].data_ptr()
        assert torch.equal(part(x), BlockWeight.of([p])(x))


@needs_kernels
def test_fused_members_run_alone_on_their_part_and_let_their_blocks_go():
    """q/k/v fused: each member Linear keeps only its blocks' type and shape, and alone (as project_kv runs wk and wv)
    gives the same bits as on its own blocks; a member whose rows do not start a 16-row group keeps its blocks."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 64, generator=g).bfloat16()
    for sizes, shares in (((32, 16, 16), (True, True, True)), ((24, 8, 16), (False, False, True))):
        layers, alone = [], []
        for n in sizes:
            layer = Linear(64, n, bias=True)
            layer.requires_grad_(False)
            layer.blocks = quantized(torch.randn(n, 64, generator=g) * 0.05, Q.Q8_0)
            alone.append(BlockWeight.of([layer.blocks], bias=layer.bias)(x))
            layers.append(layer)
        fused = FusedProjection.of(layers)
        assert torch.equal(torch.cat(fused(x), dim=-1), torch.cat(alone, dim=-1))
        for layer, want, shared in zip(layers, alone, shares, strict=True):
            assert (layer.quantized is not None) == shared == layer.blocks.data.is_meta, sizes
            assert torch.equal(layer(x), want)


@needs_kernels
@pytest.mark.parametrize("qtypes", [(Q.Q4_1, Q.Q8_0), (Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q8_0)])
def test_projections_of_different_block_types_stay_unfused(qtypes):
    # as llama.cpp's mixed files keep some matrices at 8 bits, a Q4_K_M's v projection at Q6_K, and fall back from
    # K-quants to Q5_0 / Q8_0 where rows are not multiples of 256
    g = torch.Generator().manual_seed(9)
    inp = 256 if qtypes[0] in K_TYPES else 64
    layers = []
    for qtype in qtypes:
        layer = Linear(inp, 32, bias=False)
        layer.blocks = quantized(torch.randn(32, inp, generator=g) * 0.05, qtype)
        layers.append(layer)
    assert FusedProjection.of(layers) is None
    x = torch.randn(3, inp, generator=g).bfloat16()
    for layer in layers:  # each runs on its own blocks
        assert torch.equal(layer(x), BlockWeight.of([layer.blocks])(x))
    assert FusedProjection.of(layers[:1]) is not None


@needs_kernels
def test_kernel_rejects_inconsistent_tensors():
    blocks = quantized(torch.randn(32, 64) * 0.05, Q.Q4_1)
    weight = BlockWeight.of([blocks])
    with pytest.raises(RuntimeError, match="codes"):
        weight(torch.randn(2, 96))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        weight(torch.randn(2, 64).double())


@needs_kernels
def test_turned_off_it_leaves_torch_int4(monkeypatch):
    blocks = [quantized(torch.randn(32, 64) * 0.05, Q.Q4_1)]
    assert isinstance(quantized_weight(blocks), BlockWeight)
    monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
    cpu_kernels._load.cache_clear()
    try:
        assert not cpu_kernels.available() and "DSPARK_CPU_KERNELS" in cpu_kernels.unavailable_reason()
        assert isinstance(quantized_weight(blocks), Int4Weight)
    finally:
        monkeypatch.delenv("DSPARK_CPU_KERNELS")
        cpu_kernels._load.cache_clear()
    assert cpu_kernels.available()


@needs_kernels
@pytest.mark.parametrize(("H", "KV", "D"), [(6, 2, 64), (2, 2, 64), (8, 2, 128), (24, 2, 64)])
def test_row_attention_writes_the_rows_and_attends_over_each_rows_slot(H, KV, D):
    # 3, 1 and 4 query heads per KV head are compiled for their sizes; 12 takes the loops sized at run time
    g = torch.Generator().manual_seed(7)
    slots_count, cap = 3, 48
    k_store = torch.randn(slots_count, KV, cap, D, generator=g).bfloat16()
    v_store = torch.randn(slots_count, KV, cap, D, generator=g).bfloat16()
    R, C = 5, 40
    q = torch.randn(R, H, D, generator=g).bfloat16()
    k, v = torch.randn(R, KV, D, generator=g).bfloat16(), torch.randn(R, KV, D, generator=g).bfloat16()
    slots, write_rows = torch.tensor([2, 0, 0, 1, 2]), torch.tensor([30, 31, 32, 39, 31])
    mask = torch.rand(R, C, generator=g) < 0.6
    mask[:, 0] = True
    mask[1, 32] = True  # row 1 sees row 2's new key (same slot): every row is written before any attends
    expected_k, expected_v = k_store.clone(), v_store.clone()
    expected_k[slots, :, write_rows], expected_v[slots, :, write_rows] = k, v
    stores = k_store.clone(), v_store.clone()
    got = cpu_kernels.row_attention(q, k, v, *stores, slots, write_rows, mask)
    assert torch.equal(stores[0], expected_k) and torch.equal(stores[1], expected_v)
    for r in range(R):  # float64 attention per row, per head, written out
        for h in range(H):
            keys = expected_k[slots[r], h // (H // KV), :C].double()
            values = expected_v[slots[r], h // (H // KV), :C].double()
            scores = keys @ q[r, h].double() / D**0.5
            p = torch.softmax(scores.masked_fill(~mask[r], float("-inf")), dim=0)
            # bf16 products exact in float32: a score errs by gamma_{D+1} |q| |k| / sqrt(D), and by u |s - max s|
            # once shifted; each weight p_c then by 2 max|ds| relative, its exp (~2 ulp) and the sums of C
            # (gamma_{2C+10}); the output rounds to bf16
            visible = mask[r, :C]
            score_err = gamma(D + 1) * float((keys.abs() @ q[r, h].double().abs())[visible].max()) / D**0.5 \
                + 2 * unit_roundoff() * float(scores[visible].abs().max())
            u16 = unit_roundoff(torch.bfloat16)
            rounding = u16 / (1 - u16) * got[r, h].double().abs()
            bound = (2 * score_err + gamma(2 * C + 10)) * (p @ values.abs()) + rounding
            assert_within(got[r, h], p @ values, bound)
    for r in range(R):  # each row alone (the others already written) computes the same bits
        alone = cpu_kernels.row_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], *stores, slots[r : r + 1],
                                          write_rows[r : r + 1], mask[r : r + 1])
        assert torch.equal(alone, got[r : r + 1])
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.row_attention(q[:1], k[:1], v[:1], *stores, torch.tensor([3]), write_rows[:1], mask[:1])


@needs_kernels
def test_row_attention_over_keys_with_gaps_equals_the_same_keys_side_by_side():
    """A tree row sees its ancestors among other branches' rows (masked gaps); after the commit the AR step sees the
    same keys side by side. Its attention must be the same bits either way (else a tree verify's row differs from its
    AR step and greedy speculation with trees drifts from AR): the keys count in the order they come, not by the
    slot each sits in. A float32 difference shows in the bf16 output only now and then: many query rows."""
    g = torch.Generator().manual_seed(11)
    KV, cap, D, H, R = 3, 256, 64, 9, 1000
    visible, tree_rows, path = 150, 6, [0, 2, 3, 5]  # committed keys, a tree's rows, this row's ancestors
    k_rows = torch.randn(visible + tree_rows, KV, D, generator=g).bfloat16()
    v_rows = torch.randn(visible + tree_rows, KV, D, generator=g).bfloat16()
    q = (0.5 * torch.randn(R, H, D, generator=g)).bfloat16()
    kept = list(range(visible)) + [visible + i for i in path]
    outs = []
    for rows, seen in ((list(range(visible + tree_rows)), kept), (kept, list(range(len(kept))))):
        k_store, v_store = torch.zeros(1, KV, cap, D).bfloat16(), torch.zeros(1, KV, cap, D).bfloat16()
        k_store[0, :, : len(rows)] = k_rows[rows].transpose(0, 1)
        v_store[0, :, : len(rows)] = v_rows[rows].transpose(0, 1)
        mask = torch.zeros(R, cap, dtype=torch.bool)
        mask[:, seen] = True
        last = seen[-1]  # every row rewrites the row's own key where it already is
        outs.append(cpu_kernels.row_attention(q, k_store[0, :, last][None].expand(R, -1, -1),
                                              v_store[0, :, last][None].expand(R, -1, -1), k_store, v_store,
                                              torch.zeros(R, dtype=torch.long), torch.full((R,), last), mask))
    differing = int((outs[0] != outs[1]).flatten(1).any(dim=1).sum())
    assert differing == 0, f"{differing} of {R} rows differ"


@needs_kernels
@pytest.mark.parametrize("shape", [(48, 96), (960, 576), (576, 1536)])
def test_bf16_blocks_are_the_float32_sum_of_bf16_products(shape):
    """A float matrix of the fast precision (BF16 blocks): bf16 activations times bf16 weights, each product exact in
    float32, summed in float32: within gamma_K * sum |x w| of the float64 product (isa_checks.bf16_within_bound)."""
    g = torch.Generator().manual_seed(shape[0])
    weight = torch.randn(*shape, generator=g)
    blocks = bf16_blocks(weight)
    assert blocks.qtype == Q.BF16 and blocks.data.shape == (shape[0], shape[1] * 2)
    x = torch.randn(13, shape[1], generator=g)  # float32 in: rounded to bf16 first
    got = BlockWeight.of([blocks])(x, out_dtype=torch.float32)
    bf16_within_bound((x.bfloat16(),), got, weight.bfloat16().float())
    assert torch.equal(got, BlockWeight.of([blocks])(x.bfloat16(), out_dtype=torch.float32))


def test_the_kernels_name_their_instruction_sets():
    isa = cpu_kernels.kernel_isa()
    if not cpu_kernels.available():
        assert isa.startswith("unavailable")
        return
    flags = cpu_kernels._cpu_flags().split()
    assert ("blocks avx512-vnni" if "avx512_vnni" in flags else "blocks avx2") in isa
    assert ("bf16 avx512-bf16" if "avx512_bf16" in flags else "bf16 avx512f" if "avx512f" in flags
            else "bf16 avx2") in isa
