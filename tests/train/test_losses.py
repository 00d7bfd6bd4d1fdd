"""Loss pieces against dense, slow computations over the whole target vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dspark_grpc.runtime.train.losses import (
    LossWeights,
    argmax_ce,
    dspark_loss,
    kl_divergence,
    position_weights,
    soft_acceptance,
    teacher_probs,
    tv_distance,
)
from dspark_grpc.runtime.train.vocab import DraftVocab

V, K_TOP = 20, 5


def setup(seed: int, A: int = 3, K: int = 4, draft_size: int = 12):
    g = torch.Generator().manual_seed(seed)
    vocab = DraftVocab(torch.randperm(V, generator=g)[:draft_size].sort().values, V)
    logits = torch.randn(A, K, draft_size, generator=g) * 2
    target_logits = torch.randn(A, K, V, generator=g) * 2
    values, ids = target_logits.topk(K_TOP, dim=-1)
    return vocab, logits, values, ids


def dense(vocab: DraftVocab, logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor):
    """p_d and p_t as [..., V] over target ids (p_t: top-k renormalised, 0 elsewhere)."""
    p_d = torch.zeros(*logits.shape[:-1], V).index_copy(-1, vocab.draft_to_target, logits.softmax(-1))
    p_t = torch.zeros(*values.shape[:-1], V).scatter(-1, ids, values.softmax(-1))
    return p_d, p_t


def test_position_weights():
    torch.testing.assert_close(position_weights(4, 2.0), torch.tensor([math.exp(-k / 2) for k in range(4)]))


def test_tv_soft_label_kl_ce_match_dense_computations():
    vocab, logits, values, ids = setup(0)
    log_pd = logits.log_softmax(-1)
    p_t, draft_ids = teacher_probs(values, ids, vocab.t2d)
    dense_d, dense_t = dense(vocab, logits, values, ids)
    assert ((draft_ids < 0).any()), "some teacher ids must fall outside the draft vocabulary"
    tv = 0.5 * (dense_d - dense_t).abs().sum(-1)
    torch.testing.assert_close(tv_distance(log_pd, p_t, draft_ids), tv, atol=1e-6, rtol=0)
    torch.testing.assert_close(soft_acceptance(log_pd, p_t, draft_ids), torch.minimum(dense_d, dense_t).sum(-1),
                               atol=1e-6, rtol=0)
    # KL against p_t restricted to the draft vocabulary and renormalised
    in_draft = torch.zeros(V, dtype=torch.bool).index_fill(0, vocab.draft_to_target, True)
    q = dense_t * in_draft
    q = q / q.sum(-1, keepdim=True)
    kl = torch.where(q > 0, q * (q.log() - dense_d.clamp_min(1e-30).log()), torch.zeros(())).sum(-1)
    got, defined = kl_divergence(log_pd, p_t, draft_ids)
    assert defined.all()
    torch.testing.assert_close(got, kl, atol=1e-5, rtol=1e-5)
    ce, ce_defined = argmax_ce(log_pd, ids, vocab.t2d)
    top = ids[..., 0]
    torch.testing.assert_close(ce_defined, in_draft[top])
    expected = torch.where(in_draft[top], -dense_d.gather(-1, top[..., None]).squeeze(-1).log(), torch.zeros(()))
    torch.testing.assert_close(ce, expected, atol=1e-5, rtol=1e-5)


def test_kl_undefined_when_no_teacher_id_is_drafted():
    vocab = DraftVocab(torch.tensor([0, 1]), 6)
    log_pd = torch.zeros(1, 2).log_softmax(-1)
    p_t, draft_ids = teacher_probs(torch.tensor([[1.0, 0.5]]), torch.tensor([[4, 5]]), vocab.t2d)
    kl, defined = kl_divergence(log_pd, p_t, draft_ids)
    assert not defined.any() and float(kl[0]) == 0.0
    assert float(tv_distance(log_pd, p_t, draft_ids)[0]) == pytest.approx(1.0)


def test_full_loss_is_the_position_weighted_mean_of_each_term():
    vocab, logits, values, ids = setup(1, A=4, K=3)
    conf = torch.randn(4, 3, generator=torch.Generator().manual_seed(5))
    valid = torch.ones(4, 3, dtype=torch.bool)
    valid[2, 1:] = False
    valid[3, 2] = False
    w = LossWeights(ce=0.3, tv=0.5, kl=0.2, confidence=0.7, gamma=2.0)
    terms = dspark_loss(logits, conf, values, ids, valid, vocab.t2d, w)
    log_pd = logits.log_softmax(-1)
    p_t, draft_ids = teacher_probs(values, ids, vocab.t2d)
    pw = position_weights(3, 2.0)[None] * valid
    c_star = soft_acceptance(log_pd, p_t, draft_ids)
    tv = ((1 - c_star) * pw).sum() / pw.sum()
    kl_v, kl_d = kl_divergence(log_pd, p_t, draft_ids)
    kl = (kl_v * pw * kl_d).sum() / (pw * kl_d).sum()
    ce_v, ce_d = argmax_ce(log_pd, ids, vocab.t2d)
    ce = (ce_v * pw * ce_d).sum() / (pw * ce_d).sum()
    bce = (F.binary_cross_entropy(torch.sigmoid(conf), c_star, reduction="none") * pw).sum() / pw.sum()
    for name, value in (("tv", tv), ("kl", kl), ("ce", ce), ("bce", bce)):
        torch.testing.assert_close(getattr(terms, name), value, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(terms.total, 0.3 * ce + 0.5 * tv + 0.2 * kl + 0.7 * bce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(terms.soft_acceptance, c_star)
    # invalid slots do not count
    moved = logits.clone()
    moved[2, 1:] += torch.randn(2, logits.shape[-1])
    assert float(dspark_loss(moved, conf, values, ids, valid, vocab.t2d, w).total) == pytest.approx(float(terms.total))


def test_soft_label_is_detached_for_the_confidence_loss():
    vocab, logits, values, ids = setup(2)
    logits.requires_grad_(True)
    conf = torch.zeros(3, 4, requires_grad=True)
    terms = dspark_loss(logits, conf, values, ids, torch.ones(3, 4, dtype=torch.bool), vocab.t2d,
                        LossWeights(ce=0.0, tv=0.0, kl=0.0, confidence=1.0))
    terms.total.backward()
    assert logits.grad is None or float(logits.grad.abs().max()) == 0.0
    # BCE pulls sigmoid(l) towards c*: the gradient is sigmoid(l) - c*, position-weighted
    pw = position_weights(4, 4.0).expand(3, 4)
    torch.testing.assert_close(conf.grad, (0.5 - terms.soft_acceptance) * pw / pw.sum(), atol=1e-6, rtol=0)
