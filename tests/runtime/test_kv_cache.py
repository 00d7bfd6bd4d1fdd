"""KVCache: pending rows, commit compaction, discard, rollback, growth by doubling, max_length."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.kv_cache import CacheFullError, KVCache
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import greedy_decode, random_tokens
from tolerance import logits_tolerance

LAYERS, HEADS, DIM = 2, 2, 4


def _rows(values: list[float]) -> torch.Tensor:
    """K (or V) for len(values) rows: row j is filled with values[j]."""
    return torch.tensor(values).view(1, -1, 1).expand(HEADS, -1, DIM).clone()


def _write(cache: KVCache, values: list[float]) -> list[torch.Tensor]:
    cache.begin(len(values))
    return [cache.layer(i).update(_rows(values) + i, -_rows(values))[0] for i in range(LAYERS)]


def _committed(cache: KVCache, layer: int = 0) -> list[float]:
    return cache.k[layer][0, : cache.length, 0].tolist()


def test_pending_rows_commit_and_compaction():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=64)
    keys = _write(cache, [1, 2, 3])
    assert keys[0].shape == (HEADS, 3, DIM) and cache.length == 0 and cache.pending == 3
    cache.commit([0, 1, 2])
    assert cache.length == 3 and cache.pending == 0 and _committed(cache) == [1, 2, 3]
    keys = _write(cache, [10, 11, 12, 13, 14])
    assert keys[1][0, :, 0].tolist() == [2, 3, 4, 11, 12, 13, 14, 15]  # committed + pending, layer 1 (+1)
    cache.commit(torch.tensor([1, 3, 4]))
    assert _committed(cache) == [1, 2, 3, 11, 13, 14]
    assert _committed(cache, layer=1) == [2, 3, 4, 12, 14, 15]
    assert cache.v[0][0, : cache.length, 0].tolist() == [-1, -2, -3, -11, -13, -14]


def test_discard_and_implicit_discard():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=64)
    _write(cache, [1, 2])
    cache.commit([0, 1])
    _write(cache, [7, 8, 9])
    cache.discard()
    assert cache.length == 2 and cache.pending == 0
    _write(cache, [5, 6])  # a new forward replaces pending rows too
    _write(cache, [3])
    cache.commit([0])
    assert _committed(cache) == [1, 2, 3]


def test_rollback():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=64)
    _write(cache, [1, 2, 3, 4])
    cache.commit(range(4))
    _write(cache, [9])
    cache.rollback(2)
    assert cache.length == 2 and cache.pending == 0
    _write(cache, [5])
    cache.commit([0])
    assert _committed(cache) == [1, 2, 5]
    for bad in (4, -1):
        with pytest.raises(ValueError):
            cache.rollback(bad)
    cache.rollback(0)
    assert cache.length == 0


def test_commit_rejects_bad_rows():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=64)
    _write(cache, [1, 2, 3])
    for bad in ([3], [-1], [1, 1], [2, 1]):
        with pytest.raises(ValueError):
            cache.commit(bad)
    assert cache.pending == 3
    cache.commit([])
    assert cache.length == 0 and cache.pending == 0


def test_growth_by_doubling_keeps_rows():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=40, initial_capacity=4)
    assert cache.capacity == 4 and cache.nbytes == 2 * LAYERS * HEADS * 4 * DIM * 4
    _write(cache, [1, 2, 3])
    cache.commit(range(3))
    _write(cache, [4, 5])
    assert cache.capacity == 8
    cache.commit([0, 1])
    _write(cache, list(range(6, 26)))
    assert cache.capacity == 32 and cache.nbytes == 2 * LAYERS * HEADS * 32 * DIM * 4
    cache.commit(range(20))
    assert _committed(cache) == list(range(1, 26))
    _write(cache, list(range(26, 41)))
    assert cache.capacity == 40  # capped at max_length
    cache.commit(range(15))
    assert _committed(cache, layer=1) == list(range(2, 42))


def test_max_length():
    cache = KVCache(LAYERS, HEADS, DIM, max_length=6, initial_capacity=4)
    _write(cache, [1, 2, 3, 4])
    cache.commit(range(4))
    with pytest.raises(CacheFullError, match="max_length 6"):
        cache.begin(3)
    assert issubclass(CacheFullError, ValueError)
    assert cache.length == 4
    _write(cache, [5, 6])
    cache.commit([0, 1])
    with pytest.raises(CacheFullError):
        cache.begin(1)
    with pytest.raises(ValueError):
        KVCache(LAYERS, HEADS, DIM, max_length=0)


def test_model_decoding_is_independent_of_cache_growth(tiny_hf_models):
    model = Transformer.from_checkpoint(load_checkpoint(tiny_hf_models["qwen3"], progress=False))
    prompt = random_tokens(7, seed=60)
    tokens, logits = greedy_decode(model, prompt, 20)

    cache = model.new_cache(initial_capacity=2)
    small_logits = []
    step = torch.tensor(prompt)
    for _ in range(20):
        out = model(step, torch.arange(cache.length, cache.length + len(step)), cache, logits_rows=torch.tensor([-1]))
        cache.commit(range(len(step)))
        small_logits.append(out.logits[0])
        step = torch.tensor([int(out.logits[0].argmax())])
    assert cache.capacity == 32
    torch.testing.assert_close(torch.stack(small_logits), logits, atol=logits_tolerance(model, cache.length), rtol=0)

    with pytest.raises(CacheFullError):
        model(torch.tensor(prompt), torch.arange(7), model.new_cache(max_length=6))
    with pytest.raises(AssertionError, match="bfloat16"):  # a cache of another dtype: the forward asserts
        model(torch.tensor(prompt), torch.arange(7), KVCache.for_config(model.config, dtype=torch.bfloat16))
