"""DSpark training losses on teacher-forced blocks (dspark_algorithm.md §3, §3.1).

Per anchor a and draft slot k: p_d = softmax(Z_k) over the draft vocabulary, with Z_k the Markov-corrected logits
(previous token = the target's own continuation), and p_t = the target's distribution at that position.

The teacher is approximated by its top-k: p_t = softmax over the k stored logits, i.e. the top-k renormalised and
the tail set to 0 (the stored logsumexp says how much mass that drops; with k = 32 a chat model keeps most of it).
Target ids outside a reduced draft vocabulary keep their p_t mass: the drafter can never produce them, so they
count fully in TV and never in the soft label. KL needs p_t restricted to the draft vocabulary, renormalised.

- TV = 1/2 ||p_d - p_t||_1 = 1 - c*, with c* = sum_v min(p_d, p_t), the soft acceptance label (DeepSpec's L1 is 2 TV).
- KL(p_t || p_d).
- CE = -log p_d(argmax p_t), for slots whose target argmax is in the draft vocabulary.
- BCE(sigmoid(l_k), c*) for the confidence head, c* detached.
Each term is weighted by exp(-k / gamma) (k 0-based) over valid slots and normalised by the sum of those weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

_TINY = 1e-12


@dataclass(frozen=True)
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    kl: float = 0.0
    confidence: float = 1.0
    gamma: float = 4.0  # position decay: slot k weighs exp(-k / gamma)


@dataclass
class LossTerms:
    total: Tensor  # scalar: the weighted sum that is minimised
    ce: Tensor  # scalars: each term's position-weighted mean
    tv: Tensor
    kl: Tensor
    bce: Tensor
    soft_acceptance: Tensor  # [A, K] c*, detached


def position_weights(num_slots: int, gamma: float, device: torch.device | str | None = None) -> Tensor:
    """[K] exp(-k / gamma)."""
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32, device=device) / gamma)


def teacher_probs(topk_values: Tensor, topk_ids: Tensor, t2d: Tensor) -> tuple[Tensor, Tensor]:
    """(p_t [..., k] float32: softmax of the top-k logits, draft ids [..., k]: t2d of the target ids, -1 if absent)."""
    assert topk_values.shape == topk_ids.shape, (topk_values.shape, topk_ids.shape)
    return torch.softmax(topk_values.float(), dim=-1), t2d[topk_ids.long()]


def _draft_probs_at(log_pd: Tensor, draft_ids: Tensor) -> Tensor:
    """p_d at the teacher's ids [..., k], 0 where the id is outside the draft vocabulary."""
    inside = draft_ids >= 0
    return log_pd.gather(-1, draft_ids.clamp(min=0)).exp() * inside


def soft_acceptance(log_pd: Tensor, p_t: Tensor, draft_ids: Tensor) -> Tensor:
    """c* = sum_v min(p_d(v), p_t(v)) [...]: the chance that a token sampled from p_d is accepted against p_t."""
    return torch.minimum(_draft_probs_at(log_pd, draft_ids), p_t).sum(-1)


def tv_distance(log_pd: Tensor, p_t: Tensor, draft_ids: Tensor) -> Tensor:
    """1/2 ||p_d - p_t||_1 [...] over the union of both supports (p_t is 0 outside its top-k)."""
    return 1.0 - soft_acceptance(log_pd, p_t, draft_ids)


def kl_divergence(log_pd: Tensor, p_t: Tensor, draft_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(KL(p_t' || p_d) [...], defined [...] bool) with p_t' = p_t on the draft vocabulary, renormalised; undefined
    (and 0) where none of the teacher's top-k is in the draft vocabulary."""
    inside = draft_ids >= 0
    q = p_t * inside
    mass = q.sum(-1, keepdim=True)
    q = q / mass.clamp_min(_TINY)
    log_q = torch.where(q > 0, q.clamp_min(_TINY).log(), torch.zeros_like(q))
    kl = (q * (log_q - log_pd.gather(-1, draft_ids.clamp(min=0)))).masked_fill(~inside, 0.0).sum(-1)
    return kl, mass.squeeze(-1) > 0


def argmax_ce(log_pd: Tensor, topk_ids: Tensor, t2d: Tensor) -> tuple[Tensor, Tensor]:
    """(-log p_d(argmax p_t) [...], defined [...] bool: the target's argmax (top-k id 0) is in the draft vocab)."""
    label = t2d[topk_ids[..., 0].long()]
    inside = label >= 0
    return -log_pd.gather(-1, label.clamp(min=0)[..., None]).squeeze(-1) * inside, inside


def weighted_mean(values: Tensor, weights: Tensor) -> Tensor:
    return (values * weights).sum() / weights.sum().clamp_min(_TINY)


def dspark_loss(logits: Tensor, confidence_logits: Tensor | None, topk_values: Tensor, topk_ids: Tensor,
                valid: Tensor, t2d: Tensor, weights: LossWeights) -> LossTerms:
    """logits [A, K, V_d] Markov-corrected draft logits; confidence_logits [A, K] raw (uncalibrated) or None;
    topk_values/ids [A, K, k] the target's top-k at each slot's position; valid [A, K] bool; t2d [V]."""
    A, K, _ = logits.shape
    assert topk_values.shape[:2] == (A, K) and topk_ids.shape == topk_values.shape, topk_values.shape
    assert valid.shape == (A, K) and (confidence_logits is None or confidence_logits.shape == (A, K))
    log_pd = torch.log_softmax(logits.float(), dim=-1)
    p_t, draft_ids = teacher_probs(topk_values, topk_ids, t2d)
    w = position_weights(K, weights.gamma, logits.device)[None, :] * valid
    c_star = soft_acceptance(log_pd, p_t, draft_ids)
    tv = weighted_mean(1.0 - c_star, w)
    kl_values, kl_defined = kl_divergence(log_pd, p_t, draft_ids)
    kl = weighted_mean(kl_values, w * kl_defined)
    ce_values, ce_defined = argmax_ce(log_pd, topk_ids, t2d)
    ce = weighted_mean(ce_values, w * ce_defined)
    bce = torch.zeros((), device=logits.device)
    if confidence_logits is not None:
        target = c_star.detach()
        bce = weighted_mean(F.binary_cross_entropy_with_logits(confidence_logits.float(), target, reduction="none"), w)
    total = weights.ce * ce + weights.tv * tv + weights.kl * kl + weights.confidence * bce
    assert math.isfinite(float(total.detach())), "non-finite loss"
    return LossTerms(total, ce.detach(), tv.detach(), kl.detach(), bce.detach(), c_star.detach())
