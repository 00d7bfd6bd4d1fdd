"""The compiled step (runtime/kernels/compiled_step.py) is lossless by batch invariance, like the eager fast path: a row
of a verify (the wider graph, any key length C, a tree, batched with another session) equals its 1-row AR step
(the AR graph) bitwise; and it computes the same model as the eager fast path (to bf16 rounding)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import gguf
import pytest
import torch
from block_quants import random_blocks
from dspark_grpc.bench import engine_bench
from dspark_grpc.bench.engine_bench import ar_steps
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels.compiled_step import CompiledStep, artifact_key, load_step, save_step, vector_isa
from dspark_grpc.runtime.kernels.quant import BLOCK_TYPES, dequantize_rows, int4_available
from dspark_grpc.runtime.models.decode import prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.slot_cache import SlotCache
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import random_tokens
from test_batch_invariance import TREE_AR_STEPS, assert_verifies_equal_ar_steps, quantized, tree_of
from torch._inductor import cpu_vec_isa

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch has no CPU int4 matmul")
Q = gguf.GGMLQuantizationType


def one_layer_fast_model(directory) -> Transformer:
    """The tiny random checkpoint cut to its first layer, every projection quantized by the gguf package, loaded as
    the fast path (compiling costs per layer; one layer has every op the graph has). V is Q8_0 and the rest Q4_0, as
    llama.cpp's mixed files keep some matrices at more bits: q/k/v stay three projections (the gate/up pair is
    fused), and the graph runs both kinds. A tied embedding is Q8_0 blocks, as SmolLM2's and Gemma 3's files keep
    it: the graph looks its rows up in the head's weight (which multiplies them)."""
    ckpt = load_checkpoint(directory, progress=False)
    ckpt.config = dataclasses.replace(ckpt.config, num_layers=1)
    ckpt.weights = {k: v for k, v in ckpt.weights.items() if not k.startswith("layers.") or k.startswith("layers.0.")}
    for name, w in list(ckpt.weights.items()):
        if w.ndim == 2 and (name != "tok_embeddings.weight" or ckpt.config.tie_word_embeddings):
            ckpt.blocks[name] = quantized(w, Q.Q8_0 if name.startswith("tok_") or ".wv." in name else Q.Q4_0)
            ckpt.weights[name] = torch.empty(w.shape, device="meta")
    ckpt.head_blocks = ckpt.blocks.get("tok_embeddings.weight")
    return inference_model(ckpt, "fast")


