"""Loss pieces against dense, slow computations over the whole target vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dspark_grpc.train.losses import (
    LossWeights,
    argmax_ce,
    dspark_loss,
    kl_divergence,
    position_weights,
    soft_acceptance,
    teacher_probs,
    tv_distance,
)
from dspark_grpc.train.vocab import DraftVocab
from tolerance import gamma, log_softmax_error, softmax_error, unit_roundoff

V, K_TOP = 20, 5
U = unit_roundoff()


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


def bounds(logits: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
    """One float32 computation's error bounds of the loss pieces (tests/tolerance.py): p_d, p_t relative (each
    probability of a softmax), log p_d absolute, and c* = sum min(p_d, p_t) (<= 1, V terms); tv = 1 - c*."""
    z_d, z_t = float(logits.abs().max()), float(values.abs().max())
    p_d, p_t = softmax_error(logits.shape[-1], z_d), softmax_error(K_TOP, z_t)
    log_pd = max(log_softmax_error(logits.shape[-1], z_d), p_d)
    c_star = max(p_d, p_t) + gamma(V)
    return {"p_d": p_d, "p_t": p_t, "log_pd": log_pd, "c_star": c_star, "tv": c_star + U}


def kl_bound(b: dict[str, float], q: torch.Tensor, log_pd: torch.Tensor) -> float:
    """KL(q || p_d) = sum q (log q - log p_d): q renormalised (p_t's error, a sum of <= 5 and a divide), log q and
    log p_d each off by their relative/absolute errors plus u |log|, the sum over <= 5 terms (gamma_6) of q L."""
    support = q > 0
    log_q = q.clamp_min(1e-30).log()
    spread = float(((log_q - log_pd).abs() + log_q.abs())[support].max())
    q_error = b["p_t"] + gamma(6)
    return (q_error + gamma(6) + 2 * U) * (1 + spread) + b["log_pd"]


def test_position_weights():
    # exp(-k / 2): a divide and exp (<= 1 ulp) in float32, against float64 rounded to float32
    torch.testing.assert_close(position_weights(4, 2.0), torch.tensor([math.exp(-k / 2) for k in range(4)]),
                               rtol=gamma(4), atol=0)


def test_tv_soft_label_kl_ce_match_dense_computations():
    vocab, logits, values, ids = setup(0)
    log_pd = logits.log_softmax(-1)
    p_t, draft_ids = teacher_probs(values, ids, vocab.t2d)
    dense_d, dense_t = dense(vocab, logits, values, ids)
    assert ((draft_ids < 0).any()), "some teacher ids must fall outside the draft vocabulary"
    tv = 0.5 * (dense_d - dense_t).abs().sum(-1)
    b = bounds(logits, values)
    torch.testing.assert_close(tv_distance(log_pd, p_t, draft_ids), tv, atol=2 * b["tv"], rtol=0)
    torch.testing.assert_close(soft_acceptance(log_pd, p_t, draft_ids), torch.minimum(dense_d, dense_t).sum(-1),
                               atol=2 * b["c_star"], rtol=0)
    # KL against p_t restricted to the draft vocabulary and renormalised
    in_draft = torch.zeros(V, dtype=torch.bool).index_fill(0, vocab.draft_to_target, True)
    q = dense_t * in_draft
    q = q / q.sum(-1, keepdim=True)
    kl = torch.where(q > 0, q * (q.log() - dense_d.clamp_min(1e-30).log()), torch.zeros(())).sum(-1)
    got, defined = kl_divergence(log_pd, p_t, draft_ids)
    assert defined.all()
    torch.testing.assert_close(got, kl, atol=2 * kl_bound(b, q, dense_d.clamp_min(1e-30).log()), rtol=0)
    ce, ce_defined = argmax_ce(log_pd, ids, vocab.t2d)
    top = ids[..., 0]
    torch.testing.assert_close(ce_defined, in_draft[top])
    expected = torch.where(in_draft[top], -dense_d.gather(-1, top[..., None]).squeeze(-1).log(), torch.zeros(()))
    # -log_softmax against -log(softmax): each side's log p_d bound, and the log's rounding
    torch.testing.assert_close(ce, expected, atol=2 * b["log_pd"] + U * float(expected.abs().max()), rtol=0)


def test_kl_undefined_when_no_teacher_id_is_drafted():
    vocab = DraftVocab(torch.tensor([0, 1]), 6)
    log_pd = torch.zeros(1, 2).log_softmax(-1)
    p_t, draft_ids = teacher_probs(torch.tensor([[1.0, 0.5]]), torch.tensor([[4, 5]]), vocab.t2d)
    kl, defined = kl_divergence(log_pd, p_t, draft_ids)
    assert not defined.any() and float(kl[0]) == 0.0
    # disjoint supports: exactly 1 in exact arithmetic, here within the float32 bound of c* (0) and 1 - c*
    b = bounds(torch.zeros(1, 2), torch.tensor([[1.0, 0.5]]))
    assert float(tv_distance(log_pd, p_t, draft_ids)[0]) == pytest.approx(1.0, abs=b["tv"])


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
    # per element: tv's and kl's bounds, ce's -log p_d, bce's log sigmoid terms (gamma_4 (1 + e^|l|): log(1 - s)
    # cancels) plus c*'s error times |log s - log(1 - s)| = |l|; a weighted mean adds gamma_{2n} of its largest term
    b = bounds(logits, values)
    q = (p_t * (draft_ids >= 0)) / (p_t * (draft_ids >= 0)).sum(-1, keepdim=True)
    l_max = float(conf.abs().max())
    per_element = {"tv": b["tv"], "kl": kl_bound(b, q, log_pd.gather(-1, draft_ids.clamp(min=0))),
                   "ce": b["log_pd"], "bce": l_max * b["c_star"] + gamma(4) * (1 + math.exp(l_max))}
    mean = gamma(2 * conf.numel())
    atol = {name: 2 * (per_element[name] + mean * float(abs(value))) for name, value in
            (("tv", tv), ("kl", kl), ("ce", ce), ("bce", bce))}
    for name, value in (("tv", tv), ("kl", kl), ("ce", ce), ("bce", bce)):
        torch.testing.assert_close(getattr(terms, name), value, atol=atol[name], rtol=0, msg=name)
    weighted = {"ce": 0.3, "tv": 0.5, "kl": 0.2, "bce": 0.7}
    total = 0.3 * ce + 0.5 * tv + 0.2 * kl + 0.7 * bce
    atol_total = sum(w * atol[name] for name, w in weighted.items()) + 2 * gamma(8) * float(total.abs())
    torch.testing.assert_close(terms.total, total, atol=atol_total, rtol=0)
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
    expected = (0.5 - terms.soft_acceptance) * pw / pw.sum()
    # (sigmoid(0) - c*) w / sum w both ways in float32: a subtraction, a product, a sum of 12 and a divide each
    torch.testing.assert_close(conf.grad, expected, atol=2 * gamma(15) * float(expected.abs().max()), rtol=0)
