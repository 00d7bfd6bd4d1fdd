"""Confidence head: its input ([h ; W1[prev]] or h), which hidden state it reads, per-position calibration."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.drafting.markov import ConfidenceHead, draft_chain

from .reference import chain_tolerances, confidence_tolerance
from .test_markov_chain import H, R, fused, make_heads, make_inputs, needs_triton

PATHS = ["torch", "fused"]


def run(path: str, *args):
    if path == "fused":
        needs_triton()
        return fused(*args)
    return draft_chain(*args, kernel="torch")


def manual_logits(conf: ConfidenceHead, hidden: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor:
    x = hidden if emb is None else torch.cat([hidden, emb], dim=-1)
    return x @ conf.proj.weight[0] + conf.proj.bias[0]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("with_markov", [True, False])
def test_input_is_hidden_then_markov_embedding(path: str, with_markov: bool):
    markov, conf = make_heads(with_markov=with_markov, seed=6)
    u, h_pre, h_post = make_inputs(6)
    chain = run(path, u, h_pre, h_post, 13, markov, conf, None)
    prevs = [13, *chain.tokens[:-1]]
    emb = markov.w1.weight[prevs] if with_markov else None
    atol = chain_tolerances(u, markov, conf, h_pre, h_post, sides=2)[1]
    torch.testing.assert_close(chain.confidences, torch.sigmoid(manual_logits(conf, h_post, emb)), atol=atol, rtol=0)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pre_norm", [True, False])
def test_reads_pre_or_post_norm_hidden(path: str, pre_norm: bool):
    markov, conf = make_heads(pre_norm=pre_norm, seed=7)
    u, h_pre, h_post = make_inputs(7)
    chain = run(path, u, h_pre, h_post, 2, markov, conf, None)
    emb = markov.w1.weight[[2, *chain.tokens[:-1]]]
    expected = torch.sigmoid(manual_logits(conf, h_pre if pre_norm else h_post, emb))
    atol = chain_tolerances(u, markov, conf, h_pre, h_post, sides=2)[1]
    torch.testing.assert_close(chain.confidences, expected, atol=atol, rtol=0)
    # the vanilla chain itself ignores both hidden states
    moved = run(path, u, h_pre + 5 * pre_norm, h_post + 5 * (not pre_norm), 2, markov, conf, None)
    assert moved.tokens == chain.tokens
    assert not torch.allclose(moved.confidences, chain.confidences, rtol=0, atol=atol)


@pytest.mark.parametrize("path", PATHS)
def test_calibration_temperature_per_position(path: str):
    temps = [0.5, 2.0, 4.0]
    markov, conf = make_heads(seed=8, temperatures=temps)
    u, h_pre, h_post = make_inputs(8, k=5)
    chain = run(path, u, h_pre, h_post, 4, markov, conf, None)
    logits = conf.logits(h_post, markov.w1.weight[[4, *chain.tokens[:-1]]])
    t = torch.tensor([0.5, 2.0, 4.0, 4.0, 4.0])  # positions past the table use its last entry
    atol = chain_tolerances(u, markov, conf, h_pre, h_post, sides=2)[1]
    torch.testing.assert_close(chain.confidences, torch.sigmoid(logits / t), atol=atol, rtol=0)


def test_module_forward_and_start_offset():
    conf = ConfidenceHead(H, R, False, True, [1.0, 3.0])
    h = torch.randn(4, H)
    logits = conf.logits(h)
    atol = confidence_tolerance(conf, float(h.abs().max()), 4, sides=2)
    torch.testing.assert_close(conf(h), torch.sigmoid(logits / torch.tensor([1.0, 3.0, 3.0, 3.0])), atol=atol, rtol=0)
    torch.testing.assert_close(conf(h, start=1), torch.sigmoid(logits / 3.0), atol=atol, rtol=0)
    plain = ConfidenceHead(H, R, False, True)
    atol = confidence_tolerance(plain, float(h.abs().max()), 4, sides=2)
    torch.testing.assert_close(plain(h), torch.sigmoid(plain.logits(h)), atol=atol, rtol=0)  # no table: T = 1
    assert conf.select_hidden(h, h + 1) is h


@pytest.mark.parametrize("temps", [[], [0.0], [1.0, -2.0], [float("inf")]])
def test_bad_temperatures(temps: list[float]):
    with pytest.raises(ValueError, match="temperatures"):
        ConfidenceHead(H, R, True, False, temps)


def test_no_confidence_head_gives_none():
    markov, _ = make_heads()
    u, h_pre, h_post = make_inputs()
    assert draft_chain(u, h_pre, h_post, 1, markov, None, kernel="torch").confidences is None
