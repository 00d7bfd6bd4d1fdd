"""The teacher-forced training forward against the inference path (Drafter.forward_block, run_chain/draft_chain)."""

from __future__ import annotations

import pytest
import torch
from drafter.helpers import block_tolerances
from dspark_grpc.runtime.drafting.markov import draft_chain
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.train.model import (
    accepted_lengths,
    confidence_logits,
    corrected_logits,
    default_layer_ids,
    forward_blocks,
    greedy_chains,
    init_drafter,
    make_batch,
    spread_anchors,
)
from dspark_grpc.train.vocab import DraftVocab
from heads.reference import chain_tolerances, confidence_tolerance, reference_bias, reference_step, z_bound

from .conftest import LAYER_IDS, VOCAB, Tiny


def drafter_for(tiny: Tiny, seed: int = 0, **kwargs):
    embed = tiny.model.tok_embeddings.weight
    defaults = dict(num_layers=2, block_size=4, target_layer_ids=LAYER_IDS, markov_rank=8, seed=seed,
                    target_embed=embed, target_lm_head=embed, mask_token_id=VOCAB - 1)
    return init_random_drafter(tiny.model.config, **{**defaults, **kwargs})


def some_anchors(tiny: Tiny, K: int) -> tuple[list, list]:
    seqs = tiny.train[:3]
    anchors = []
    for i, s in enumerate(seqs):
        first, n = s.prompt_len - 1, s.tokens.numel()
        anchors.append(sorted({first, first + 1 + i, n - 2}))
    return seqs, anchors


@pytest.mark.parametrize("kwargs", [
    {},
    {"slot_convention": "dflash"},
    {"draft_vocab_size": 40},
    {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},
    {"layer_types": ("sliding_attention", "sliding_attention"), "sliding_window": 4, "causal_sliding": False},
])
def test_packed_blocks_equal_forward_block_one_anchor_at_a_time(tiny: Tiny, kwargs: dict):
    drafter = drafter_for(tiny, **kwargs)
    K = drafter.config.num_drafts
    seqs, anchors = some_anchors(tiny, K)
    batch = make_batch(seqs, anchors, K)
    rows = forward_blocks(drafter, batch)
    assert rows.base_logits.shape == (batch.num_anchors, K, drafter.config.draft_vocab_size)
    a = 0
    for seq, positions in zip(seqs, anchors, strict=True):
        for p in positions:
            ctx = drafter.new_context()
            ctx.append(seq.features[:p].float(), 0)
            ref = drafter.forward_block(ctx, int(seq.tokens[p]))
            atol = block_tolerances(drafter, p, ref)
            torch.testing.assert_close(rows.base_logits[a], ref.base_logits, atol=atol["base_logits"], rtol=0)
            torch.testing.assert_close(rows.hidden_pre[a], ref.hidden_pre_norm, atol=atol["hidden_pre_norm"], rtol=0)
            torch.testing.assert_close(rows.hidden_post[a], ref.hidden_post_norm, atol=atol["hidden_post_norm"],
                                       rtol=0)
            a += 1


