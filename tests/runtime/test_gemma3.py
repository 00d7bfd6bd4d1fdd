"""The gemma3 target (Gemma 3: sliding-window layers between global ones, each with its own RoPE base, four norms per
block, scaled embeddings, a tied head, soft-capped logits where the config says) vs transformers' Gemma3ForCausalLM
on tiny random weights: logits, greedy decoding, chain and tree verification; and the fast precision's verify rows
equal to its AR steps. The sliding window (8) is far shorter than the sequences, so local attention matters."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels.compiled_step import can_compile
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.runtime.models.tree import path_to_root
from runtime_helpers import greedy_decode, hf_logits, random_tokens
from tolerance import logits_tolerance

VOCAB = 512
WINDOW = 8
STEPS = 24
# side branches at depths 1, 2 and 3, and a path of depth 5
PARENTS = [-1, 0, 0, 1, 1, 3, 3, 5, 6, 0, 7, 2, 9]
# name -> Gemma3TextConfig arguments beyond the common ones
VARIANTS = {
    # query_pre_attn_scalar != head_dim, global layers at 2 and 5
    "plain": dict(query_pre_attn_scalar=24,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2),
    # HF's default layout (every 6th layer global), linear RoPE scaling on the global layers, soft-capped logits
    "softcap": dict(query_pre_attn_scalar=32, final_logit_softcapping=3.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def make_gemma3(directory, variant: str, seed: int = 0, **overrides):
    """A random-weight Gemma3ForCausalLM (float32) saved to `directory`, its zero-centred norms spread around 0 and
    its embeddings small (scaled by sqrt(64) and tied to the head, large ones make greedy decoding repeat a token).
    `overrides`: Gemma3TextConfig arguments that replace the variant's (e.g. fewer layers)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    args = {"num_hidden_layers": 6, **VARIANTS[variant], **overrides}
    args.setdefault("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                              max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                              pad_token_id=0, bos_token_id=2, eos_token_id=1, **args)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif "embed" in name:
                p.normal_(0, 0.02)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = make_gemma3(tmp_path_factory.mktemp(f"gemma3_{request.param}"), request.param, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ours = Transformer.from_checkpoint(load_checkpoint(directory, progress=False))
    return request.param, hf, ours, directory


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, vocab_size=VOCAB)


def test_config_matches_hf(pair):
    name, hf, ours, _ = pair
    c, h = ours.config, hf.config
    assert c.architecture == "gemma3" and c.qk_norm and c.tie_word_embeddings and ours.output is None
    assert c.layer_types == tuple("attention" if t == "full_attention" else t for t in h.layer_types)
    assert [i for i in range(6) if not c.is_sliding(i)] == ([2, 5] if name == "plain" else [5])
    assert (c.sliding_window, c.query_pre_attn_scalar, c.rope_theta, c.rope_local_theta) == (
        WINDOW, h.query_pre_attn_scalar, 1e6, 1e4)
    assert c.final_logit_softcapping == (h.final_logit_softcapping or 0.0)
    assert (c.rope_scaling is None) == (name == "plain")


def test_prompt_logits_match_hf(pair):
    _, hf, ours, _ = pair
    ids = tokens(40, seed=0)
    expected, _ = hf_logits(hf, ids)
    got = ours(torch.tensor(ids), torch.arange(len(ids)), ours.new_cache()).logits
    atol = logits_tolerance(ours, len(ids))
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    # the window matters: without it the late rows differ far beyond the tolerance
    wide = Transformer(dataclasses.replace(ours.config, sliding_window=1000))
    wide.load_state_dict(ours.state_dict())
    unwindowed = wide(torch.tensor(ids), torch.arange(len(ids)), wide.new_cache()).logits
    assert (unwindowed[WINDOW:] - expected[WINDOW:]).abs().max() > 100 * atol
    torch.testing.assert_close(unwindowed[:WINDOW], expected[:WINDOW], atol=atol, rtol=0)


def test_greedy_decode_matches_hf(pair):
    _, hf, ours, _ = pair
    prompt = tokens(12, seed=1)
    generated, step_logits = greedy_decode(ours, prompt, STEPS)
    expected, _ = hf_logits(hf, prompt + generated[:-1])  # teacher-forced over our sequence
    atol = logits_tolerance(ours, len(prompt) + STEPS)
    torch.testing.assert_close(step_logits, expected[len(prompt) - 1 :], atol=atol, rtol=0)
    assert generated == expected[len(prompt) - 1 :].argmax(-1).tolist()
    assert len(set(generated)) > 4  # not a constant output
    reference = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt) :].tolist()
    assert generated == reference  # HF's own cached decode, its sliding-window cache included


def test_tree_verify_gives_each_node_its_paths_logits(pair):
    _, hf, ours, _ = pair
    prompt, tree = tokens(14, seed=5), tokens(len(PARENTS), seed=6)
    cache = ours.new_cache()
    prefill(ours, cache, prompt)
    logits, _ = verify_tree(ours, cache, tree, PARENTS)
    covered = set()
    for leaf in set(range(len(PARENTS))) - set(PARENTS):  # HF on each root-to-leaf path covers every node
        path = path_to_root(PARENTS, leaf)
        expected, _ = hf_logits(hf, prompt + [tree[i] for i in path])
        atol = logits_tolerance(ours, len(prompt) + len(path))
        torch.testing.assert_close(logits[path], expected[len(prompt) :], atol=atol, rtol=0, msg=f"leaf {leaf}")
        covered.update(path)
    assert covered == set(range(len(PARENTS)))


