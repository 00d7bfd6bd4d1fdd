"""The fast precision is lossless by batch invariance: a row of an M-row (tree) verify computes bitwise what a
1-row AR step computes, for every kernel on the path and for the whole forward (docs/PERFORMANCE.md)."""

from __future__ import annotations

import functools

import gguf
import pytest
import torch
import torch.nn.functional as F
from block_quants import fast_block_model as fast_tiny_model
from block_quants import llama_cpp_mix, quantize_blocks, wide_tiny_models
from dspark_grpc.bench.engine_bench import ar_steps
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import (
    BLOCK_TYPES,
    INT4_TYPES,
    K_TYPES,
    BlockWeight,
    Int4Weight,
    QuantBlocks,
    bf16_blocks,
    int4_available,
)
from dspark_grpc.runtime.models.batch_invariant import attention_by_row, row_keys
from dspark_grpc.runtime.models.decode import prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.linear import Linear, rows_one_by_one
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.runtime.models.tree import ancestor_mask
from runtime_helpers import random_tokens

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul")
Q = gguf.GGMLQuantizationType
ROWS = [*range(1, 17), 40]


def quantized(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType = Q.Q4_1) -> QuantBlocks:
    return quantize_blocks(weight, qtype)  # the gguf package's quantizer; K-quants: tests/runtime/block_quants.py


def assert_rows_invariant(run, x: torch.Tensor) -> None:
    """run(x[:M]) row i == run(x[i:i+1]) bitwise for every M in ROWS."""
    ones = torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])
    for m in ROWS:
        got = run(x[:m])
        assert torch.equal(got, ones[:m]), (m, (got.float() - ones[:m].float()).abs().max().item())


QUANTIZED_KERNELS = [*((Int4Weight, q) for q in INT4_TYPES), *((BlockWeight, q) for q in BLOCK_TYPES)]


@pytest.mark.parametrize("kernel,qtype", QUANTIZED_KERNELS)
@pytest.mark.parametrize("shape", [(192, 576), (960, 576), (3072, 576), (576, 1536)])  # SmolLM2's projections
def test_quantized_matmul_rows_are_batch_invariant(kernel, qtype, shape):
    if kernel is BlockWeight and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    if qtype in K_TYPES:  # rows of whole super-blocks of 256: 768 for 576 (2 and 3 super-blocks, 6 for 1536)
        shape = (shape[0], 768 if shape[1] == 576 else shape[1])
    g = torch.Generator().manual_seed(shape[0])
    weight = kernel.of([quantized(torch.randn(*shape, generator=g) * 0.05, qtype)],
                       bias=torch.randn(shape[0], generator=g))
    assert_rows_invariant(weight, torch.randn(max(ROWS), shape[1], generator=g).bfloat16())


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")
def test_q8_head_rows_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    head = BlockWeight.of([quantized(torch.randn(8192, 576, generator=g) * 0.05, Q.Q8_0)])
    assert_rows_invariant(lambda x: head(x, out_dtype=torch.float32), torch.randn(max(ROWS), 576).bfloat16())


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize("shape", [(192, 576), (8192, 576), (576, 1536)])  # a projection, a head, a down projection
def test_bf16_block_rows_are_batch_invariant(shape):
    """The fast precision's float matrices (runtime/kernels/gguf_matmul.cpp's BF16 path; oneDNN's packed bf16 GEMM
    changed a row's bits with the row count on an AVX-512 BF16 CPU)."""
    g = torch.Generator().manual_seed(shape[0])
    weight = BlockWeight.of([bf16_blocks(torch.randn(*shape, generator=g))], bias=torch.randn(shape[0], generator=g))
    assert_rows_invariant(lambda x: weight(x, out_dtype=torch.float32),
                          torch.randn(max(ROWS), shape[1], generator=g).bfloat16())


