"""A prompt chunk runs a slice of its layers at a time while other sessions' steps wait (target_service/engine.py
`_forward_in_slices`): however it is sliced, the prompt computes the same numbers. Forced here by an explicit gate (a
queue that always has a step waiting, a slice budget of 0 s: half a layer per slice), not by timing."""

from __future__ import annotations

import torch
from dspark_grpc.target_service.engine import PREFILL_CHUNK_ROWS


def prefill_once(engine, ids, capture_layers):
    sid = engine.open_session(capture_layers, None, 0, 0, object())
    try:
        out = engine.prefill(sid, ids)
        cache = engine.sessions.get(sid).cache
        keys = [cache.k[i][:, : len(ids)].clone() for i in (0, engine.model.config.num_layers - 1)]
        return out.next_token, out.captures, keys
    finally:
        engine.release(sid)


def test_a_prompt_sliced_layer_by_layer_computes_what_it_computes_in_one_go(fast_engine, monkeypatch):
    engine = fast_engine
    ids = [(i * 7919) % 40000 + 100 for i in range(2 * PREFILL_CHUNK_ROWS + 44)]  # 3 chunks
    layers = [1, engine.model.config.num_layers - 2]
    whole = prefill_once(engine, ids, layers)
    before = engine.prefill_slices
    monkeypatch.setattr(engine.batcher, "queued", lambda: 1)
    monkeypatch.setattr(engine, "slice_seconds", lambda: 0.0)
    sliced = prefill_once(engine, ids, layers)
    chunks = 3
    # every half layer (token mixer, feed-forward) a slice of its own
    assert engine.prefill_slices - before == chunks * 2 * engine.model.config.num_layers
    assert sliced[0] == whole[0]
    assert torch.equal(sliced[1], whole[1])
    for a, b in zip(sliced[2], whole[2], strict=True):
        assert torch.equal(a, b)
