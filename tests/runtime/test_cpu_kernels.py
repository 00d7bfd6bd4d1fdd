"""The GGUF block kernel (runtime/kernels/gguf_matmul.cpp) against llama.cpp's arithmetic written out independently in
float64: int8 activations per block of 32 (scale max|x| / 127, codes rounded half to even), exact integer block
dots, scaled by d_w * d_x, plus Q4's m times the block's float sum of x."""

from __future__ import annotations

import os
import platform
import shutil

import gguf
import pytest
import torch
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import (
    BLOCK_TYPES,
    BlockWeight,
    Int4Weight,
    QuantBlocks,
    bf16_blocks,
    quantized_weight,
)
from dspark_grpc.runtime.models.linear import FusedProjection, Linear
from isa_checks import bf16_within_bound
from tolerance import assert_within, gamma, linear_error_bound, unit_roundoff

Q = gguf.GGMLQuantizationType


def test_the_kernels_build_on_an_x86_machine_with_gcc():
    """Not skipped: a build error would otherwise only show as skipped tests and a slower fallback."""
    if platform.machine() != "x86_64" or shutil.which("g++") is None or os.environ.get("DSPARK_CPU_KERNELS") == "0":
        pytest.skip("no x86 CPU or no g++: the fast precision uses torch's kernels")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def quantized(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantBlocks:
    return QuantBlocks(qtype, torch.from_numpy(gguf.quants.quantize(weight.numpy(), qtype)), tuple(weight.shape))


def llama_cpp_reference(x: torch.Tensor, blocks: QuantBlocks) -> torch.Tensor:
    """float64 y [R, out]; the weights' d, m and codes decoded with the gguf package."""
    out, inp = blocks.shape
    nb = inp // 32
    w = torch.from_numpy(gguf.quants.dequantize(blocks.data.numpy(), blocks.qtype)).reshape(out, nb, 32).double()
    raw = blocks.data.view(out, nb, -1)
    d = raw[..., 0:2].contiguous().view(torch.float16).double()[..., 0]
    if blocks.qtype == Q.Q4_1:
        m = raw[..., 2:4].contiguous().view(torch.float16).double()[..., 0]
    else:
        m = torch.zeros_like(d) if blocks.qtype == Q.Q8_0 else -8 * d
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
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
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


@needs_kernels
def test_projections_of_different_block_types_stay_unfused():
    g = torch.Generator().manual_seed(9)
    layers = []
    for qtype in (Q.Q4_1, Q.Q8_0):  # as llama.cpp's mixed files keep some matrices at 8 bits
        layer = Linear(64, 32, bias=False)
        layer.blocks = quantized(torch.randn(32, 64, generator=g) * 0.05, qtype)
        layers.append(layer)
    assert FusedProjection.of(layers) is None
    x = torch.randn(3, 64, generator=g).bfloat16()
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
