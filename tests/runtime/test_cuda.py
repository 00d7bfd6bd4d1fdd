"""On a CUDA device (skipped without one; `make gpu-check` runs them): the forwards match the CPU's, a verify row
equals its 1-row AR step, the engines run end to end, and the fused Triton chain equals the torch path.

`make gpu-check` ran them on an H200 (docs/bench/gpu-check.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from drafter.helpers import block_tolerances
from dspark_grpc.runtime.drafting.markov import choose_kernel, draft_chain
from dspark_grpc.runtime.formats.checkpoint import Checkpoint, inference_model
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.runtime.models.decode import commit_path, prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from heads.reference import chain_tolerances
from test_device import LLAMA, QWEN35
from tolerance import logits_tolerance

pytestmark = pytest.mark.cuda
DEVICE = "cuda"
PROMPT = [5, 9, 2, 33, 17, 8, 41, 3]
CHAIN = [12, 7, 50, 1, 22, 9]
TREE = ([30, 12, 7, 50, 6, 22], [-1, 0, 1, 0, 3, 2])
# the embedded target's shapes (SmolLM2-135M) with random weights: cuBLAS picks its kernels by shape, so the
# invariance is asked at the served shapes too, not only at the tiny ones
SMOLLM2_SHAPED = dataclasses.replace(LLAMA, name="smollm2-shaped", vocab_size=49152, hidden_size=576,
                                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                     rope_theta=100000.0)


def random_checkpoint(config, seed: int = 0) -> Checkpoint:
    """Every tensor random (normal * 0.2; norms around 1, the recurrent decay A negative)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in Transformer(config).state_dict().items():
        x = 0.2 * torch.randn(t.shape, generator=g)
        if "norm" in name:
            x = x + 1.0
        elif name.endswith("linear_attention.A"):
            x = -torch.rand(t.shape, generator=g) - 0.5
        state[name] = x
    return Checkpoint(config, state)


def run_steps(model: Transformer) -> list[torch.Tensor]:
    """Logits of a prompt's last row, a tree verify and an AR step after a compacting commit, as the host sees them."""
    cache = model.new_cache()
    last, _ = prefill(model, cache, PROMPT)
    tree, _ = verify_tree(model, cache, *TREE)
    commit_path(cache, [0, 3, 4])
    step, _ = verify_tree(model, cache, [8], [-1])
    return [t.float().cpu() for t in (last, tree, step)]


@pytest.mark.parametrize("config", [LLAMA, QWEN35], ids=["llama", "qwen35"])
def test_exact_forwards_match_the_cpu(config):
    ckpt = random_checkpoint(config)
    model = inference_model(ckpt, "exact")
    cpu, gpu = run_steps(model), run_steps(inference_model(ckpt, "exact", device=DEVICE))
    atol = logits_tolerance(model, len(PROMPT) + len(TREE[0]))  # float32 both (no TF32): tests/tolerance.py
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(b, a, atol=atol, rtol=0)


@pytest.mark.parametrize("config", [LLAMA, SMOLLM2_SHAPED], ids=["tiny", "smollm2-shaped"])
def test_fast_precision_verify_rows_equal_ar_steps(config):
    """The losslessness rule on the device: each row of a chain verify equals its own 1-row AR step bitwise (bf16,
    the batch-invariant attention, the row-wise ops in fixed-size chunks: runtime/models/fixed_rows.py)."""
    model = inference_model(random_checkpoint(config), "fast", device=DEVICE)
    ar, cache = [], model.new_cache()
    prefill(model, cache, PROMPT)
    for token in CHAIN:
        logits, _ = verify_tree(model, cache, [token], [-1])
        commit_path(cache, [0])
        ar.append(logits[0])
    cache = model.new_cache()
    prefill(model, cache, PROMPT)
    chain, _ = verify_tree(model, cache, CHAIN, list(range(-1, len(CHAIN) - 1)))
    assert torch.equal(chain, torch.stack(ar))


def test_fast_precision_rows_of_a_batch_equal_their_own_steps():
    """Concurrency on the device: sessions' AR rows and a verify side by side in one forward give each session what
    its own forward gives, bitwise (AR at C=16 and speculation at C=1 then produce the same tokens)."""
    model = inference_model(random_checkpoint(SMOLLM2_SHAPED), "fast", device=DEVICE)
    prompts = [PROMPT, PROMPT[:5], [7, 7, 1, 2] * 20]
    steps = [([8], [-1]), ([3], [-1]), (CHAIN, list(range(-1, len(CHAIN) - 1)))]
    alone, caches = [], []
    for prompt, (tokens, parents) in zip(prompts, steps, strict=True):
        cache = model.new_cache()
        prefill(model, cache, prompt)
        alone.append(verify_tree(model, cache, tokens, parents)[0])
        cache = model.new_cache()
        prefill(model, cache, prompt)
        caches.append(cache)
    outs = model.forward_batch([tree_input(c, *step) for c, step in zip(caches, steps, strict=True)])
    for out, expected in zip(outs, alone, strict=True):
        assert torch.equal(out.logits, expected)


