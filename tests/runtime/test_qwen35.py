"""The qwen35 hybrid target (Qwen3.5: Gated DeltaNet linear attention + gated full attention) vs transformers:
HF directory and GGUF loading, logits, greedy decoding, captures, tree verification, commit, rollback, batching."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.decode import commit_path, prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.kv_cache import HybridCache
from dspark_grpc.runtime.models.linear_attention import parents_from_mask
from dspark_grpc.runtime.models.transformer import SequenceInput, Transformer
from dspark_grpc.runtime.models.tree import ancestor_mask, path_to_root, tree_depths
from qwen35_models import make_qwen35, write_qwen35_gguf
from runtime_helpers import greedy_decode, hf_logits, random_tokens
from tolerance import hidden_tolerance, logits_tolerance

# Tolerances: tests/tolerance.py's bound for the model's sizes and the rows attended (ours vs HF, GGUF vs safetensors,
# a verify vs AR steps: float32 computations of the same model in other orders). ~3e-3 to 7e-3 here.
VOCAB = 512
STEPS = 64
# side branches at depths 1, 2 and 3, and a path of depth 5
PARENTS = [-1, 0, 0, 1, 1, 3, 3, 5, 6, 0, 7, 2, 9]


@pytest.fixture(scope="module", params=["every4", "every2", "mixed"])
def layout(request, tmp_path_factory):
    directory = make_qwen35(tmp_path_factory.mktemp(f"qwen35_{request.param}"), request.param, VOCAB, seed=3)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return request.param, directory, hf


@pytest.fixture(scope="module")
def ours(layout):
    _, directory, _ = layout
    return Transformer.from_checkpoint(load_checkpoint(directory, progress=False))


def tokens(n: int, seed: int) -> list[int]:
    return random_tokens(n, seed, vocab_size=VOCAB)


def new_cache(model: Transformer, keep_states: bool = True) -> HybridCache:
    """keep_states=False: no row's state kept pending, every commit runs the delta rule again along its path."""
    return HybridCache(model.config, 1024, pending_state_bytes=1 << 30 if keep_states else 0)


def test_config_and_layout(layout, ours):
    name, _, hf = layout
    c, h = ours.config, hf.config
    assert c.architecture == "qwen35" and c.qk_norm and c.attention_output_gate
    assert c.layer_types == tuple("attention" if t == "full_attention" else t for t in h.layer_types)
    assert c.rotary_dim == int(h.head_dim * h.rope_parameters["partial_rotary_factor"]) < c.head_dim
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel) == (h.linear_num_key_heads, h.linear_num_value_heads, h.linear_key_head_dim,
                                      h.linear_value_head_dim, h.linear_conv_kernel_dim)
    full = [i for i, t in enumerate(c.layer_types) if t == "attention"]
    assert full == {"every4": [3], "every2": [1, 3], "mixed": [0, 3]}[name]
    assert c.num_heads > c.num_kv_heads or c.linear_num_value_heads > c.linear_num_key_heads  # some GQA


def test_prompt_logits_match_hf(layout, ours):
    _, _, hf = layout
    ids = tokens(40, seed=0)
    expected, _ = hf_logits(hf, ids)
    got = ours(torch.tensor(ids), torch.arange(len(ids)), ours.new_cache()).logits
    torch.testing.assert_close(got, expected, atol=logits_tolerance(ours, len(ids)), rtol=0)


def test_greedy_decode_matches_hf(layout, ours):
    name, _, hf = layout
    prompt = tokens(12, seed=1)
    generated, step_logits = greedy_decode(ours, prompt, STEPS)
    expected, _ = hf_logits(hf, prompt + generated[:-1])  # teacher-forced over our sequence
    atol = logits_tolerance(ours, len(prompt) + STEPS)
    torch.testing.assert_close(step_logits, expected[len(prompt) - 1 :], atol=atol, rtol=0)
    assert generated == expected[len(prompt) - 1 :].argmax(-1).tolist()
    assert len(set(generated)) > 4  # not a constant output
    if name == "every4":  # and HF's own cached decode (its recurrent path, one token at a time) agrees
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt) :].tolist()
        assert generated == reference