def test_batch_rows_align_with_the_targets_continuation(tiny: Tiny):
    seq = next(s for s in tiny.train if s.mode == "greedy")
    n, K = seq.tokens.numel(), 4
    p_last = n - 2
    batch = make_batch([seq], [[seq.prompt_len - 1, p_last]], K)
    t = seq.tokens
    assert batch.context.shape == (p_last, len(LAYER_IDS) * 32)
    assert batch.prev_tokens[0].tolist() == t[seq.prompt_len - 1: seq.prompt_len - 1 + K].tolist()
    assert batch.labels[0].tolist() == t[seq.prompt_len: seq.prompt_len + K].tolist()
    assert batch.valid[1].tolist() == [True, False, False, False] and batch.labels[1, 0] == t[-1]
    # greedy continuation: each label is the argmax of the target's distribution at that row
    assert torch.equal(batch.topk_ids[..., 0][batch.valid], batch.labels[batch.valid])


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_teacher_forced_markov_bias_matches_the_reference_step(tiny: Tiny, kind: str):
    drafter = drafter_for(tiny, markov_head_type=kind, draft_vocab_size=50, seed=3)
    seqs, anchors = some_anchors(tiny, 4)
    batch = make_batch(seqs, anchors, 4)
    rows = forward_blocks(drafter, batch)
    z, emb = corrected_logits(drafter, rows, batch.prev_tokens)
    conf = confidence_logits(drafter, rows, emb)
    m = drafter.markov
    for a in range(batch.num_anchors):
        state = [0.0] * m.rank
        for k in range(4):
            e, v, state = reference_step(m, int(batch.prev_tokens[a, k]), rows.hidden_post[a, k].tolist(), state)
            expected = rows.base_logits[a, k].double() + torch.tensor(reference_bias(m, v), dtype=torch.float64)
            atol = z_bound(rows.base_logits[a, : k + 1], m, rows.hidden_post[a, : k + 1])[1]  # k + 1 chained steps
            torch.testing.assert_close(z[a, k].double(), expected, atol=atol, rtol=0)
            torch.testing.assert_close(emb[a, k].double(), torch.tensor(e, dtype=torch.float64))
        hidden = drafter.confidence.select_hidden(rows.hidden_pre[a], rows.hidden_post[a])
        expected = drafter.confidence(hidden, emb[a])
        atol = confidence_tolerance(drafter.confidence, max(float(hidden.abs().max()), float(emb[a].abs().max())), 4,
                                    sides=2)
        torch.testing.assert_close(torch.sigmoid(conf[a]), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_greedy_chains_equal_the_serving_chain(tiny: Tiny, kind: str):
    drafter = drafter_for(tiny, markov_head_type=kind, draft_vocab_size=60, seed=4)
    seqs = tiny.heldout[:3]
    anchors = [spread_anchors(s, 4, 4) for s in seqs]
    batch = make_batch(seqs, anchors, 4)
    rows = forward_blocks(drafter, batch)
    drafted, conf = greedy_chains(drafter, rows, batch.anchor_tokens)
    for a in range(batch.num_anchors):
        chain = draft_chain(rows.base_logits[a], rows.hidden_pre[a], rows.hidden_post[a],
                            int(batch.anchor_tokens[a]), drafter.markov, drafter.confidence, drafter.d2t,
                            kernel="torch")
        assert drafted[a].tolist() == chain.tokens
        atol = chain_tolerances(rows.base_logits[a], drafter.markov, drafter.confidence, rows.hidden_pre[a],
                                rows.hidden_post[a], sides=2)[1]
        torch.testing.assert_close(torch.sigmoid(conf[a]), chain.confidences, atol=atol, rtol=0)
    accepted = accepted_lengths(drafted, batch.labels, batch.valid)
    for a in range(batch.num_anchors):
        n = 0
        while n < 4 and drafted[a, n] == batch.labels[a, n]:
            n += 1
        assert int(accepted[a]) == n


def test_warm_start_copies_the_targets_last_layers(tiny: Tiny):
    counts = torch.bincount(torch.cat([s.generated for s in tiny.train]), minlength=VOCAB)
    vocab = DraftVocab(counts.topk(32).indices.sort().values, VOCAB)
    drafter = init_drafter(tiny.model, vocab, num_layers=2, block_size=4, markov_rank=8, mask_token_id=0)
    c = drafter.config
    assert c.target_layer_ids == default_layer_ids(4, 2) == (1,)
    target = tiny.model.state_dict()
    for i, layer in enumerate(drafter.layers):
        for name, t in layer.state_dict().items():
            theirs = target.get(f"layers.{2 + i}.{name}")
            if theirs is None:  # llama has no q/k norm: identity weights
                assert name.endswith(("q_norm.weight", "k_norm.weight")) and bool((t == 1).all())
            else:
                assert torch.equal(t, theirs), name
    assert torch.equal(drafter.fc.weight, torch.eye(32))
    assert torch.equal(drafter.hidden_norm.weight, target["layers.2.attention_norm.weight"])
    assert torch.equal(drafter.norm.weight, target["norm.weight"])
    assert torch.equal(drafter.lm_head.weight, target["tok_embeddings.weight"][vocab.draft_to_target])
    assert torch.equal(torch.arange(32) + drafter.d2t, vocab.draft_to_target)
    assert float(drafter.markov.w2.weight.abs().max()) == 0.0
    assert float(drafter.confidence.proj.weight.abs().max()) == 0.0
    assert default_layer_ids(30, 2) == (1, 27) and default_layer_ids(30, 1) == (1, 28)
