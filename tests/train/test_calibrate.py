"""Confidence calibration: ECE, the left-to-right temperature fit, temperatures stored with the drafter."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.drafter_config import drafter_config_from_hf
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter, save_drafter
from dspark_grpc.runtime.formats.safetensors_reader import read_hf_config
from dspark_grpc.train.calibrate import (
    apply_temperatures,
    ece,
    fit_temperatures,
    survival,
    survival_ece,
    survival_labels,
    validated_temperatures,
)
from heads.reference import confidence_tolerance
from tolerance import gamma

from .conftest import tiny_config


def test_ece_by_hand():
    probs = torch.tensor([0.05, 0.15, 0.55, 0.65, 0.95])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    # bins of width 0.5: {0.05, 0.15} mean 0.1 vs 0.5; {0.55, 0.65, 0.95} mean 0.7167 vs 0.6667
    expected = 2 / 5 * abs(0.1 - 0.5) + 3 / 5 * abs((0.55 + 0.65 + 0.95) / 3 - 2 / 3)
    assert ece(probs, labels, bins=2) == pytest.approx(expected)
    assert ece(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), bins=10) == 0.0


def test_survival_and_labels():
    logits = torch.tensor([[0.0, 0.0, 2.0]])
    s = torch.sigmoid(torch.tensor([0.0, 0.0, 2.0]))
    # each side: a divide by T (u |l| / 4 through sigmoid, |l| <= 2), sigmoid (gamma_3), a product of 3 (gamma_2)
    torch.testing.assert_close(survival(logits), s.cumprod(0)[None], atol=2 * gamma(6), rtol=0)
    scaled = torch.sigmoid(torch.tensor([0.0, 0.0, 0.5])).cumprod(0)[None]
    torch.testing.assert_close(survival(logits, [1.0, 2.0, 4.0]), scaled, atol=2 * gamma(6), rtol=0)
    assert survival_labels(torch.tensor([0, 2, 3]), 3).tolist() == [[False] * 3, [True, True, False], [True] * 3]


def test_fit_lowers_the_ece_of_an_overconfident_head():
    g = torch.Generator().manual_seed(0)
    A, K = 4000, 4
    true_logits = torch.randn(A, K, generator=g) * 1.5 + 0.5
    accept = torch.rand(A, K, generator=g) < torch.sigmoid(true_logits)
    accepted = accept.long().cumprod(1).sum(1)
    raw = true_logits * 3.0  # three times too sharp
    temps = fit_temperatures(raw, accepted)
    before, after = survival_ece(raw, accepted), survival_ece(raw, accepted, temps)
    assert all(a < b for a, b in zip(after, before, strict=True)), (before, after)
    assert max(after) < 0.03 and 2.0 <= temps[0] <= 4.5
    # an already calibrated head keeps temperatures near 1
    assert 0.7 <= fit_temperatures(true_logits, accepted)[0] <= 1.4


def test_a_fitted_temperature_is_kept_only_where_it_helps_on_other_chains():
    """Position 0 fitted well (the head is 3x too sharp there), position 1 fitted far off the grid's middle (as a fit
    on a few late-position chains can land): the first is kept, the second falls back to 1."""
    g = torch.Generator().manual_seed(1)
    A, K = 4000, 2
    true_logits = torch.randn(A, K, generator=g) * 1.5 + 0.5
    accepted = (torch.rand(A, K, generator=g) < torch.sigmoid(true_logits)).long().cumprod(1).sum(1)
    raw = torch.stack([true_logits[:, 0] * 3.0, true_logits[:, 1]], dim=1)
    fitted = [3.0, 8.0]
    assert survival_ece(raw, accepted, [3.0, 8.0])[1] > survival_ece(raw, accepted, [3.0, 1.0])[1]  # 8 hurts here
    assert validated_temperatures(raw, accepted, fitted) == [3.0, 1.0]
    assert validated_temperatures(raw, accepted, [1.0, 1.0]) == [1.0, 1.0]


def test_temperatures_travel_with_the_drafter(tmp_path):
    drafter = init_random_drafter(tiny_config(), num_layers=1, target_layer_ids=(1,), markov_rank=4)
    apply_temperatures(drafter, [2.0, 1.5, 1.0, 0.5])
    h, e = torch.randn(4, 32), torch.randn(4, 4)
    atol = confidence_tolerance(drafter.confidence, max(float(h.abs().max()), float(e.abs().max())), 4, sides=2)
    torch.testing.assert_close(drafter.confidence(h, e),
                               torch.sigmoid(drafter.confidence.logits(h, e) / torch.tensor([2.0, 1.5, 1.0, 0.5])),
                               atol=atol, rtol=0)
    save_drafter(drafter, tmp_path / "d", layout="speculators")
    assert drafter_config_from_hf(read_hf_config(tmp_path / "d")).confidence_temperatures == (2.0, 1.5, 1.0, 0.5)