def test_drafter_forward_matches_the_cpu():
    target = LLAMA
    cpu = init_random_drafter(target, num_layers=1, block_size=4, target_layer_ids=(0, 1), seed=3).eval()
    gpu = init_random_drafter(target, num_layers=1, block_size=4, target_layer_ids=(0, 1), seed=3).to(DEVICE).eval()
    features = torch.randn(9, 2, target.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    outs = []
    for drafter in (cpu, gpu):
        ctx = drafter.new_context()
        ctx.append(features, 0)
        outs.append(drafter.forward_block(ctx, 7))
    atol = block_tolerances(cpu, 9, outs[0])
    for name in ("base_logits", "hidden_pre_norm", "hidden_post_norm"):
        torch.testing.assert_close(getattr(outs[1], name).cpu(), getattr(outs[0], name), atol=atol[name], rtol=0)


def test_fused_kernel_equals_the_torch_path():
    from dspark_grpc.runtime.kernels import markov_triton

    if markov_triton._INTERPRET:
        pytest.skip("triton is interpreted here (TRITON_INTERPRET=1): run with TRITON_INTERPRET=0, as make gpu-check "
                    "does")
    target = LLAMA
    drafter = init_random_drafter(target, num_layers=1, block_size=8, target_layer_ids=(0, 1), markov_rank=16,
                                  seed=5).to(DEVICE).eval().requires_grad_(False)
    assert choose_kernel("auto", drafter.markov.kind, 0.0, drafter.device) == "fused"
    g = torch.Generator().manual_seed(1)
    for anchor in range(10):
        ctx = drafter.new_context()
        ctx.append(torch.randn(5 + anchor, 2, target.hidden_size, generator=g), 0)
        out = drafter.forward_block(ctx, anchor)
        chains = [draft_chain(out.base_logits, out.hidden_pre_norm, out.hidden_post_norm, anchor, drafter.markov,
                              drafter.confidence, drafter.d2t, kernel=kernel) for kernel in ("torch", "fused")]
        assert chains[1].tokens == chains[0].tokens
        logprob, confidence = chain_tolerances(out.base_logits, drafter.markov, drafter.confidence, out.hidden_pre_norm,
                                               out.hidden_post_norm, sides=2)
        torch.testing.assert_close(chains[1].logprobs, chains[0].logprobs, atol=logprob, rtol=0)
        torch.testing.assert_close(chains[1].confidences, chains[0].confidences, atol=confidence, rtol=0)


@pytest.fixture(scope="module")
def engines(smollm2_path):
    """The embedded model's target engine (fast precision: bf16 on torch's matmuls off the CPU) and its shipped
    drafter's engine, both on the device."""
    from dspark_grpc.draft_service.engine import DraftEngine
    from dspark_grpc.target_service.engine import EngineLimits, TargetEngine

    target = TargetEngine.load(smollm2_path, precision="fast", limits=EngineLimits(adaptive_threads=False),
                               progress=False, device=DEVICE)
    drafter = DraftEngine.load("embedded", smollm2_path, progress=False, precision="fast", device=DEVICE)
    yield target, drafter
    target.close()
    drafter.close()


def test_target_engine_speculation_equals_ar(engines):
    """Greedy AR through the engine, then its continuation verified as one chain: all of it accepted, the same next
    token; captures reach the host in bf16; a sampled prefill runs its generator beside the device's logits."""
    from dspark_grpc.runtime.drafting.sampling import SamplingParams

    target, _ = engines
    assert target.model.device.type == torch.device(DEVICE).type
    prompt = "The capital of France is"
    layers = [2, 29]
    ar = target.open_session(capture_layers=layers)
    first = target.prefill(ar, prompt)
    assert first.captures.device.type == "cpu" and first.captures.dtype == torch.bfloat16
    tokens = [first.next_token]
    for _ in range(8):
        tokens.append(target.verify(ar, [tokens[-1]], [-1], commit=True).next_token)
    spec = target.open_session(capture_layers=layers)
    target.prefill(spec, prompt)
    out = target.verify(spec, tokens[:8], list(range(-1, 7)), commit=True)
    assert out.path == list(range(8)) and out.next_token == tokens[8]
    assert out.committed.captures.shape == (8, 2, target.model.config.hidden_size)
    sampled = target.open_session()
    target.prefill(sampled, prompt, SamplingParams(temperature=0.8, seed=1))


def test_draft_engine_proposes_on_the_device(engines):
    target, drafter = engines
    layers = list(drafter.config.target_layer_ids)
    t = target.open_session(capture_layers=layers)
    first = target.prefill(t, "def fibonacci(n):")
    d = drafter.open_session(target.fingerprint)
    drafter.append(d, 0, first.prompt_tokens, layers, first.captures)
    n = len(first.prompt_tokens)
    chains = [drafter.propose(d, first.next_token, n, kernel=kernel) for kernel in ("torch", "fused")]
    assert chains[0].tokens == chains[1].tokens and len(chains[0].tokens) == drafter.config.num_drafts + 1
    tree = drafter.propose(d, first.next_token, n, tree=True, budget=16)
    assert len(tree.tokens) == 17
