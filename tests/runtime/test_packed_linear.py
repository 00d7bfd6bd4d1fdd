"""oneDNN pre-packed projections (runtime/models/linear.py): the same numbers as F.linear / HF, on every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.decode import prefill, verify_tree
from dspark_grpc.runtime.models.linear import (
    MIN_ROWS,
    FusedProjection,
    Linear,
    linear,
    matmul_kind,
    pack_linears,
    pack_weight,
)
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import hf_logits, random_tokens
from tolerance import assert_within, gamma, linear_error_bound, logits_tolerance, matmul_error_bound, unit_roundoff
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.skipif(pack_weight(torch.zeros(2, 2)) is None, reason="oneDNN packing not available")


@pytest.mark.parametrize("rows", [1, 2, MIN_ROWS, 5, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(40, 24, generator=g), torch.randn(rows, 24, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    got = linear(x, weight, bias, pack_weight(weight))
    assert got.shape == (rows, 40)
    exact = x.double().matmul(weight.double().T).add(0 if bias is None else bias.double())
    assert_within(got, exact, linear_error_bound(x, weight, bias))
    # leading dimensions are kept
    x3 = torch.randn(2, rows, 24, generator=g)
    assert_within(linear(x3, weight, bias, pack_weight(weight)), F.linear(x3, weight, bias),
                  2 * linear_error_bound(x3, weight, bias))


def test_packed_bfloat16():
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(3, 32, generator=g).bfloat16()
    got = linear(x, weight, packed=pack_weight(weight))
    assert got.dtype == torch.bfloat16
    # bf16 x bf16 products are exact in float32: each side sums them in float32 (gamma_32 |x||w|), then the packed
    # side rounds its sum to bf16 (u / (1 - u) of the rounded value)
    u = unit_roundoff(torch.bfloat16)
    bound = 2 * matmul_error_bound(x, weight.T) + u / (1 - u) * got.double().abs()
    assert_within(got, x.float() @ weight.float().T, bound)


def test_fused_projection_equals_each_layer():
    torch.manual_seed(0)
    layers = [Linear(16, 12, bias=True), Linear(16, 4, bias=False), Linear(16, 7, bias=True)]
    for layer in layers:
        layer.requires_grad_(False)
    fused = FusedProjection.of(layers)
    assert fused is not None and fused.sizes == (12, 4, 7)
    x = torch.randn(3, 5, 16)
    for got, layer in zip(fused(x), layers, strict=True):
        assert_within(got, F.linear(x, layer.weight, layer.bias), 2 * linear_error_bound(x, layer.weight, layer.bias))


def test_trainable_layers_are_not_packed_and_keep_their_gradients():
    torch.manual_seed(0)
    layer = Linear(8, 4)
    assert pack_linears(layer) == 0 and layer.packed is None
    assert FusedProjection.of([layer]) is None
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    # a packed copy is only used without autograd
    frozen = Linear(8, 4).requires_grad_(False)
    assert pack_linears(frozen) == 1
    y = torch.randn(2, 8, requires_grad=True)
    frozen(y).sum().backward()
    torch.testing.assert_close(y.grad, frozen.weight.sum(0).expand(2, 8), rtol=0,
                               atol=2 * gamma(4) * float(frozen.weight.abs().sum(0).max()))  # sums of 4 rows


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "llama_yarn"])
def test_packed_model_matches_hf(name, tiny_hf_models):
    """Prefill and a branching tree verify through the packed model against HF on each root-to-node path."""
    path = tiny_hf_models[name]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = Transformer.from_checkpoint(load_checkpoint(path, progress=False))
    assert matmul_kind(model) == "aten"  # cost tables of packed and unpacked models are kept apart by this
    model.pack()
    assert matmul_kind(model) == "onednn-packed"
    assert all(layer.attention.qkv is not None and layer.feed_forward.gate_up is not None for layer in model.layers)
    assert model.output is not None or model.packed_lm_head is not None
    prompt, tree, parents = random_tokens(9, seed=1), random_tokens(5, seed=2), [-1, 0, 0, 1, 3]
    cache = model.new_cache()
    last, _ = prefill(model, cache, prompt)
    torch.testing.assert_close(last, hf_logits(hf, prompt)[0][-1], rtol=0, atol=logits_tolerance(model, len(prompt)))
    logits, _ = verify_tree(model, cache, tree, parents)
    atol = logits_tolerance(model, len(prompt) + len(tree))
    for node in range(len(tree)):
        chain = [node]
        while parents[chain[-1]] >= 0:
            chain.append(parents[chain[-1]])
        expected = hf_logits(hf, prompt + [tree[i] for i in reversed(chain)])[0][-1]
        torch.testing.assert_close(logits[node], expected, rtol=0, atol=atol)