@pytest.fixture(scope="module")
def models(tiny_hf_models, tmp_path_factory):
    """qwen3: q/k norms, a tied head. The eager fast model, and the same compiled (and saved in a cache dir)."""
    eager = one_layer_fast_model(tiny_hf_models["qwen3"])
    compiled = one_layer_fast_model(tiny_hf_models["qwen3"])
    assert compiled.layers[0].attention.qkv is None and compiled.layers[0].feed_forward.gate_up is not None
    compiled.compiled = CompiledStep(compiled, tmp_path_factory.mktemp("compiled"))
    compiled.compiled.warm_up(progress=False)
    return eager, compiled


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_compiled_lookup_of_block_rows_is_the_eager_lookup(qtype):
    """The embedding lookup on blocks (runtime/kernels/quant.py's gather and decode, traced into the step graph) of
    every type the fast precision keeps, compiled as the step is (dynamic row count): eager's rows bit for bit. A
    graph per type (one graph of all eight is one C++ file that takes its compiler twice as long)."""
    table = random_blocks((40, 256), qtype, seed=int(qtype))

    def lookup(tokens: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(table, tokens).bfloat16()

    with torch._dynamo.config.patch(recompile_limit=len(BLOCK_TYPES) + 1):  # one code object, a table per type
        compiled = torch.compile(lookup, fullgraph=True, dynamic=True)
        for tokens in (torch.tensor([3, 39, 0, 3, 17]), torch.tensor([21, 21]), torch.tensor([5, 6, 0])):
            assert torch.equal(compiled(tokens), lookup(tokens))


def test_compiled_rows_equal_ar_steps(models):
    _, model = models
    prompt = random_tokens(200, seed=3)

    def fresh_cache():
        cache = model.new_cache()
        assert isinstance(cache, SlotCache)
        prefill(model, cache, prompt)
        return cache

    tokens, ar = assert_verifies_equal_ar_steps(model, prompt, fresh_cache)  # AR steps: keys C = 256
    tree, parents = tree_of(model, tokens)
    # batched with a longer session: the step's keys are C = 320 rows, the AR step's 256
    other = model.new_cache()
    prefill(model, other, random_tokens(300, seed=4))
    outs = model.forward_batch([tree_input(other, tokens[5:9], [-1, 0, 1, 1]),
                                tree_input(fresh_cache(), tree, parents)])
    for node, step in TREE_AR_STEPS:
        assert torch.equal(outs[1].logits[node], ar[step]), ("batched", node)


def test_compiled_step_computes_the_eager_fast_model(models):
    eager, compiled = models
    prompt = random_tokens(60, seed=5)
    tokens, _ = ar_steps(eager, prompt, 6)
    got = []
    for model in (eager, compiled):
        cache = model.new_cache()
        prefill(model, cache, prompt)
        logits, captures = verify_tree(model, cache, tokens[:6], list(range(-1, 5)), capture_layers=(0,))
        got.append((logits, captures))
    # attention in float32 here, bf16 SDPA there: differences of bf16 rounding, which flip codes of the int8
    # activations of runtime/kernels/gguf_matmul.cpp (a step of 1/127 of a block's largest value; with torch's int4
    # kernel and bf16 activations the largest difference here is ~1 % of the largest logit, with int8 activations ~6 %)
    for got_t, eager_t in ((got[1][0], got[0][0]), (got[1][1].float(), got[0][1].float())):
        torch.testing.assert_close(got_t, eager_t, atol=0.1 * eager_t.abs().max().item(), rtol=0)
    # the compiled argmax is eager's argmax or a near-tie of it (random tiny models have many)
    eager_best = got[0][0].max(-1).values
    picked = got[0][0].gather(-1, got[1][0].argmax(-1, keepdim=True))[:, 0]
    assert torch.all(picked >= eager_best - 0.1 * got[0][0].abs().max()), (picked, eager_best)
    assert (got[1][0].argmax(-1) == got[0][0].argmax(-1)).sum() >= 4


def test_the_bench_invariance_check_counts_no_differing_rows(models):
    _, model = models
    assert engine_bench.check_invariance(model, steps=16, context=40).startswith("0 of "), "verify rows differ"


def test_slots_are_reused_and_the_store_grows_keeping_rows(models):
    _, model = models
    store = model.compiled.store
    caches = [model.new_cache() for _ in range(store.slots + 1)]  # one more than there are slots: it doubles
    assert len({c.slot for c in caches}) == len(caches) and store.slots >= len(caches)
    prefill(model, caches[0], random_tokens(20, seed=6))
    before = caches[0].k[0][:, :20].clone()
    store.reserve(store.capacity + 10)
    assert torch.equal(caches[0].k[0][:, :20], before) and caches[0].capacity >= 20
    caches += [model.new_cache() for _ in range(store.slots - store.in_use)]  # every slot taken
    slots = store.slots
    freed = {caches.pop().slot, caches.pop().slot}  # collected at once: their slots are free again
    assert {model.new_cache().slot, model.new_cache().slot} == freed and store.slots == slots


def test_a_restart_loads_the_saved_step_and_computes_the_same(models, tiny_hf_models):
    _, compiled = models
    assert compiled.compiled.source == "compiled" and compiled.compiled.saved
    restarted = one_layer_fast_model(tiny_hf_models["qwen3"])  # the same model, built again
    restarted.compiled = CompiledStep(restarted, compiled.compiled.cache_dir)
    restarted.compiled.warm_up(progress=False)
    assert restarted.compiled.source == "loaded"
    prompt = random_tokens(100, seed=7)
    runs = [ar_steps(model, prompt, 6) for model in (compiled, restarted)]
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    tree, parents = tree_of(compiled, runs[0][0])
    verified = []
    for model in (compiled, restarted):
        cache = model.new_cache()
        prefill(model, cache, prompt)
        verified.append(verify_tree(model, cache, tree, parents)[0])
    assert torch.equal(verified[0], verified[1])


def test_a_saved_step_is_used_only_by_the_model_it_was_traced_for(models, tiny_hf_models, tmp_path):
    _, compiled = models
    assert artifact_key(one_layer_fast_model(tiny_hf_models["qwen3"])) == artifact_key(compiled)
    assert artifact_key(one_layer_fast_model(tiny_hf_models["qwen2"])) != artifact_key(compiled)  # q/k bias, no norms
    assert artifact_key(compiled, "max") != artifact_key(compiled, "fast")  # another wrapper: another artifact
    other = one_layer_fast_model(tiny_hf_models["qwen3"])  # the embedding's blocks of another type: another decoder
    other.tok_embeddings.blocks = quantized(torch.randn(other.tok_embeddings.blocks.shape), Q.Q4_0)
    assert artifact_key(other) != artifact_key(compiled)
    # a graph compiled while inductor found no vector instruction set (scalar kernels) is another artifact
    vector_isa.cache_clear()
    with mock.patch("torch._inductor.cpu_vec_isa.pick_vec_isa", lambda: cpu_vec_isa.invalid_vec_isa):
        scalar_key = artifact_key(compiled)
    vector_isa.cache_clear()
    assert scalar_key != artifact_key(compiled)
    assert CompiledStep(compiled, tmp_path, "max").path != compiled.compiled.path
    garbage = tmp_path / "step.bin"
    garbage.write_bytes(b"not a compiled step")
    assert load_step(garbage) is None and load_step(tmp_path / "missing.bin") is None  # compiled again, no failure


def test_a_cache_dir_that_cannot_be_written_costs_only_the_save(tmp_path, capsys):
    class Step:  # what save_step uses of aot_compile's result; the compiled case is the fixture's
        def save_compiled_function(self, path: str) -> None:
            Path(path).write_bytes(b"step")

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # mkdir of blocked/compiled fails: a file is in the way
    assert not save_step(Step(), blocked / "compiled" / "step.bin")
    assert "could not save the step graph" in capsys.readouterr().err
    assert save_step(Step(), tmp_path / "compiled" / "step.bin") and (tmp_path / "compiled" / "step.bin").exists()


def test_the_compiled_step_gives_the_same_rows_on_one_thread(models):
    """Its kernels take the caller's thread count at run time (the target's thread governor changes it between
    forwards): a prompt chunk, a 1-row step and a tree verify on one thread equal the same on two, bitwise."""
    from dspark_grpc.serving.threads import same_outputs_on_one_thread

    before = torch.get_num_threads()
    assert same_outputs_on_one_thread(models[1], 2)
    assert torch.get_num_threads() == before