def test_hidden_state_captures_match_hf(layout, ours):
    _, _, hf = layout
    ids = tokens(20, seed=2)
    _, out = hf_logits(hf, ids, output_hidden_states=True)
    n = ours.config.num_layers
    got = ours(torch.tensor(ids), torch.arange(len(ids)), ours.new_cache(), capture_layers=tuple(range(n))).captures
    for layer in range(n - 1):
        expected = out.hidden_states[layer + 1][0]
        atol = hidden_tolerance(ours.config, len(ids), layer + 1, expected)
        torch.testing.assert_close(got[:, layer], expected, atol=atol, rtol=0)
    atol = hidden_tolerance(ours.config, len(ids), None, out.hidden_states[n][0])
    torch.testing.assert_close(ours.norm(got[:, n - 1]), out.hidden_states[n][0], atol=atol, rtol=0)


def test_gguf_loads_the_same_model(layout, ours, tmp_path):
    name, directory, hf = layout
    if name == "mixed":
        pytest.skip("GGUF's qwen35 keys say only 'every n-th layer is full attention'")
    path = write_qwen35_gguf(directory, tmp_path / "tiny.gguf")
    ckpt = load_checkpoint(path, progress=False)
    assert ckpt.config.fingerprint() == ours.config.fingerprint()
    assert ckpt.weights.keys() == ours.state_dict().keys()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(ckpt.weights[key], value, atol=0, rtol=0, msg=key)
    from_gguf = Transformer.from_checkpoint(ckpt)
    ids = tokens(40, seed=4)
    expected, _ = hf_logits(hf, ids)
    got = from_gguf(torch.tensor(ids), torch.arange(len(ids)), from_gguf.new_cache()).logits
    torch.testing.assert_close(got, expected, atol=logits_tolerance(from_gguf, len(ids)), rtol=0)
    assert greedy_decode(from_gguf, ids[:8], 16)[0] == greedy_decode(ours, ids[:8], 16)[0]


def test_tree_verify_gives_each_node_its_paths_logits(layout, ours):
    _, _, hf = layout
    prompt, tree = tokens(10, seed=5), tokens(len(PARENTS), seed=6)
    cache = ours.new_cache()
    prefill(ours, cache, prompt)
    logits, captures = verify_tree(ours, cache, tree, PARENTS, capture_layers=(0, 1))
    assert logits.shape == (len(PARENTS), VOCAB) and captures.shape == (len(PARENTS), 2, 64)
    assert max(tree_depths(PARENTS)) == 5
    covered = set()
    for leaf in set(range(len(PARENTS))) - set(PARENTS):  # HF on each root-to-leaf path covers every node
        path = path_to_root(PARENTS, leaf)
        expected, out = hf_logits(hf, prompt + [tree[i] for i in path], output_hidden_states=True)
        context = len(prompt) + len(path)
        torch.testing.assert_close(logits[path], expected[len(prompt) :], atol=logits_tolerance(ours, context), rtol=0,
                                   msg=f"leaf {leaf}")
        hidden = out.hidden_states[2][0, len(prompt) :]
        torch.testing.assert_close(captures[path, 1], hidden, atol=hidden_tolerance(ours.config, context, 2, hidden),
                                   rtol=0)
        covered.update(path)
    assert covered == set(range(len(PARENTS)))


def _ar(model: Transformer, cache, first: int, steps: int) -> tuple[list[int], torch.Tensor]:
    out, rows = [first], []
    for _ in range(steps):
        logits, _ = verify_tree(model, cache, [out[-1]], [-1])
        commit_path(cache, [0])
        rows.append(logits[0])
        out.append(int(logits[0].argmax()))
    return out, torch.stack(rows)


@pytest.mark.parametrize("keep_states", [True, False], ids=["kept", "recomputed"])
def test_commit_of_a_side_path_then_ar_equals_ar_from_scratch(ours, keep_states):
    prompt, tree = tokens(9, seed=7), tokens(len(PARENTS), seed=8)
    cache = new_cache(ours, keep_states)
    prefill(ours, cache, prompt)
    logits, _ = verify_tree(ours, cache, tree, PARENTS)
    path = path_to_root(PARENTS, 8)  # 0 -> 1 -> 3 -> 6 -> 8: a side branch at depth 2
    commit_path(cache, path)
    assert cache.length == len(prompt) + len(path)
    first = int(logits[path[-1]].argmax())
    got, got_logits = _ar(ours, cache, first, 16)
    fresh = ours.new_cache()
    scratch_logits, _ = prefill(ours, fresh, prompt + [tree[i] for i in path])
    assert int(scratch_logits.argmax()) == first
    expected, expected_logits = _ar(ours, fresh, first, 16)
    assert got == expected
    torch.testing.assert_close(got_logits, expected_logits, atol=logits_tolerance(ours, fresh.length), rtol=0)


