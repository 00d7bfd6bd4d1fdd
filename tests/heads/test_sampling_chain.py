"""Sampling mode (temperature > 0): seeded reproducibility and x_0 ~ softmax(Z_0 / T)."""

from __future__ import annotations

import torch
from dspark_grpc.runtime.drafting.markov import ConfidenceHead, MarkovHead, draft_chain
from tolerance import log_softmax_error

from .reference import z_bound

V_T, V_D, R, H = 9, 5, 4, 6


def tiny_heads() -> tuple[MarkovHead, ConfidenceHead]:
    torch.manual_seed(11)
    return MarkovHead("vanilla", V_T, V_D, R, H).requires_grad_(False), ConfidenceHead(H, R, True, False)


def test_seeded_sampling_is_reproducible():
    markov, conf = tiny_heads()
    u, h = torch.randn(6, V_D), torch.randn(6, H)

    def chain(seed: int):
        return draft_chain(u, h, h, 2, markov, conf, temperature=1.3, generator=torch.Generator().manual_seed(seed))

    a, b = chain(123), chain(123)
    assert a.tokens == b.tokens
    torch.testing.assert_close(a.logprobs, b.logprobs)
    torch.testing.assert_close(a.confidences, b.confidences)
    assert len({tuple(chain(s).tokens) for s in range(20)}) > 1


def test_first_token_frequencies_match_softmax_of_corrected_logits():
    markov, _ = tiny_heads()
    temperature, n = 0.8, 4000
    u, h = torch.randn(1, V_D), torch.randn(1, H)
    z0 = u[0] + markov.w2.weight @ markov.w1.weight[7]
    want = torch.softmax(z0 / temperature, -1)
    assert want.max() < 0.9
    # log_softmax of the chain's Z / T against log(softmax(z0 / T)): each side's log-softmax bound, Z's error / T
    z_max, z_error = z_bound(u, markov, h)
    atol = 2 * log_softmax_error(V_D, z_max / temperature, z_error / temperature)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V_D)
    for _ in range(n):
        chain = draft_chain(u, h, h, 7, markov, None, temperature=temperature, generator=g)
        counts[chain.tokens[0]] += 1
        torch.testing.assert_close(chain.logprobs[0], want[chain.tokens[0]].log(), atol=atol, rtol=0)
    assert (counts / n - want).abs().max() < 0.03  # ~4 standard errors at n = 4000


def test_sampling_maps_through_d2t_and_feeds_the_target_id_forward():
    markov, _ = tiny_heads()
    d2t = torch.tensor([0, 1, 2, 3, 4])  # target = draft + offset
    u = torch.full((2, V_D), -1e4)
    u[0, 1] = 0.0  # slot 0 can only draw draft id 1 -> target id 2
    u[1] = 0.0
    chain = draft_chain(u, torch.zeros(2, H), torch.zeros(2, H), 0, markov, None, d2t, temperature=1.0,
                        generator=torch.Generator().manual_seed(1))
    assert chain.tokens[0] == 2
    want = torch.log_softmax(u[1] + markov.w2.weight @ markov.w1.weight[2], -1)[chain.tokens[1] // 2]
    z_max, z_error = z_bound(u[1:], markov, torch.zeros(1, H))
    torch.testing.assert_close(chain.logprobs[1], want, atol=2 * log_softmax_error(V_D, z_max, z_error), rtol=0)
