"""Drafter.forward_blocks: several sessions' blocks in one pass equal each block run alone."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter

from .helpers import assert_same_output, block_tolerances, random_features
from .test_drafter_forward import TARGET


@pytest.mark.parametrize("variant", ["full", "sliding_causal", "sliding_bidirectional", "dflash_slots"])
def test_batched_blocks_equal_each_block_alone(variant):
    sliding = variant != "full"
    drafter = init_random_drafter(
        TARGET, num_layers=2, block_size=5, target_layer_ids=(0, 3),
        layer_types=("sliding_attention", "full_attention") if sliding else None,
        sliding_window=6 if sliding else None, causal_sliding=variant != "sliding_bidirectional",
        slot_convention="dflash" if variant == "dflash_slots" else "dspark", seed=11)
    items = []
    for seed, (n, anchor) in enumerate([(3, 7), (17, 400), (9, 7)]):  # shorter and longer than the window
        ctx = drafter.new_context()
        ctx.append(random_features(drafter.config, n, seed=seed), 0)
        items.append((ctx, anchor))
    batched = drafter.forward_blocks(items)
    assert len(batched) == 3
    for (ctx, anchor), out in zip(items, batched, strict=True):
        assert out.base_logits.shape == (drafter.config.num_drafts, 512)
        alone = drafter.forward_block(ctx, anchor)
        assert_same_output(out, alone, block_tolerances(drafter, ctx.length, alone))
    # the batch really mixes different sessions: their outputs differ by more than the tolerance
    atol = block_tolerances(drafter, 17, batched[2])["base_logits"]
    assert not torch.allclose(batched[0].base_logits, batched[2].base_logits, rtol=0, atol=atol)
    assert [ctx.length for ctx, _ in items] == [3, 17, 9]  # nothing was appended


def test_the_same_context_twice_in_one_batch():
    drafter = init_random_drafter(TARGET, num_layers=1, block_size=4, target_layer_ids=(2,), seed=2)
    ctx = drafter.new_context()
    ctx.append(random_features(drafter.config, 5), 0)
    a, b = drafter.forward_blocks([(ctx, 1), (ctx, 2)])
    for out, anchor in ((a, 1), (b, 2)):
        alone = drafter.forward_block(ctx, anchor)
        assert_same_output(out, alone, block_tolerances(drafter, ctx.length, alone))


def test_bad_batches_are_refused():
    drafter = init_random_drafter(TARGET, target_layer_ids=(3,))
    ctx = drafter.new_context()
    ctx.append(random_features(drafter.config, 4), 0)
    with pytest.raises(ValueError, match="at least one"):
        drafter.forward_blocks([])
    with pytest.raises(AssertionError):  # DraftEngine.propose refuses such an anchor (INVALID_ARGUMENT)
        drafter.forward_blocks([(ctx, 3), (ctx, 512)])


def test_packed_drafter_equals_unpacked():
    """Drafter.pack (runtime/models/linear.py) gives the unpacked drafter's block outputs."""
    drafter = init_random_drafter(TARGET, num_layers=2, block_size=4, target_layer_ids=(0, 3), seed=3)
    drafter = drafter.eval().requires_grad_(False)
    features = random_features(drafter.config, 6)
    ctx = drafter.new_context()
    ctx.append(features, 0)
    plain = drafter.forward_block(ctx, 17)
    ctx = drafter.pack().new_context()
    ctx.append(features, 0)
    packed = drafter.forward_block(ctx, 17)
    assert drafter.fc.packed is not None and drafter.lm_head.packed is not None
    assert_same_output(packed, plain, block_tolerances(drafter, ctx.length, plain))
