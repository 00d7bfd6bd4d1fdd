"""Token trees: validation, helpers, one-pass verification vs sequential paths, commit then keep decoding."""

from __future__ import annotations

import random

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.runtime.models.tree import (
    TreeError,
    ancestor_mask,
    is_root_path,
    path_to_root,
    tree_depths,
    validate_tree,
)
from runtime_helpers import random_tokens
from tolerance import hidden_tolerance, logits_tolerance


def random_tree(num_nodes: int, seed: int) -> list[int]:
    """Parents of a random tree with 3 branches under the root and a path of depth >= 4."""
    rng = random.Random(seed)
    parents = [-1, 0, 0, 0, 1, 4, 5]
    while len(parents) < num_nodes:
        parents.append(rng.randrange(len(parents)))
    return parents


@pytest.fixture(scope="module", params=["qwen3", "llama_yarn", "qwen2"])
def model(request, tiny_hf_models) -> Transformer:
    return Transformer.from_checkpoint(load_checkpoint(tiny_hf_models[request.param], progress=False))


def _sequential(model: Transformer, prompt: list[int], path_tokens: list[int], layers: tuple[int, ...]):
    cache = model.new_cache()
    prefill(model, cache, prompt)
    positions = torch.arange(cache.length, cache.length + len(path_tokens))
    out = model(torch.tensor(path_tokens), positions, cache, capture_layers=layers)
    return out.logits, out.captures


def test_tree_verify_equals_sequential_paths(model):
    prompt = random_tokens(10, seed=10)
    parents = random_tree(16, seed=0)
    tokens = random_tokens(16, seed=11)
    assert sum(p == 0 for p in parents) >= 3 and max(tree_depths(parents)) >= 4
    cache = model.new_cache()
    prefill(model, cache, prompt)
    logits, captures = verify_tree(model, cache, tokens, parents, capture_layers=(0, 1))
    assert logits.shape == (16, model.config.vocab_size) and logits.dtype == torch.float32
    assert captures.shape == (16, 2, model.config.hidden_size)
    assert cache.length == len(prompt) and cache.pending == 16
    leaves = [i for i in range(16) if i not in parents]
    covered = set()
    for leaf in leaves:
        path = path_to_root(parents, leaf)
        expected_logits, expected_captures = _sequential(model, prompt, [tokens[i] for i in path], (0, 1))
        context = len(prompt) + len(path)
        torch.testing.assert_close(logits[path], expected_logits, atol=logits_tolerance(model, context), rtol=0)
        for j in (0, 1):
            atol = hidden_tolerance(model.config, context, j + 1, expected_captures[:, j])
            torch.testing.assert_close(captures[path, j], expected_captures[:, j], atol=atol, rtol=0)
        covered.update(path)
    assert covered == set(range(16))


def _greedy_continue(model, cache, first: int, steps: int) -> tuple[list[int], torch.Tensor]:
    tokens, rows = [first], []
    for _ in range(steps):
        logits, _ = verify_tree(model, cache, [tokens[-1]], [-1])
        commit_path(cache, [0])
        rows.append(logits[0])
        tokens.append(int(logits[0].argmax()))
    return tokens, torch.stack(rows)


def test_commit_path_then_decode_equals_plain_decoding(model):
    prompt = random_tokens(9, seed=20)
    parents = random_tree(12, seed=1)
    tokens = random_tokens(12, seed=21)
    path = path_to_root(parents, max(range(12), key=lambda i: tree_depths(parents)[i]))
    assert len(path) >= 5

    cache = model.new_cache()
    prefill(model, cache, prompt)
    tree_logits, _ = verify_tree(model, cache, tokens, parents)
    commit_path(cache, path)
    assert cache.length == len(prompt) + len(path) and cache.pending == 0
    after_tree = _greedy_continue(model, cache, int(tree_logits[path[-1]].argmax()), 10)

    plain = model.new_cache()
    prefill(model, plain, prompt)
    ar_logits = []
    for i in path:  # the path's tokens one at a time
        step, _ = verify_tree(model, plain, [tokens[i]], [-1])
        commit_path(plain, [0])
        ar_logits.append(step[0])
    atol = logits_tolerance(model, plain.length)
    torch.testing.assert_close(tree_logits[path], torch.stack(ar_logits), atol=atol, rtol=0)
    after_plain = _greedy_continue(model, plain, int(ar_logits[-1].argmax()), 10)
    assert after_tree[0] == after_plain[0]
    atol = logits_tolerance(model, plain.length)
    torch.testing.assert_close(after_tree[1], after_plain[1], atol=atol, rtol=0)
    assert cache.length == plain.length


def test_second_verify_replaces_pending_rows(model):
    prompt = random_tokens(6, seed=30)
    first, second = random_tokens(8, seed=31), random_tokens(8, seed=32)
    parents = random_tree(8, seed=2)
    cache = model.new_cache()
    prefill(model, cache, prompt)
    verify_tree(model, cache, first, parents)
    again, _ = verify_tree(model, cache, second, parents)
    fresh = model.new_cache()
    prefill(model, fresh, prompt)
    expected, _ = verify_tree(model, fresh, second, parents)
    torch.testing.assert_close(again, expected, atol=logits_tolerance(model, len(prompt) + len(second)), rtol=0)


