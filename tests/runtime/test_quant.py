"""GGUF Q4_0/Q4_1 blocks as torch int4 matmuls (runtime/kernels/quant.py) and the fast precision's loading."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import INT4_TYPES, Int4Weight, QuantBlocks, dequantize_blocks, int4_available
from dspark_grpc.runtime.models.linear import Linear, matmul_kind
from dspark_grpc.serving.cost_profile import target_key
from tolerance import assert_within, gamma, linear_error_bound, unit_roundoff

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul")
Q = gguf.GGMLQuantizationType


def quantized(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantBlocks:
    raw = gguf.quants.quantize(weight.numpy(), qtype)
    return QuantBlocks(qtype, torch.from_numpy(raw), tuple(weight.shape))


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_blocks_decode_like_the_gguf_package(qtype):
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    blocks = quantized(w, qtype)
    reference = gguf.quants.dequantize(blocks.data.numpy(), qtype)
    assert np.array_equal(dequantize_blocks(blocks).numpy(), reference)
    assert not np.array_equal(reference, w.numpy())  # the quantizer really rounded: the check is not vacuous


@pytest.mark.parametrize("qtype", INT4_TYPES)
def test_int4_matmul_with_float32_scales_is_the_dequantized_matmul(qtype):
    g = torch.Generator().manual_seed(1)
    parts = [quantized(torch.randn(n, 64, generator=g) * 0.1, qtype) for n in (32, 64)]
    bias = torch.randn(96, generator=g)
    weight = torch.cat([dequantize_blocks(p) for p in parts])
    x = torch.randn(5, 64, generator=g)
    expected = x.double() @ weight.double().T + bias.double()
    exact = Int4Weight.of(parts, torch.float32, bias)  # fp32 scales: the weights bit for bit (scalar kernel)
    assert_within(exact(x), expected, linear_error_bound(x, weight, bias))
    fast = Int4Weight.of(parts, torch.bfloat16, bias)  # what the fast precision runs: bf16 scales and rows
    got = fast(x.bfloat16()).double()
    assert got.shape == (5, 96)
    # bf16 rows (u |x|), a block's scale and offset in bf16 (u (8 d + |m| + 8 d) <= 4 u max|w| of its 32 weights:
    # 15 d <= 2 max|w|, |m| <= max|w|), float32 sums (gamma_65), the bias and the output rounded to bf16
    u = unit_roundoff(torch.bfloat16)
    block_max = weight.abs().view(96, 2, 32).amax(-1, keepdim=True).expand(96, 2, 32).reshape(96, 64)
    x_abs, sums = x.double().abs(), gamma(65) * (1 + u)
    bound = ((u + sums) * (x_abs @ weight.double().abs().T) + 4 * u * (1 + sums) * (x_abs @ block_max.double().T)
             + u * bias.double().abs() + u / (1 - u) * got.abs())
    assert_within(got, expected, bound)


@pytest.fixture(scope="module")
def smollm2_checkpoints(smollm2_path):
    return load_checkpoint(smollm2_path, progress=False), load_checkpoint(smollm2_path, progress=False,
                                                                         precision="fast")


def test_fast_checkpoint_keeps_the_q4_matrices_as_blocks(smollm2_checkpoints):
    exact, fast = smollm2_checkpoints
    layers = {name: b for name, b in fast.blocks.items() if name != "tok_embeddings.weight"}
    assert len(layers) == 210 and set(fast.blocks) < set(exact.weights)  # every matrix of the 30 layers
    if cpu_kernels.available():  # the Q8_0 embedding as blocks too: its rows looked up, the tied head multiplies it
        embedding = fast.blocks["tok_embeddings.weight"]
        assert fast.head_blocks is embedding and embedding.qtype == Q.Q8_0
        assert embedding.shape == tuple(exact.weights["tok_embeddings.weight"].shape)
    else:  # Q8_0 is not kept without the kernels: dequantized
        assert fast.head_blocks is None and "tok_embeddings.weight" not in fast.blocks
    for name, blocks in fast.blocks.items():
        assert fast.weights[name].is_meta and blocks.qtype == (Q.Q4_1 if name in layers else Q.Q8_0)
        # the blocks (llama's Q/K rows un-permuted like the float32 weights) decode to exact's float32 weights
        assert torch.equal(dequantize_blocks(blocks), exact.weights[name]), name
    for name in exact.weights.keys() - fast.blocks.keys():
        assert torch.equal(fast.weights[name], exact.weights[name]), name


def test_fast_model_is_keyed_apart_in_cost_tables(smollm2_checkpoints):
    exact, fast = smollm2_checkpoints
    exact_model, fast_model = inference_model(exact, "exact"), inference_model(fast, "fast")
    kind = "gguf-blocks" if cpu_kernels.available() else "int4-g32"
    assert matmul_kind(fast_model) == kind and matmul_kind(exact_model) == "onednn-packed"
    assert fast_model.dtype == torch.bfloat16 and fast_model.batch_invariant and not exact_model.batch_invariant
    int4 = [m for m in fast_model.modules() if isinstance(m, Linear) and m.blocks is not None]
    assert len(int4) == 210 and fast_model.layers[0].attention.wo.quantized is not None  # unfused: packed at load
    assert fast_model.layers[0].attention.qkv.quantized is not None
    assert fast_model.layers[0].feed_forward.gate_up.quantized is not None
    assert (fast_model.quantized_lm_head is not None) == cpu_kernels.available()
    fast_key, exact_key = target_key(fast_model), target_key(exact_model)
    assert (fast_key.matmul, fast_key.dtype) == (kind, "bfloat16") and fast_key != exact_key


def test_fast_model_looks_up_the_embeddings_rows_from_its_blocks(smollm2_checkpoints):
    """No float copy of the Q8_0 embedding is made or kept: the lookup dequantizes the rows it needs from the blocks
    the tied head is built from, and they equal the rows of the whole matrix dequantized (exact's float32) in bf16."""
    exact, fast = smollm2_checkpoints
    if not cpu_kernels.available():
        pytest.skip(f"Q8_0 is kept as blocks with the kernels only: {cpu_kernels.unavailable_reason()}")
    from dspark_grpc.runtime.kernels.compiled_step import model_tensors

    model = inference_model(fast, "fast")
    embedding = model.tok_embeddings
    assert embedding.weight.is_meta and embedding.blocks is model.head_blocks and model.quantized_lm_head is not None
    assert model.dtype == torch.bfloat16 and model.device == torch.device("cpu")
    vocab, hidden = exact.weights["tok_embeddings.weight"].shape
    assert not [t.shape for t in model_tensors(model)
                if t.is_floating_point() and not t.is_meta and t.numel() >= vocab * hidden]
    tokens = torch.tensor([0, 1, 17, 17, 4000, vocab - 1])
    expected = exact.weights["tok_embeddings.weight"][tokens].bfloat16()
    assert torch.equal(model.embed(tokens), expected)
    assert torch.equal(model.embed(tokens.view(2, 3)), expected.view(2, 3, hidden))


def test_precision_is_checked(smollm2_path):
    with pytest.raises(ValueError, match="precision must be one of exact, fast"):
        load_checkpoint(smollm2_path, progress=False, precision="int4")


@pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul")
def test_auto_precision_is_fast_for_a_quantized_gguf_only(smollm2_path, tiny_hf_models):
    from dspark_grpc.runtime.formats.checkpoint import auto_precision

    precision, why = auto_precision(smollm2_path)  # the embedded Q4_1 file: 210 Q4_1 matrices, a Q8_0 embedding
    assert precision == "fast" and "blocks" in why
    assert auto_precision(tiny_hf_models["qwen3"]) == ("exact", "not a GGUF file")


def test_auto_compile_follows_the_precision(monkeypatch, tiny_hf_models):
    from dspark_grpc.target_service.cli import _precision_and_compile

    monkeypatch.delenv("DSPARK_COMPILE", raising=False)
    assert _precision_and_compile("m.gguf", "fast", "auto", quiet=True) == ("fast", "max")
    assert _precision_and_compile("m.gguf", "exact", "auto", quiet=True) == ("exact", "off")
    assert _precision_and_compile(str(tiny_hf_models["qwen3"]), "auto", "auto", quiet=True) == ("exact", "off")
    assert _precision_and_compile("m.gguf", "fast", "fast", quiet=True) == ("fast", "fast")  # as asked
    monkeypatch.setenv("DSPARK_COMPILE", "off")
    assert _precision_and_compile("m.gguf", "fast", "auto", quiet=True) == ("fast", "off")
    monkeypatch.setenv("DSPARK_COMPILE", "fastest")
    with pytest.raises(ValueError, match="DSPARK_COMPILE must be one of off, fast, max"):
        _precision_and_compile("m.gguf", "fast", "auto", quiet=True)


def test_serve_takes_a_precision():
    from dspark_grpc.target_service.cli import parser

    assert parser().parse_args(["serve"]).precision == "auto"
    assert parser().parse_args(["serve", "--precision", "fast"]).precision == "fast"
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--precision", "int8"])
