"""The drafter's fast precision: its projections and head as Q8_0 blocks on runtime/kernels/gguf_matmul.cpp
(`Drafter.pack(quantize=True)`, `dspark-draft serve --precision fast`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dspark_grpc.draft_service.engine import DraftEngine
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import quantize_q8_0
from dspark_grpc.runtime.models.linear import Linear, matmul_kind, quantize_linears
from tolerance import assert_within, q8_block_matmul_error_bound, unit_roundoff

from .helpers import random_features
from .test_drafter_forward import TARGET

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def test_q8_0_blocks_hold_each_weight_at_its_blocks_scale():
    """Q8_0 as llama.cpp defines it, decoded here from the bytes: per block of 32, d = max |w| / 127 (float16),
    q = round(w / d) in int8 (d unrounded); so the largest weight of a block is +-127 and every weight is within d / 2
    of q * d, plus up to 127 times float16's rounding of d (2^-11 of it)."""
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    blocks = quantize_q8_0(w)
    assert blocks.shape == (24, 96) and blocks.data.shape == (24, 3 * 34)
    raw = blocks.data.numpy().reshape(24, 3, 34)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    q = raw[..., 2:].copy().view(np.int8).astype(np.float64)
    w_blocks = w.double().numpy().reshape(24, 3, 32)
    u, u16 = unit_roundoff(), unit_roundoff(torch.float16)
    np.testing.assert_allclose(d, np.abs(w_blocks).max(-1) / 127, rtol=(1 + u) * (1 + u16) - 1)  # float32, then fp16
    assert (np.abs(q).max(-1) == 127).all()
    # w / d in float32 (2 roundings of a quotient <= 127 move a code's half-way point by 254 u), d unrounded
    assert (np.abs(q * d[..., None] - w_blocks) <= (0.5 + 127 * u16 + 254 * u) / (1 - u16) * d[..., None]).all()


def test_only_frozen_linears_with_whole_blocks_are_quantized():
    frozen, trainable, odd = Linear(64, 16, bias=False), Linear(64, 16, bias=False), Linear(40, 16, bias=False)
    frozen.requires_grad_(False)
    odd.requires_grad_(False)
    model = torch.nn.ModuleList([frozen, trainable, odd])
    expected = 1 if cpu_kernels.available() else 0  # without the kernels nothing changes
    assert quantize_linears(model) == expected
    assert (frozen.blocks is not None) == bool(expected) and trainable.blocks is None and odd.blocks is None


@needs_kernels
def test_quantized_drafter_is_close_to_the_float_drafter_and_batch_invariant():
    drafter = init_random_drafter(TARGET, num_layers=2, block_size=4, target_layer_ids=(0, 3), seed=3)
    drafter = drafter.eval().requires_grad_(False)
    contexts = []
    for seed, n in enumerate((6, 11)):
        ctx = drafter.new_context()
        ctx.append(random_features(drafter.config, n, seed=seed), 0)
        contexts.append(ctx)
    exact = [drafter.forward_block(ctx, 17).base_logits for ctx in contexts]
    drafter.pack(quantize=True)
    assert matmul_kind(drafter) == "gguf-blocks"
    assert drafter.fc.blocks is not None and drafter.lm_head.blocks is not None
    # each quantized projection computes its float weight's product within Q8_0's bound (a whole drafter of ~10 int8
    # matmuls in a row has no useful bound: tests/tolerance.py), whatever the input's scale
    g = torch.Generator().manual_seed(5)
    quantized = [m for m in drafter.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert len(quantized) >= 2 * 7 + 2  # fc, each layer's 7 projections, the head
    for module in quantized:
        assert module.bias is None
        x = torch.randn(3, module.in_features, generator=g) * float(torch.rand((), generator=g) * 4)
        assert_within(module(x), x @ module.weight.T, q8_block_matmul_error_bound(x, module.weight))
    alone = [drafter.forward_block(ctx, 17).base_logits for ctx in contexts]
    for a, e in zip(alone, exact, strict=True):
        assert torch.isfinite(a).all() and not torch.equal(a, e)  # int8 weights and activations: not the float bits
    batched = drafter.forward_blocks([(ctx, 17) for ctx in contexts])
    for b, a in zip(batched, alone, strict=True):  # each row computed alone whatever the batch
        assert torch.equal(b.base_logits, a)


@needs_kernels
def test_the_engine_loads_a_drafter_in_either_precision():
    fast = DraftEngine.load("random", seed=0, progress=False, precision="fast")
    assert matmul_kind(fast.drafter) == "gguf-blocks"
    exact = DraftEngine.load("random", seed=0, progress=False, precision="exact")
    assert matmul_kind(exact.drafter) == "onednn-packed"
    with pytest.raises(ValueError, match="precision"):
        DraftEngine.load("random", seed=0, progress=False, precision="int3")