def test_rows_one_by_one_is_batch_invariant():
    """Where the kernels do not build, a float matrix of the fast precision multiplies one row per call."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(8192, 576, generator=g).bfloat16()
    assert_rows_invariant(lambda x: rows_one_by_one(lambda row: F.linear(row, weight), x),
                          torch.randn(max(ROWS), 576, generator=g).bfloat16())


def test_row_keys_are_prefixes_or_gathered_rows():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    keys = row_keys(mask)
    assert keys[:2] == [2, 3] and keys[3] == 0
    assert torch.equal(keys[2], torch.tensor([0, 3]))


@pytest.mark.parametrize("committed", [100, 60])  # 60: rows of one tree fall in two padded lengths
def test_attention_by_row_equals_one_row_steps(committed):
    dtype = torch.bfloat16  # the fast precision's; float32 SDPA with 2 threads differs between batch sizes
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 9, 3, 64
    parents = [-1, 0, 1, 0, 3, 4, 2]  # two branches
    n = len(parents)
    k, v = (torch.randn(kv_heads, committed + n, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(heads, n, dim, generator=g).to(dtype)
    mask = torch.cat([torch.ones(n, committed, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    got = attention_by_row(q, k, v, row_keys(mask))
    for i in range(n):
        seen = mask[i].nonzero().flatten()
        # the AR step of this row sees the same rows, contiguous in a cache of another capacity
        k1, v1 = (torch.full((kv_heads, 512, dim), 7.0, dtype=dtype) for _ in range(2))
        k1[:, : len(seen)], v1[:, : len(seen)] = k[:, seen], v[:, seen]
        step = attention_by_row(q[:, i : i + 1], k1[:, : len(seen)], v1[:, : len(seen)], [len(seen)])
        assert torch.equal(got[:, i], step[:, 0]), i
        plain = F.scaled_dot_product_attention(q[None, :, i : i + 1], k[None, :, seen], v[None, :, seen],
                                               enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(got[:, i], plain, atol=1e-3, rtol=2e-2)  # and it is attention


def prefilled(model: Transformer, prompt: list[int]):
    """A new cache of the model with the prompt prefilled."""
    cache = model.new_cache()
    prefill(model, cache, prompt)
    return cache


def assert_verifies_equal_ar_steps(model: Transformer, prompt: list[int], fresh_cache=None) -> tuple[list[int],
                                                                                           list[torch.Tensor]]:
    """AR for 12 steps, then a 12-row chain verify and a tree verify (a wrong first child before the right one, the
    AR path continuing under the right one) on fresh prefilled caches (`fresh_cache()`, default `prefilled`): every
    verify row equals its AR step bitwise. Returns AR's (tokens, logits rows)."""
    fresh_cache = fresh_cache or (lambda: prefilled(model, prompt))
    tokens, ar = ar_steps(model, prompt, 12)
    chain, _ = verify_tree(model, fresh_cache(), tokens[:12], list(range(-1, 11)))
    for i in range(12):
        assert torch.equal(chain[i], ar[i]), ("chain", i)
    logits, _ = verify_tree(model, fresh_cache(), *tree_of(model, tokens))
    for node, step in TREE_AR_STEPS:
        assert torch.equal(logits[node], ar[step]), ("tree", node)
    return tokens, ar


TREE_AR_STEPS = ((0, 0), (2, 1), (3, 2), (5, 3))  # tree_of's nodes on the AR path -> AR step


def tree_of(model: Transformer, tokens: list[int]) -> tuple[list[int], list[int]]:
    wrong = (tokens[1] + 1) % model.config.vocab_size
    return [tokens[0], wrong, tokens[1], tokens[2], wrong, tokens[3]], [-1, 0, 0, 2, 3, 3]


@pytest.mark.parametrize("name,qtype", [("qwen2", Q.Q4_1), ("qwen3", Q.Q4_0), ("llama3", Q.Q4_1)])
def test_fast_forward_rows_equal_ar_steps(tiny_hf_models, name, qtype):
    model = fast_tiny_model(tiny_hf_models[name], qtype)
    prompt = random_tokens(200, seed=3)  # with ~40 rows of context CPU SDPA happens to be invariant: not a test


    tokens, ar = assert_verifies_equal_ar_steps(model, prompt)
    tree, parents = tree_of(model, tokens)
    # the same tree batched with another session's verify in one forward (continuous batching)
    other = prefilled(model, prompt)
    prefill(model, other, random_tokens(7, seed=4))
    outs = model.forward_batch([tree_input(other, tokens[5:9], [-1, 0, 1, 1]),
                                tree_input(prefilled(model, prompt), tree, parents)])
    for node, step in TREE_AR_STEPS:
        assert torch.equal(outs[1].logits[node], ar[step]), ("batched", node)