@pytest.mark.parametrize("keep_states", [True, False], ids=["kept", "recomputed"])
def test_rollback_then_ar_equals_ar_from_scratch(ours, keep_states):
    prompt = tokens(11, seed=9)
    cache = new_cache(ours, keep_states)
    logits, _ = prefill(ours, cache, prompt)
    chain = [int(logits.argmax())] + tokens(5, seed=10)
    verify_tree(ours, cache, chain, list(range(-1, 5)))
    commit_path(cache, list(range(6)))  # a 6-token chain, accepted whole
    sequence, _ = _ar(ours, cache, int(tokens(1, seed=11)[0]), 2)
    full = prompt + chain + sequence[:-1]
    assert cache.length == len(full)
    for back in (6, 3):  # into the committed chain, then (after 10 AR steps) a recent length
        length = cache.length - back
        assert cache.can_rollback(length)
        cache.rollback(length)
        got, got_logits = _ar(ours, cache, full[length], 10)
        fresh = ours.new_cache()
        prefill(ours, fresh, full[:length])
        expected, expected_logits = _ar(ours, fresh, full[length], 10)
        assert got == expected
        torch.testing.assert_close(got_logits, expected_logits, atol=logits_tolerance(ours, fresh.length), rtol=0)
        full = full[:length] + got[:-1]
    assert not cache.can_rollback(3)  # older than the kept snapshots: the engine recomputes from the tokens
    with pytest.raises(ValueError, match="recompute"):
        cache.rollback(3)
    cache.rollback(0)
    assert cache.length == 0 and all(not s.state.any() for s in cache.linear.values())


def test_batched_sessions_equal_each_alone(ours):
    prompts = [tokens(n, seed=20 + n) for n in (5, 17, 9)]
    tree = tokens(len(PARENTS), seed=30)

    def inputs(caches):
        return [tree_input(caches[0], [prompts[0][-1]], [-1]),  # an AR step
                tree_input(caches[1], tree, PARENTS, capture_layers=(0,)),  # a tree
                SequenceInput(torch.tensor(tree[:6]), torch.arange(caches[2].length, caches[2].length + 6),
                              caches[2], logits_rows=torch.tensor([2, 5]))]  # a prefill chunk

    def fresh():  # the tree's session recomputes its committed path's states, the others keep them
        caches = [new_cache(ours, keep_states=i != 1) for i in range(len(prompts))]
        for c, p in zip(caches, prompts, strict=True):
            prefill(ours, c, p[:-1] if c is caches[0] else p)
        return caches

    together_caches, alone_caches = fresh(), fresh()
    together = ours.forward_batch(inputs(together_caches))
    alone = [ours.forward_batch([inp])[0] for inp in inputs(alone_caches)]
    context = max(c.length + c.pending for c in alone_caches)
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a.logits, b.logits, atol=logits_tolerance(ours, context), rtol=0)
    atol = hidden_tolerance(ours.config, context, 1, alone[1].captures)
    torch.testing.assert_close(together[1].captures, alone[1].captures, atol=atol, rtol=0)
    # then commit in each and decode on, batched: the recurrent states stayed per session
    for caches in (together_caches, alone_caches):
        caches[0].commit([0])
        caches[1].commit(path_to_root(PARENTS, 10))
        caches[2].commit(range(6))
    steps = [[1], [2], [3]]
    for _ in range(8):
        outs = ours.forward_batch([tree_input(c, [s[-1]], [-1]) for c, s in zip(together_caches, steps, strict=True)])
        for c, s, o in zip(together_caches, steps, outs, strict=True):
            c.commit([0])
            s.append(int(o.logits[0].argmax()))
    for c, s in zip(alone_caches, steps, strict=True):
        assert _ar(ours, c, s[0], 8)[0] == s


