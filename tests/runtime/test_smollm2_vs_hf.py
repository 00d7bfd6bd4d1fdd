"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against HF transformers loading the same file, fp32."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.config import config_from_hf
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import forward_all, greedy_decode, hf_logits
from tolerance import hidden_tolerance, logits_tolerance

pytestmark = pytest.mark.slow

# Tolerances: tests/tolerance.py's bound for the model's sizes (30 layers: ~140,000 chained roundings), ~0.31 on
# logits that reach |50| (ours and HF differ by ~1e-4; a transposed matrix in one layer moves them by ~20).
STEPS = 64
PROMPTS = {
    "capital": [504, 3575, 282, 4649, 314],  # "The capital of France is"
    # ChatML "Write a Python function that returns the n-th Fibonacci number."
    "chat_fibonacci": [1, 4093, 198, 19161, 253, 5905, 1517, 338, 6765, 260, 304, 29, 373, 24681, 46477]
    + [1230, 30, 2, 198, 1, 520, 9531, 198],
    "code": [1604, 613, 5381, 401, 24, 2110, 727, 198],  # "def quicksort(arr):\n"
    "story": [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],  # "Once upon a time, in a small village,"
    # "1, 2, 3, 5, 8, 13,"
    "numbers": [33, 28, 216, 34, 28, 216, 35, 28, 216, 37, 28, 216, 40, 28, 216, 33, 35, 28],
}


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return Transformer.from_checkpoint(load_checkpoint(smollm2_path, progress=False))


def test_config_fingerprint_matches_hf_config(smollm2, hf_smollm2):
    hf_config = config_from_hf({**hf_smollm2.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    assert hf_config.fingerprint() == smollm2.config.fingerprint()
    assert smollm2.config.tie_word_embeddings and smollm2.output is None
    assert (smollm2.config.num_layers, smollm2.config.num_kv_heads, smollm2.config.rope_theta) == (30, 3, 1e5)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_64_tokens_match_hf(smollm2, hf_smollm2, name):
    prompt = PROMPTS[name]
    tokens, step_logits = greedy_decode(smollm2, prompt, STEPS)
    # HF teacher-forced on our sequence: each of our tokens must be HF's argmax given the same prefix.
    expected, _ = hf_logits(hf_smollm2, prompt + tokens[:-1])
    expected = expected[len(prompt) - 1 :]
    assert tokens == expected.argmax(-1).tolist()
    torch.testing.assert_close(step_logits, expected, atol=logits_tolerance(smollm2, len(prompt) + STEPS), rtol=0)


def test_known_continuation(smollm2):
    tokens, _ = greedy_decode(smollm2, PROMPTS["capital"], 3)
    assert tokens == [7042, 30, 198]  # " Paris.\n"


def test_hidden_state_captures_match_hf(smollm2, hf_smollm2):
    seq = PROMPTS["chat_fibonacci"] + PROMPTS["story"]
    layers = (0, 9, 19, 28, 29)
    _, out = hf_logits(hf_smollm2, seq, output_hidden_states=True)
    got = forward_all(smollm2, seq, capture_layers=layers).captures
    assert got.shape == (len(seq), len(layers), 576)
    for j, layer in enumerate(layers[:-1]):
        expected = out.hidden_states[layer + 1][0]
        atol = hidden_tolerance(smollm2.config, len(seq), layer + 1, expected)
        torch.testing.assert_close(got[:, j], expected, atol=atol, rtol=0)
    # HF applies the final norm to its last hidden state; our capture of the last layer is before it.
    atol = hidden_tolerance(smollm2.config, len(seq), None, out.hidden_states[30][0])
    torch.testing.assert_close(smollm2.norm(got[:, -1]), out.hidden_states[30][0], atol=atol, rtol=0)


def test_tree_verify_matches_sequential(smollm2):
    """A 12-node tree in one pass == each root-to-leaf path run on its own (fp32 tolerance)."""
    prompt = PROMPTS["capital"]
    parents = [-1, 0, 1, 2, 3, 0, 5, 6, 0, 8, 1, 6]
    tokens = [7042, 30, 198, 198, 504, 11, 253, 1165, 314, 260, 28, 3575]
    cache = smollm2.new_cache()
    prefill(smollm2, cache, prompt)
    tree_logits, _ = verify_tree(smollm2, cache, tokens, parents)
    for leaf in (4, 7, 9, 10, 11):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        seq = prompt + [tokens[i] for i in path]
        expected = forward_all(smollm2, seq).logits[len(prompt) :]
        torch.testing.assert_close(tree_logits[path], expected, atol=logits_tolerance(smollm2, len(seq)), rtol=0)
    commit_path(cache, [0, 1, 2, 3, 4])
    assert cache.length == len(prompt) + 5
