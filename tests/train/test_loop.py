"""Training: the loss goes down, runs are deterministic, a resumed run equals an uninterrupted one, and the saved
checkpoint loads for inference with the same outputs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.formats.drafter_formats import load_drafter, save_drafter
from dspark_grpc.train import loop
from dspark_grpc.train.calibrate import apply_temperatures
from dspark_grpc.train.loop import (
    DRAFTER_DIR,
    TrainSettings,
    batch_for_step,
    batch_loss,
    budgeted,
    evaluate,
    lr_at,
    suggest_block_size,
    train,
)
from dspark_grpc.train.model import anchor_range, decoded_steps, init_drafter, trainable_parameters
from dspark_grpc.train.vocab import build_draft_vocab, token_counts

from .conftest import VOCAB, Tiny

SETTINGS = TrainSettings(steps=6, batch=4, anchors=4, lr=3e-3, eval_every=3, eval_anchors=4, seed=1)


def make(tiny: Tiny, seed: int = 0):
    vocab = build_draft_vocab(token_counts((s.generated for s in tiny.train), VOCAB), 48, always=[2])
    drafter = init_drafter(tiny.model, vocab, num_layers=1, block_size=4, markov_rank=8, mask_token_id=0, seed=seed)
    return drafter, vocab.t2d


def params(drafter) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in drafter.named_parameters()}


def test_a_few_steps_reduce_the_loss(tiny: Tiny):
    drafter, t2d = make(tiny)
    batch = batch_for_step(tiny.train, 0, SETTINGS, 4)
    opt = torch.optim.AdamW([p for _, p in trainable_parameters(drafter)], lr=3e-3)
    losses = []
    for _ in range(15):
        terms = batch_loss(drafter, batch, t2d, SETTINGS.losses)
        opt.zero_grad()
        terms.total.backward()
        opt.step()
        losses.append(float(terms.total.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    assert drafter.embed.weight.grad is None and drafter.lm_head.weight.grad is None  # the target's tables stay


def test_a_time_budget_sets_the_steps_from_the_measured_rate():
    base = TrainSettings(steps=10_000, time_budget=100.0)
    # 30 steps took 3 s: 0.1 s a step; 85 s of the budget's 100 (15 % spare) minus the 3 s spent = 820 steps more
    assert budgeted(base, 30, 3.0, 30).steps == 30 + 820
    assert budgeted(TrainSettings(steps=500, time_budget=100.0), 30, 3.0, 30).steps == 500  # never more than asked
    assert budgeted(base, 30, 120.0, 30).steps == 31  # over budget already: one last step (it evaluates and saves)


def test_training_under_a_time_budget_ends_with_an_evaluation(tiny: Tiny, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(loop, "PROBE_STEPS", 2)
    drafter, t2d = make(tiny)
    spent = TrainSettings(**{**SETTINGS.__dict__, "steps": 50, "eval_every": 0, "time_budget": 1e-9})
    history = train(drafter, tiny.train, tiny.heldout, t2d, spent, out_dir=tmp_path, progress=None)
    assert [h.step for h in history] == [3]  # 2 probe steps, then the budget (long spent) allows one more
    assert loop.load_state(tmp_path)["step"] == 3
    ample = TrainSettings(**{**SETTINGS.__dict__, "time_budget": 1e9})
    assert [h.step for h in train(make(tiny)[0], tiny.train, tiny.heldout, t2d, ample, progress=None)] == [3, 6]


def test_training_is_deterministic_and_resume_equals_an_uninterrupted_run(tiny: Tiny, tmp_path: Path):
    a, t2d = make(tiny)
    history = train(a, tiny.train, tiny.heldout, t2d, SETTINGS, out_dir=tmp_path / "a", progress=None)
    assert [h.step for h in history] == [3, 6]
    again, _ = make(tiny)
    train(again, tiny.train, tiny.heldout, t2d, SETTINGS, progress=None)
    for name, p in params(a).items():
        assert torch.equal(p, params(again)[name]), name
    other, _ = make(tiny)
    train(other, tiny.train, tiny.heldout, t2d, TrainSettings(**{**SETTINGS.__dict__, "seed": 2}), progress=None)
    assert not torch.equal(params(a)["layers.0.attention.wq.weight"], params(other)["layers.0.attention.wq.weight"])
    # interrupted after step 4, then resumed from its checkpoint in a fresh process (a fresh drafter)
    first, _ = make(tiny)
    train(first, tiny.train, tiny.heldout, t2d, SETTINGS, out_dir=tmp_path / "b", until=4, progress=None)
    resumed, _ = make(tiny)
    tail = train(resumed, tiny.train, tiny.heldout, t2d, SETTINGS, out_dir=tmp_path / "b", resume=True,
                 progress=None)
    for name, p in params(a).items():
        assert torch.equal(p, params(resumed)[name]), name
    assert tail[-1] == history[-1]


def test_saved_checkpoint_serves_the_trained_weights(tiny: Tiny, tmp_path: Path):
    drafter, t2d = make(tiny)
    train(drafter, tiny.train, tiny.heldout, t2d, TrainSettings(**{**SETTINGS.__dict__, "steps": 2}),
          out_dir=tmp_path, progress=None)
    apply_temperatures(drafter, [1.5, 1.0, 0.8, 0.5])
    save_drafter(drafter, tmp_path / DRAFTER_DIR, layout="speculators")
    loaded = load_drafter(tmp_path / DRAFTER_DIR, target_path=tiny.path)
    assert loaded.config == drafter.config
    seq = tiny.heldout[0]
    outs = []
    for d in (drafter, loaded):
        ctx = d.new_context()
        ctx.append(seq.features[:6].float(), 0)
        outs.append(d.forward_block(ctx, int(seq.tokens[6])))
    torch.testing.assert_close(outs[0].base_logits, outs[1].base_logits, atol=0, rtol=0)
    assert torch.equal(loaded.d2t, drafter.d2t)


def test_evaluation_metrics_are_consistent(tiny: Tiny):
    drafter, t2d = make(tiny)
    result, chains = evaluate(drafter, tiny.heldout, SETTINGS, t2d)
    pp = result.per_position
    assert all(a >= b for a, b in zip(pp, pp[1:], strict=False))
    assert result.acceptance_length == pytest.approx(1 + sum(pp))
    assert chains.accepted.shape == (result.anchors,) and chains.confidence_logits.shape == (result.anchors, 4)
    assert result.conditional[1] == pytest.approx(pp[1] / pp[0] if pp[0] else 0.0)
    assert suggest_block_size([0.6, 0.3, 0.05, 0.01]) == 3 and suggest_block_size([0.0, 0.0]) == 1
    long = TrainSettings(steps=100, lr=1.0, warmup=0.04)
    assert [lr_at(s, long) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert 1.0 > lr_at(50, long) > lr_at(99, long) >= 0.1


def test_decoding_walks_the_anchors_a_step_lands_on():
    """By hand: at 0 two drafts are accepted (3 tokens, next anchor 3), at 3 none (1 token), at 4 three (4 tokens), at 8
    one (2 tokens), then past the last anchor: 10 tokens in 4 steps. The anchors skipped (1, 2, 5-7) do not count,
    where the mean over every anchor would count them alike."""
    accepted = {0: 2, 1: 3, 2: 3, 3: 0, 4: 3, 5: 0, 6: 0, 7: 0, 8: 1}
    assert decoded_steps(accepted, 0, 8) == (10, 4)
    assert decoded_steps(accepted, 5, 8) == (5, 4)
    assert decoded_steps(accepted, 9, 8) == (0, 0)


def test_evaluation_walks_the_sequences_whose_every_anchor_it_drafted(tiny: Tiny):
    drafter, t2d = make(tiny)
    sparse, _ = evaluate(drafter, tiny.heldout, SETTINGS, t2d)
    dense, chains = evaluate(drafter, tiny.heldout, dataclasses.replace(SETTINGS, eval_anchors=10_000), t2d)
    assert sparse.decoded_length is None  # 4 anchors per sequence cover none of them
    greedy = [s for s in tiny.heldout if s.mode == "greedy"]
    tokens = steps = 0
    for i, seq in enumerate(greedy):  # the walk by hand over the accepted lengths evaluate drafted
        first, last = anchor_range(seq, 4, full_blocks=True)
        mine = chains.accepted[chains.sequence == i].tolist()
        assert len(mine) == last - first + 1
        p = first
        while p <= last:
            tokens, steps, p = tokens + mine[p - first] + 1, steps + 1, p + mine[p - first] + 1
    assert dense.decoded_length == pytest.approx(tokens / steps)
    assert 1.0 <= dense.decoded_length <= 5.0 and "as decoded" in dense.line()