def test_linear_layers_refuse_masks_that_are_not_trees(ours):
    assert parents_from_mask(ancestor_mask(PARENTS)) == PARENTS
    skip = torch.ones(3, 3, dtype=torch.bool).tril()
    skip[2, 0] = False  # row 2 sees its parent row 1 but not row 0, its grandparent
    with pytest.raises(ValueError, match="tree mask"):
        parents_from_mask(skip)
    cache = ours.new_cache()
    prefill(ours, cache, [1, 2, 3])
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, 0] = False  # hides a committed row
    mask[0, 4] = False
    with pytest.raises(ValueError, match="tree mask"):
        ours(torch.tensor([4, 5]), torch.tensor([3, 4]), cache, mask=mask)
    assert cache.length == 3 and cache.pending == 0


def test_conditional_generation_checkpoint_loads_its_text_model(layout, ours, tmp_path):
    """Qwen3_5ForConditionalGeneration's layout: the text config nested, weights under model.language_model.,
    a vision tower and MTP weights that the target does not use."""
    import json

    from safetensors.torch import load_file, save_file

    _, directory, _ = layout
    text = json.loads((directory / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(directory / "model.safetensors")).items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.zeros(2, 2), "mtp.fc.weight": torch.zeros(2, 2)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(tmp_path, progress=False)
    assert ckpt.config.fingerprint() == ours.config.fingerprint()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(ckpt.weights[key], value, atol=0, rtol=0, msg=key)


def test_bfloat16_model_decodes_with_float32_recurrent_state(layout):
    _, directory, _ = layout
    model = Transformer.from_checkpoint(load_checkpoint(directory, progress=False), dtype=torch.bfloat16).pack()
    cache = model.new_cache()
    generated, logits = greedy_decode(model, tokens(8, seed=40), 6)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all() and len(generated) == 6
    prefill(model, cache, tokens(8, seed=40))
    assert all(s.state.dtype == torch.float32 and s.conv.dtype == torch.bfloat16 for s in cache.linear.values())
    assert any(s.state.abs().sum() > 0 for s in cache.linear.values())


def test_commit_refuses_rows_that_are_not_a_root_path_and_changes_nothing(ours):
    cache = ours.new_cache()
    prefill(ours, cache, [1, 2, 3])
    verify_tree(ours, cache, tokens(len(PARENTS), seed=50), PARENTS)
    layer = next(iter(cache.linear.values()))
    state = layer.state.clone()
    with pytest.raises(ValueError, match="root-to-node"):
        cache.commit([0, 3])  # node 3's parent is node 1
    assert cache.length == 3 and cache.pending == len(PARENTS) and torch.equal(layer.state, state)


def test_long_prompt_runs_the_chunked_rule_and_matches_hf(layout, ours):
    """150 rows: the chunked form over the first 142 (two 64-row chunks, one padded), then the last 8 one by one."""
    _, _, hf = layout
    ids = tokens(150, seed=60)
    got = ours(torch.tensor(ids), torch.arange(len(ids)), ours.new_cache()).logits
    expected, _ = hf_logits(hf, ids)
    torch.testing.assert_close(got, expected, atol=logits_tolerance(ours, len(ids)), rtol=0)
    generated, step_logits = greedy_decode(ours, ids, 8)  # prefill commits the chunked chain whole, then AR
    expected, _ = hf_logits(hf, ids + generated[:-1])
    atol = logits_tolerance(ours, len(ids) + 8)
    torch.testing.assert_close(step_logits, expected[len(ids) - 1 :], atol=atol, rtol=0)


def test_prefix_of_a_long_chunked_chain_commits_then_ar_equals_ar_from_scratch(ours):
    prompt, chain = tokens(10, seed=61), tokens(90, seed=62)
    cache = ours.new_cache()
    prefill(ours, cache, prompt)
    ours(torch.tensor(chain), torch.arange(10, 100), cache)  # no mask: a prompt chunk, run in chunks
    commit_path(cache, list(range(40)))  # rows without kept states: recomputed along the path
    got, got_logits = _ar(ours, cache, chain[40], 8)
    fresh = ours.new_cache()
    prefill(ours, fresh, prompt + chain[:40])
    expected, expected_logits = _ar(ours, fresh, chain[40], 8)
    assert got == expected
    torch.testing.assert_close(got_logits, expected_logits, atol=logits_tolerance(ours, fresh.length), rtol=0)