@pytest.fixture(scope="module")
def wide_tiny_hf_models(tiny_hf_models, tmp_path_factory):
    """llama3 and qwen3 of tiny_hf_models at hidden size 256: every matrix can be a K-quant."""
    return wide_tiny_models(tiny_hf_models, tmp_path_factory.mktemp("wide_tiny_hf"))


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize(("width", "name", "base"), [
    ("64", "qwen2", Q.Q4_K),  # rows of 64 and 128: all fall back (Q5_0, Q8_0), as SmolLM2's 576 do
    ("64", "llama3", Q.Q5_K),  # Q5_1, Q8_0
    ("256", "llama3", Q.Q4_K),  # Q4_K q/k/o, gate/up; Q6_K v, down and the head
    ("256", "qwen3", Q.Q5_K),  # Q5_K, Q6_K v, down and the tied head
])
def test_mixed_file_forward_rows_equal_ar_steps(tiny_hf_models, wide_tiny_hf_models, width, name, base):
    """A model as llama.cpp's Q4_K_M / Q5_K_M quantizer writes it (llama_cpp_mix), every matrix multiplied in its own
    type by runtime/kernels/gguf_matmul.cpp: its verify rows (chains, trees) equal its AR steps bitwise."""
    mix = llama_cpp_mix(base)
    model = fast_tiny_model((tiny_hf_models if width == "64" else wide_tiny_hf_models)[name], mix)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    types = {m.blocks.qtype for m in linears}
    expected = {Q.Q4_K: {Q.Q4_K, Q.Q6_K}, Q.Q5_K: {Q.Q5_K, Q.Q6_K}}[base] if width == "256" else {
        Q.Q4_K: {Q.Q5_0, Q.Q8_0}, Q.Q5_K: {Q.Q5_1, Q.Q8_0}}[base]
    assert types == expected, types
    attention = model.layers[0].attention
    assert attention.qkv is None  # q/k and v of different types stay unfused
    assert isinstance(model.layers[0].feed_forward.gate_up.quantized, BlockWeight)
    if model.output is None:  # the tied head on the embedding's blocks
        assert model.quantized_lm_head is not None and model.head_blocks.qtype == mix("output.weight", (0, int(width)))
    prompt = random_tokens(200, seed=6)


    assert_verifies_equal_ar_steps(model, prompt)


def fast_logits_error(path, prompt: list[int]) -> tuple[Transformer, list[int], list[torch.Tensor], float]:
    """The file's fast model, its 12 AR steps (tokens, logits) and their relative (Frobenius) distance from the exact
    precision's logits of the same steps (the file's weights dequantized, float32 activations)."""
    model = inference_model(load_checkpoint(path, progress=False, precision="fast"), "fast")
    tokens, ar = ar_steps(model, prompt, 12)
    exact = inference_model(load_checkpoint(path, progress=False), "exact")
    cache = exact.new_cache()
    prefill(exact, cache, prompt)
    want, _ = verify_tree(exact, cache, tokens[:12], list(range(-1, 11)))
    return model, tokens, ar, float((torch.stack(ar[:12]).float() - want).norm() / want.norm())


@pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")
@pytest.mark.parametrize(("name", "base"), [("llama3", Q.Q4_K), ("qwen3", Q.Q5_K)])
def test_k_quant_gguf_runs_each_matrix_in_its_own_type(wide_tiny_hf_models, tmp_path, name, base):
    """A file as llama.cpp writes a Q4_K_M / Q5_K_M (llama's Q/K rows permuted, the tied head as Q6_K blocks), through
    the loader: the fast precision by default, every matrix kept as its blocks, verify rows equal to AR steps, and
    the model near the exact precision of the same file. How near: the same model stored as float32 is, in the fast
    precision (bf16 activations, which these random tiny models amplify: 2-8 % of the logits' norm), err_float from
    its exact one; 8-bit activations on the blocks may add as much again, plus 5 % (measured: 4-12 %; a misread
    scale or code layout is of the logits' own size)."""
    from dspark_grpc.runtime.formats.checkpoint import auto_precision
    from test_gguf_files import write_gguf_like_llama_cpp

    arch, prompt = "llama" if name == "llama3" else name, random_tokens(200, seed=7)
    path, float_path = tmp_path / f"{name}.gguf", tmp_path / f"{name}-f32.gguf"
    write_gguf_like_llama_cpp(wide_tiny_hf_models[name], path, arch, type_of=llama_cpp_mix(base))
    write_gguf_like_llama_cpp(wide_tiny_hf_models[name], float_path, arch)
    precision, why = auto_precision(path)
    assert precision == "fast" and why.endswith(f"stored as {base.name}/Q6_K blocks"), why
    ckpt = load_checkpoint(path, progress=False, precision="fast")
    assert {b.qtype for b in ckpt.blocks.values()} == {base, Q.Q6_K}
    assert (ckpt.head_blocks is not None) == ckpt.config.tie_word_embeddings
    model, tokens, ar, err = fast_logits_error(path, prompt)
    assert model.output is not None or model.head_blocks.qtype == Q.Q6_K
    *_, err_float = fast_logits_error(float_path, prompt)
    assert err < 2 * err_float + 0.05, (err, err_float)


    assert assert_verifies_equal_ar_steps(model, prompt)[0] == tokens