def test_commit_path_keeps_a_root_path(model):
    """commit_path asserts a root-to-node path; a request's path is validated by TargetEngine.commit
    (tests/service/test_bad_input.py: test_commit_refuses_paths_that_are_not_root_paths)."""
    cache = model.new_cache()
    prefill(model, cache, random_tokens(5, seed=40))
    parents = [-1, 0, 0, 1, 2]
    verify_tree(model, cache, random_tokens(5, seed=41), parents)
    with pytest.raises(AssertionError):
        commit_path(cache, [0, 1, 4])
    assert cache.pending == 5
    commit_path(cache, [0, 2, 4])
    assert cache.length == 8 and cache.pending == 0


def test_prefill_chunks_and_causal_default(model):
    prompt = random_tokens(23, seed=50)
    whole = model.new_cache()
    logits, captures = prefill(model, whole, prompt, capture_layers=(1, 0))
    chunked = model.new_cache()
    chunked_logits, chunked_captures = prefill(model, chunked, prompt, capture_layers=(1, 0), chunk_size=5)
    assert whole.length == chunked.length == 23 and captures.shape == (23, 2, model.config.hidden_size)
    torch.testing.assert_close(chunked_logits, logits, atol=logits_tolerance(model, len(prompt)), rtol=0)
    for j, layer in enumerate((1, 0)):
        atol = hidden_tolerance(model.config, len(prompt), layer + 1, captures[:, j])
        torch.testing.assert_close(chunked_captures[:, j], captures[:, j], atol=atol, rtol=0)
    # mask=None on top of committed rows == an explicit causal mask; logits_rows picks rows.
    new = random_tokens(4, seed=51)
    positions = torch.arange(23, 27)
    default = model(torch.tensor(new), positions, whole).logits
    mask = torch.ones(4, 27, dtype=torch.bool)
    mask[:, 23:] = torch.ones(4, 4, dtype=torch.bool).tril()
    explicit = model(torch.tensor(new), positions, whole, mask=mask, logits_rows=torch.tensor([3, 1])).logits
    torch.testing.assert_close(explicit, default[[3, 1]], atol=logits_tolerance(model, 27), rtol=0)


def test_forward_asserts_its_input_shapes(model):
    """A forward asserts the shapes it relies on; what a request brings (token ids, capture layers, trees) is
    validated by the engine (tests/service/test_bad_input.py)."""
    cache = model.new_cache()
    for bad in (dict(capture_layers=(model.config.num_layers,)), dict(capture_layers=(-1,)),
                dict(mask=torch.ones(2, 3, dtype=torch.bool))):
        with pytest.raises(AssertionError):
            model(torch.tensor([1, 2]), torch.arange(2), cache, **bad)
    with pytest.raises(AssertionError):
        model(torch.tensor([1, 2]), torch.arange(3), cache)
    assert cache.length == 0 and cache.pending == 0


def test_tree_helpers():
    parents = [-1, 0, 0, 1, 3, 2]
    assert tree_depths(parents) == [0, 1, 1, 2, 3, 2]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ancestor_mask(parents), expected)
    assert path_to_root(parents, 4) == [0, 1, 3, 4]
    assert path_to_root(parents, 0) == [0]
    assert is_root_path(parents, [0, 2, 5]) and is_root_path(parents, [0])
    assert not is_root_path(parents, [0, 1, 5]) and not is_root_path(parents, [1, 3])
    assert not is_root_path(parents, []) and not is_root_path(parents, [0, 9])


@pytest.mark.parametrize(
    ("tokens", "parents", "message"),
    [
        ([], [], "empty"),
        ([1, 2], [-1], "parents has 1"),
        ([1, 2], [0, 0], "root and its parent must be -1"),
        ([1, 2, 3], [-1, 0, 2], "node 2 has parent 2"),
        ([1, 2, 3], [-1, 0, 5], "node 2 has parent 5"),
        ([1, 2, 3], [-1, -1, 0], "node 1 has parent -1"),
        ([1, -2], [-1, 0], "token id -2"),
        ([1, 100], [-1, 0], "token id 100"),
        ([1] * 9, [-1] + [0] * 8, "more than the limit of 8"),
    ],
)
def test_validate_tree_errors(tokens, parents, message):
    with pytest.raises(TreeError, match=message):
        validate_tree(tokens, parents, vocab_size=100, max_nodes=8)
    assert issubclass(TreeError, ValueError)


def test_validate_tree_accepts_valid_trees():
    validate_tree([5], [-1], vocab_size=100, max_nodes=1)
    validate_tree([5, 6, 99, 0], [-1, 0, 0, 2], vocab_size=100, max_nodes=4)