def ar(model: Transformer, prompt: list[int], steps: int) -> list[int]:
    return greedy_decode(model, prompt, steps)[0]


def test_chain_and_tree_verifies_give_ar_tokens(pair):
    """Greedy speculation's view: a chain verify of AR's tokens, and a tree holding them on a side path, pick AR's
    next tokens at every node of the AR path; committing a side path then decoding on equals AR from scratch."""
    _, _, ours, _ = pair
    prompt = tokens(11, seed=7)
    expected = ar(ours, prompt, 16)
    cache = ours.new_cache()
    prefill(ours, cache, prompt)
    chain, _ = verify_tree(ours, cache, expected[:8], list(range(-1, 7)))
    assert chain.argmax(-1).tolist() == expected[1:9]
    commit_path(cache, range(8))
    wrong = [(t + 1) % VOCAB for t in expected]
    # AR's path is 0 -> 2 -> 3 -> 5 -> 6: a wrong first child and a wrong sibling before each right one
    tree = [expected[8], wrong[9], expected[9], expected[10], wrong[11], expected[11], expected[12]]
    parents = [-1, 0, 0, 2, 3, 3, 5]
    logits, _ = verify_tree(ours, cache, tree, parents)
    assert logits[[0, 2, 3, 5, 6]].argmax(-1).tolist() == expected[9:14]
    commit_path(cache, [0, 2, 3])
    rest = [expected[11]]
    for _ in range(4):
        step, _ = verify_tree(ours, cache, [rest[-1]], [-1])
        commit_path(cache, [0])
        rest.append(int(step[0].argmax()))
    assert rest == expected[11:16]


def test_fast_precision_verify_rows_equal_ar_steps(pair):
    """bf16 activations, batch-invariant attention: with the window sliding, a chain verify's rows and a tree's
    AR-path rows equal the 1-row AR steps bitwise."""
    _, _, _, directory = pair
    assert_verify_rows_equal_ar_steps(inference_model(load_checkpoint(directory, progress=False), "fast"))


@pytest.fixture(scope="module")
def eager_and_compiled(tmp_path_factory):
    """The soft-capped variant with query_pre_attn_scalar != head_dim, in the fast precision: eager, and compiled
    (one compile: the step graph's sliding-window masks and local RoPE, post norms, scaled embedding, q scale). Two
    layers, a sliding one and a global one (the compile costs per layer; the two hold every op of the six)."""
    directory = make_gemma3(tmp_path_factory.mktemp("gemma3_compiled"), "softcap", seed=6, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "query_pre_attn_scalar": 24}))
    eager = inference_model(load_checkpoint(directory, progress=False), "fast")
    compiled = inference_model(load_checkpoint(directory, progress=False), "fast", compile="fast")
    assert can_compile(compiled) is None and compiled.compiled is not None
    return eager, compiled


def test_compiled_verify_rows_equal_its_ar_steps(eager_and_compiled):
    assert_verify_rows_equal_ar_steps(eager_and_compiled[1])


def test_compiled_step_computes_the_eager_fast_model(eager_and_compiled):
    """Past the window, a chain verify through the graph against the eager model: bf16 rounding differences only
    (the bound and the near-tie rule of tests/runtime/test_compiled_step.py), the soft cap applied to both."""
    eager, compiled = eager_and_compiled
    prompt = tokens(30, seed=9)
    chain = ar(eager, prompt, 6)
    got = []
    for model in (eager, compiled):
        cache = model.new_cache()
        prefill(model, cache, prompt)
        got.append(verify_tree(model, cache, chain, list(range(-1, 5)))[0])
    assert got[1].abs().max() <= eager.config.final_logit_softcapping
    torch.testing.assert_close(got[1], got[0], atol=0.1 * got[0].abs().max().item(), rtol=0)
    eager_best = got[0].max(-1).values
    picked = got[0].gather(-1, got[1].argmax(-1, keepdim=True))[:, 0]
    assert torch.all(picked >= eager_best - 0.1 * got[0].abs().max()), (picked, eager_best)
    assert (got[1].argmax(-1) == got[0].argmax(-1)).sum() >= 4


def assert_verify_rows_equal_ar_steps(model: Transformer) -> None:
    prompt = tokens(30, seed=8)
    steps, rows = [], []
    cache = model.new_cache()
    logits, _ = prefill(model, cache, prompt)
    for _ in range(10):
        steps.append(int(logits.argmax()))
        step, _ = verify_tree(model, cache, [steps[-1]], [-1])
        commit_path(cache, [0])
        rows.append(step[0])
        logits = step[0]
    cache = model.new_cache()
    prefill(model, cache, prompt)
    chain, _ = verify_tree(model, cache, steps, list(range(-1, 9)))
    for i in range(10):
        assert torch.equal(chain[i], rows[i]), ("chain", i)
    cache = model.new_cache()
    prefill(model, cache, prompt)
    wrong = (steps[1] + 1) % VOCAB
    tree, parents = [steps[0], wrong, steps[1], steps[2], wrong, steps[3]], [-1, 0, 0, 2, 3, 3]
    logits, _ = verify_tree(model, cache, tree, parents)
    for node, i in ((0, 0), (2, 1), (3, 2), (5, 3)):
        assert torch.equal(logits[node], rows[i]), ("tree", node)