@pytest.mark.parametrize("name", ["llama3", "qwen2"])  # an untied head; a tied one (the embedding's bf16 blocks)
@pytest.mark.parametrize("kernels", ["built", "off"])
def test_fast_bf16_forward_rows_equal_ar_steps(tiny_hf_models, name, kernels, monkeypatch):
    """A float checkpoint in the fast precision (bf16 matrices): its verify rows equal its AR steps bitwise, on our
    bf16 kernel, or row by row where the kernels are off; no matrix runs on oneDNN's packed GEMM."""
    if kernels == "off":
        monkeypatch.setenv("DSPARK_CPU_KERNELS", "0")
        monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))
    elif not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    model = inference_model(load_checkpoint(tiny_hf_models[name], progress=False), "fast")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and not any(m.packed is not None for m in linears) and model.packed_lm_head is None
    if kernels == "built":
        assert all(m.blocks is not None and m.blocks.qtype == Q.BF16 and m.weight.is_meta for m in linears)
        assert name != "qwen2" or model.quantized_lm_head is not None
    else:
        assert all(m.row_by_row for m in linears)
    prompt = random_tokens(200, seed=5)


    assert_verifies_equal_ar_steps(model, prompt)


@pytest.fixture(scope="module")
def fast_engine(smollm2_path):
    from dspark_grpc.target_service.engine import EngineLimits, TargetEngine

    engine = TargetEngine.load(smollm2_path, limits=EngineLimits(max_length=512), progress=False, precision="fast")
    yield engine
    engine.close()


def test_smollm2_fast_greedy_speculation_equals_ar(fast_engine):
    """Through the engine (batcher, sessions): every tree step emits AR's tokens from AR's logits, bitwise."""
    story = "The lighthouse keeper counted the ships that passed each night and wrote their names in a book. "
    prompt = [{"role": "user", "content": story * 8 + "Write a short poem about the sea."}]  # ~200 tokens
    ar_session = fast_engine.open_session()
    pending = fast_engine.prefill(ar_session, prompt).next_token
    ar, ar_logits = [pending], []
    for _ in range(20):
        step = fast_engine.verify(ar_session, [ar[-1]], [-1], commit=True, return_logits=True)
        ar_logits.append(step.logits[0])
        ar.append(step.next_token)
    assert len(set(ar)) > 5  # real text, not one repeated token

    session = fast_engine.open_session()
    assert fast_engine.prefill(session, prompt).next_token == ar[0]
    emitted, pos = [ar[0]], 0
    while pos + 3 < len(ar_logits):
        wrong = (ar[pos + 1] + 1) % fast_engine.model.config.vocab_size
        tree = [ar[pos], wrong, ar[pos + 1], ar[pos + 2], wrong]
        step = fast_engine.verify(session, tree, [-1, 0, 0, 2, 3], commit=True, return_logits=True)
        assert step.path == [0, 2, 3]
        for node, offset in ((0, 0), (2, 1), (3, 2)):
            assert torch.equal(step.logits[node], ar_logits[pos + offset]), (pos, node)
        emitted += step.committed.emitted
        pos += 3
    assert emitted == ar[: len(emitted)] and len(emitted) == 19
    for s in (ar_session, session):
        fast_engine.release(s)
