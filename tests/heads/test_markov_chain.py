"""The Markov-corrected chain: Triton kernel (interpreter) == torch path == float64 reference loop."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from dspark_grpc.runtime.drafting.markov import (
    ConfidenceHead,
    KernelChoiceError,
    KernelUnavailable,
    MarkovHead,
    choose_kernel,
    draft_chain,
    markov_step,
)
from tolerance import gamma

from .reference import chain_tolerances, markov_v_error, reference_bias, reference_chain, reference_step, z_bound

K, V_D, V_T, R, H = 4, 300, 500, 8, 16  # vocab 300 with 128-wide tiles: the last tile is partly masked
TILE = 128


def needs_triton():
    pytest.importorskip("triton")


def make_heads(kind: str = "vanilla", with_markov: bool = True, pre_norm: bool = False, seed: int = 0,
               temperatures: list[float] | None = None) -> tuple[MarkovHead, ConfidenceHead]:
    torch.manual_seed(seed)
    markov = MarkovHead(kind, V_T, V_D, R, H).requires_grad_(False)
    conf = ConfidenceHead(H, R, with_markov, pre_norm, temperatures).requires_grad_(False)
    return markov, conf


def make_inputs(seed: int = 0, k: int = K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return 3 * torch.randn(k, V_D, generator=g), torch.randn(k, H, generator=g), torch.randn(k, H, generator=g)


def make_d2t(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randperm(V_T, generator=g)[:V_D].sort().values
    return targets - torch.arange(V_D)  # offsets: target = draft + d2t[draft]


def fused(*args, **kw):
    from dspark_grpc.runtime.drafting.markov import Chain
    from dspark_grpc.runtime.kernels.markov_triton import markov_chain_fused

    return Chain(*markov_chain_fused(*args, block_v=TILE, **kw))


def assert_same_chain(a, b, tolerances: tuple[float, float]) -> None:
    """The same tokens, log-probs and confidences within (log-prob, confidence) tolerances (`chain_tolerances`)."""
    assert a.tokens == b.tokens
    torch.testing.assert_close(a.logprobs.double(), b.logprobs.double(), atol=tolerances[0], rtol=0)
    if b.confidences is None:
        assert a.confidences is None
    else:
        torch.testing.assert_close(a.confidences.double(), b.confidences.double(), atol=tolerances[1], rtol=0)


def test_parameter_names_and_shapes():
    names = {kind: {k: tuple(v.shape) for k, v in MarkovHead(kind, V_T, V_D, R, H).state_dict().items()}
             for kind in ("vanilla", "gated", "rnn")}
    assert names["vanilla"] == {"w1.weight": (V_T, R), "w2.weight": (V_D, R)}
    assert names["gated"] == {**names["vanilla"], "gate_proj.weight": (R, H + R), "gate_proj.bias": (R,)}
    assert names["rnn"] == {**names["vanilla"], "joint_proj.weight": (3 * R, 2 * R + H), "joint_proj.bias": (3 * R,)}
    conf = ConfidenceHead(H, R, True, False, [1.0, 2.0])
    assert {k: tuple(v.shape) for k, v in conf.state_dict().items()} == {"proj.weight": (1, H + R), "proj.bias": (1,)}
    assert ConfidenceHead(H, R, False, False).proj.in_features == H
    with pytest.raises(ValueError, match="kind"):
        MarkovHead("lstm", V_T, V_D, R, H)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_batched_markov_step_equals_reference(kind: str):
    markov, _ = make_heads(kind, seed=7)
    g = torch.Generator().manual_seed(7)
    A, steps = 3, 3
    base, hidden = torch.randn(steps, A, V_D, generator=g), torch.randn(steps, A, H, generator=g)
    prev = torch.randint(V_T, (steps, A), generator=g)
    state, ref_states = None, [[0.0] * R for _ in range(A)]
    for k in range(steps):
        z, e, new_state = markov_step(markov, base[k], prev[k], hidden[k], state)
        assert z.shape == (A, V_D) and z.dtype == torch.float32 and e.shape == (A, R)
        for a in range(A):
            ref_e, v, ref_states[a] = reference_step(markov, int(prev[k, a]), hidden[k, a].tolist(), ref_states[a])
            expected = base[k, a].double() + torch.tensor(reference_bias(markov, v), dtype=torch.float64)
            atol = z_bound(base[: k + 1, a], markov, hidden[: k + 1, a])[1]  # after k + 1 steps of the state
            torch.testing.assert_close(z[a].double(), expected, atol=atol, rtol=0)
            assert torch.equal(e[a].double(), torch.tensor(ref_e, dtype=torch.float64))  # a row of W1, looked up
        if kind == "rnn":
            atol = markov_v_error(markov, hidden[: k + 1], k + 1)[2]
            torch.testing.assert_close(new_state.double(), torch.tensor(ref_states, dtype=torch.float64), atol=atol,
                                       rtol=0)
            if state is None:  # s_0 = 0
                assert torch.equal(markov_step(markov, base[k], prev[k], hidden[k], torch.zeros(A, R))[0], z)
        else:
            assert new_state is None
        state = new_state
    if kind == "vanilla":  # a cached head's rows are the products themselves, each computed as a one-row step
        cached = copy.deepcopy(markov).cache_biases(capacity=2)
        for k in range(steps):
            z = markov_step(cached, base[k], prev[k])[0]
            for a in range(A):
                assert torch.equal(z[a], markov_step(markov, base[k, a : a + 1], prev[k, a : a + 1])[0][0])
    z, e, state = markov_step(None, base[0], prev[0])
    assert torch.equal(z, base[0]) and e is None and state is None


@pytest.mark.parametrize("with_d2t", [False, True])
def test_fused_equals_torch_equals_reference(with_d2t: bool):
    needs_triton()
    markov, conf = make_heads(temperatures=[1.0, 1.5, 0.7])
    d2t = make_d2t() if with_d2t else None
    for seed in range(2):
        u, h_pre, h_post = make_inputs(seed)
        ref = reference_chain(u, h_pre, h_post, 11, markov, conf, d2t)
        torch_chain = draft_chain(u, h_pre, h_post, 11, markov, conf, d2t, kernel="torch")
        fused_chain = fused(u, h_pre, h_post, 11, markov, conf, d2t)
        tolerances = chain_tolerances(u, markov, conf, h_pre, h_post)
        assert_same_chain(torch_chain, ref, tolerances)
        assert_same_chain(fused_chain, ref, tolerances)
        assert len(set(ref.tokens)) > 1


def dyadic(shape: tuple[int, ...], g: torch.Generator, scale: int) -> torch.Tensor:
    # Small multiples of 1/scale: every product and sum below is exact in fp32, whatever the summation order.
    return torch.randint(-scale, scale + 1, shape, generator=g).float() / scale


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_forced_ties_go_to_the_lowest_draft_id(path: str):
    if path == "fused":
        needs_triton()
    g = torch.Generator().manual_seed(3)
    markov, conf = make_heads()
    markov.w1.weight.copy_(dyadic((V_T, R), g, 4))
    markov.w2.weight.copy_(dyadic((V_D, R), g, 4))
    u = dyadic((K, V_D), g, 8)
    # Per slot, two draft ids share the maximal logit exactly: across tiles, inside a tile, vs the masked
    # last tile, and at ids 0/1.
    pairs = [(40, 250), (70, 90), (130, 299), (0, 1)]
    for k, (a, b) in enumerate(pairs):
        markov.w2.weight[b] = markov.w2.weight[a]
        u[k, a] = u[k, b] = 40.0
    _, h_pre, h_post = make_inputs()
    run = fused if path == "fused" else lambda *a: draft_chain(*a, kernel="torch")
    chain = run(u, h_pre, h_post, 5, markov, conf, None)
    assert chain.tokens == [a for a, _ in pairs]
    tolerances = chain_tolerances(u, markov, conf, h_pre, h_post)
    assert_same_chain(chain, reference_chain(u, h_pre, h_post, 5, markov, conf), tolerances)
    # two tied maxima 40 above the rest: p = 1/2 within 300 e^-30 (~1e-11), then exp of the log-prob's error
    atol = 0.5 * math.expm1(tolerances[0]) + gamma(1) + 1e-11
    torch.testing.assert_close(chain.logprobs.exp(), torch.full((K,), 0.5), atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
@pytest.mark.parametrize("with_d2t", [False, True])
def test_gated_and_rnn_torch_path_equals_reference(kind: str, with_d2t: bool):
    markov, conf = make_heads(kind, seed=1)
    d2t = make_d2t(1) if with_d2t else None
    u, h_pre, h_post = make_inputs(2)
    ref = reference_chain(u, h_pre, h_post, 3, markov, conf, d2t)
    tolerances = chain_tolerances(u, markov, conf, h_pre, h_post)
    assert_same_chain(draft_chain(u, h_pre, h_post, 3, markov, conf, d2t, kernel="auto"), ref, tolerances)
    # they read h_post: another post-norm hidden state changes the chain's logits by more than the tolerance
    other = draft_chain(u, h_pre, h_post + 1, 3, markov, conf, d2t, kernel="torch")
    atol = chain_tolerances(u, markov, conf, h_pre, h_post + 1)[0] + tolerances[0]
    assert not torch.allclose(other.logprobs.double(), ref.logprobs, rtol=0, atol=atol)


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_without_markov_head_is_plain_argmax(path: str):
    if path == "fused":
        needs_triton()
    _, conf = make_heads(with_markov=False)
    u, h_pre, h_post = make_inputs(4)
    d2t = make_d2t(4)
    run = fused if path == "fused" else lambda *a: draft_chain(*a, kernel="torch")
    chain = run(u, h_pre, h_post, 9, None, conf, d2t)
    draft_ids = u.argmax(-1)
    assert chain.tokens == (draft_ids + d2t[draft_ids]).tolist()
    tolerances = chain_tolerances(u, None, conf, h_pre, h_post)
    torch.testing.assert_close(chain.logprobs, u.log_softmax(-1).gather(1, draft_ids[:, None])[:, 0], rtol=0,
                               atol=2 * tolerances[0])
    assert_same_chain(chain, reference_chain(u, h_pre, h_post, 9, None, conf, d2t), tolerances)


def test_fused_with_bf16_weights_and_logits():
    needs_triton()
    markov, conf = make_heads(seed=5)
    markov.to(torch.bfloat16)
    conf.to(torch.bfloat16)
    u, h_pre, h_post = (t.to(torch.bfloat16) for t in make_inputs(5))
    torch_chain = draft_chain(u, h_pre, h_post, 2, markov, conf, kernel="torch")
    # bf16 inputs, float32 arithmetic on both paths
    assert_same_chain(fused(u, h_pre, h_post, 2, markov, conf), torch_chain,
                      chain_tolerances(u, markov, conf, h_pre, h_post, sides=2))


def test_kernel_choice(monkeypatch):
    needs_triton()
    vanilla, conf = make_heads()
    gated, _ = make_heads("gated")
    # auto fuses on CUDA only; the CPU interpreter is for tests and runs when asked for by name
    assert choose_kernel("auto", "vanilla", 0.0, "cpu") == "torch"
    assert choose_kernel("auto", None, 0.0, "cpu") == "torch"
    assert choose_kernel("fused", "vanilla", 0.0, "cpu") == "fused"
    assert choose_kernel("fused", None, 0.0, "cpu") == "fused"
    assert choose_kernel("auto", "gated", 0.0, "cpu") == "torch"
    assert choose_kernel("auto", "vanilla", 0.7, "cpu") == "torch"
    assert choose_kernel("torch", "rnn", 0.7, "cpu") == "torch"
    with pytest.raises(AssertionError):  # a request's kernel name is checked by DraftEngine.propose
        choose_kernel("cuda", "vanilla", 0.0, "cpu")
    for kind, temperature in (("gated", 0.0), ("rnn", 0.0), ("vanilla", 0.5)):
        with pytest.raises(KernelChoiceError, match="greedy chain of a vanilla Markov head"):
            choose_kernel("fused", kind, temperature, "cpu")
    u, h_pre, h_post = make_inputs()
    with pytest.raises(KernelChoiceError, match="vanilla Markov head"):
        draft_chain(u, h_pre, h_post, 1, gated, conf, kernel="fused")
    with pytest.raises(KernelChoiceError, match="greedy chain"):
        draft_chain(u, h_pre, h_post, 1, vanilla, conf, kernel="fused", temperature=0.5)
    assert_same_chain(draft_chain(u, h_pre, h_post, 1, vanilla, conf, kernel="fused"),
                      draft_chain(u, h_pre, h_post, 1, vanilla, conf, kernel="torch"),
                      chain_tolerances(u, vanilla, conf, h_pre, h_post, sides=2))
    from dspark_grpc.runtime.kernels import markov_triton

    monkeypatch.setattr(markov_triton, "_INTERPRET", False)  # as if triton had been imported without it
    assert choose_kernel("auto", "vanilla", 0.0, "cpu") == "torch"
    with pytest.raises(KernelUnavailable, match="cannot run"):
        draft_chain(u, h_pre, h_post, 1, vanilla, conf, kernel="fused")
    with pytest.raises(RuntimeError, match="cannot run"):  # the kernel itself, called without the checks
        fused(u, h_pre, h_post, 1, vanilla, conf)


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_empty_chain(path: str):
    if path == "fused":
        needs_triton()
    markov, conf = make_heads()
    u, h_pre, h_post = make_inputs(k=0)
    run = fused if path == "fused" else lambda *a: draft_chain(*a, kernel="torch")
    chain = run(u, h_pre, h_post, 1, markov, conf, None)
    assert chain.tokens == [] and chain.logprobs.shape == (0,) and chain.confidences.shape == (0,)


def test_bad_inputs():
    markov, conf = make_heads()
    u, h_pre, h_post = make_inputs()
    with pytest.raises(ValueError, match="no Markov head"):
        draft_chain(u, h_pre, h_post, 1, None, conf, kernel="torch")
    # a request's anchor and temperature are checked by DraftEngine.propose (tests/service/test_draft_batching.py);
    # the chain asserts them
    with pytest.raises(AssertionError, match="anchor"):
        draft_chain(u, h_pre, h_post, V_T, markov, conf, kernel="torch")
    with pytest.raises(AssertionError):
        draft_chain(u, h_pre, h_post, 1, markov, conf, kernel="torch", temperature=-1.0)


def test_cached_biases_give_bit_identical_chains_and_stay_bounded():
    markov, conf = make_heads()
    cached, _ = make_heads()
    cached.cache_biases(capacity=3)
    d2t = make_d2t()
    for seed in range(6):  # chains that share previous tokens hit the cache; more than 3 distinct ones evict
        base, pre, post = make_inputs(seed)
        anchor = seed % 2  # two anchors: slot 0 hits from the third chain on
        plain = draft_chain(base, pre, post, anchor, markov, conf, d2t, kernel="torch")
        fast = draft_chain(base, pre, post, anchor, cached, conf, d2t, kernel="torch")
        assert fast.tokens == plain.tokens
        assert torch.equal(fast.logprobs, plain.logprobs) and torch.equal(fast.confidences, plain.confidences)
        assert len(cached._biases) <= 3
    for prev, row in cached._biases.items():  # every kept row is W2 · W1[prev] itself
        assert torch.equal(row[0], markov.w2.weight @ markov.w1.weight[prev])


def test_bias_cache_refuses_heads_whose_bias_is_not_a_function_of_the_token():
    gated, _ = make_heads("gated")
    with pytest.raises(ValueError, match="vanilla"):
        gated.cache_biases(8)
    trainable = MarkovHead("vanilla", V_T, V_D, R, H)
    with pytest.raises(ValueError, match="frozen"):
        trainable.cache_biases(8)
    copy.deepcopy(trainable)  # a head without the cache holds no lock: training code can still copy it


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("with_d2t", [False, True])
def test_chains_of_one_pass_drafted_together_equal_each_alone_and_the_reference(kind: str, with_d2t: bool):
    """The sessions of one drafter pass draft their greedy chains as one batched chain (draft_chains): each equals
    the float64 reference loop of its own block, and the tokens are those the block drafts alone."""
    from dspark_grpc.runtime.drafting.markov import draft_chains

    markov, conf = make_heads(kind, temperatures=[1.0, 1.5, 0.7])
    d2t = make_d2t() if with_d2t else None
    blocks = [make_inputs(seed) for seed in range(5)]
    anchors = [11, 3, 11, 0, V_T - 1]
    stacked = [torch.stack([b[i] for b in blocks]) for i in range(3)]
    together = draft_chains(*stacked, torch.tensor(anchors), markov, conf, d2t)
    assert len(together) == len(blocks)
    for (u, h_pre, h_post), anchor, chain in zip(blocks, anchors, together, strict=True):
        reference = reference_chain(u, h_pre, h_post, anchor, markov, conf, d2t)
        assert_same_chain(chain, reference, chain_tolerances(u, markov, conf, h_pre, h_post))
        assert chain.tokens == draft_chain(u, h_pre, h_post, anchor, markov, conf, d2t, kernel="torch").tokens
    assert len({tuple(c.tokens) for c in together}) > 1
