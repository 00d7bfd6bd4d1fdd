"""Confidence calibration (STS, dspark_algorithm.md §3): c_k = sigmoid(l_k / T_k), one temperature per draft
position, fitted left to right by a 1-D grid search that minimises the ECE of the cumulative survival
a_j = prod_{i <= j} c_i against "the first j + 1 drafts were all accepted" on held-out chains, then each kept only
where it lowers that ECE on other held-out chains."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from dspark_grpc.runtime.models.drafter import Drafter
from torch import Tensor

DEFAULT_GRID = tuple(float(t) for t in torch.logspace(-3, 3, 49, base=2.0))  # 1/8 .. 8


def ece(probs: Tensor, labels: Tensor, bins: int = 15) -> float:
    """Expected calibration error: sum over equal-width bins of (bin share) * |mean prediction - mean label|."""
    p, y = probs.reshape(-1).double(), labels.reshape(-1).double()
    assert p.shape == y.shape and p.numel() > 0, (p.shape, y.shape)
    index = (p * bins).long().clamp(0, bins - 1)
    count = torch.bincount(index, minlength=bins).double()
    gap = torch.bincount(index, weights=p, minlength=bins) - torch.bincount(index, weights=y, minlength=bins)
    return float(gap.abs().sum() / count.sum())


def survival_labels(accepted: Tensor, num_slots: int) -> Tensor:
    """[A, K] bool: the first k + 1 drafts of each chain were accepted."""
    return accepted[:, None] >= torch.arange(1, num_slots + 1, device=accepted.device)[None, :]


def survival(confidence_logits: Tensor, temperatures: Sequence[float] | None = None) -> Tensor:
    """[A, K] a_j = prod_{i <= j} sigmoid(l_i / T_i) (T = 1 when None)."""
    K = confidence_logits.shape[1]
    t = torch.ones(K) if temperatures is None else torch.tensor(list(temperatures), dtype=torch.float32)
    assert t.shape == (K,), (t.shape, K)
    return torch.sigmoid(confidence_logits.float() / t.to(confidence_logits.device)).cumprod(dim=1)


def fit_temperatures(confidence_logits: Tensor, accepted: Tensor, grid: Sequence[float] = DEFAULT_GRID,
                     bins: int = 15) -> list[float]:
    """Per-position temperatures, left to right, each minimising the ECE of the survival up to its position given
    the temperatures already chosen (ties go to the temperature closest to 1)."""
    return _left_to_right(confidence_logits, accepted, [grid] * confidence_logits.shape[1], bins)


def validated_temperatures(confidence_logits: Tensor, accepted: Tensor, fitted: Sequence[float],
                           bins: int = 15) -> list[float]:
    """`fitted` (from other chains) checked on these chains, left to right: a position keeps its fitted temperature
    only where its survival's ECE is lower with it than with 1 (given the positions before it), else 1. A fit on few
    chains can land far out on the grid (the rare late positions) and miscalibrate what it was meant to fix."""
    assert len(fitted) == confidence_logits.shape[1], (len(fitted), confidence_logits.shape)
    return _left_to_right(confidence_logits, accepted, [(float(t), 1.0) for t in fitted], bins)


def _left_to_right(confidence_logits: Tensor, accepted: Tensor, options: Sequence[Sequence[float]],
                   bins: int) -> list[float]:
    """Per position k, the temperature among options[k] whose survival up to k has the lowest ECE, given those
    chosen before it (ties go to the one closest to 1)."""
    A, K = confidence_logits.shape
    assert accepted.shape == (A,) and A > 0 and len(options) == K, (accepted.shape, A, len(options), K)
    labels, logits = survival_labels(accepted, K), confidence_logits.float()
    prefix, temps = torch.ones(A, device=logits.device), []
    for k in range(K):
        candidates = sorted(options[k], key=lambda t: (abs(math.log(t)), t))
        scores = [ece(prefix * torch.sigmoid(logits[:, k] / t), labels[:, k], bins) for t in candidates]
        temps.append(candidates[min(range(len(candidates)), key=lambda i: (scores[i], i))])
        prefix = prefix * torch.sigmoid(logits[:, k] / temps[-1])
    return temps


def survival_ece(confidence_logits: Tensor, accepted: Tensor, temperatures: Sequence[float] | None = None,
                 bins: int = 15) -> list[float]:
    """Per-position ECE of the survival a_j against the acceptance of the first j + 1 drafts."""
    K = confidence_logits.shape[1]
    a, labels = survival(confidence_logits, temperatures), survival_labels(accepted, K)
    return [ece(a[:, k], labels[:, k], bins) for k in range(K)]


def apply_temperatures(drafter: Drafter, temperatures: Sequence[float]) -> None:
    """Store the temperatures in the drafter's config (saved to config.json) and in its confidence head."""
    if drafter.confidence is None:
        raise ValueError("the drafter has no confidence head to calibrate")
    temps = tuple(float(t) for t in temperatures)
    drafter.config = dataclasses.replace(drafter.config, confidence_temperatures=temps)
    device = drafter.confidence.proj.weight.device
    drafter.confidence.temperatures = torch.tensor(temps, dtype=torch.float32, device=device)
