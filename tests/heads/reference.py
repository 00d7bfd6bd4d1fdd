"""Slow, obviously-correct references: the DSpark chain element by element, DDTree by enumerating every path; and
the float32 error bounds of the chain (tests/tolerance.py) that comparisons with them allow."""

from __future__ import annotations

import itertools
import math

import torch
from dspark_grpc.runtime.drafting.markov import Chain, ConfidenceHead, MarkovHead
from tolerance import gamma, log_softmax_error, sigmoid_error, unit_roundoff


def _dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _rows(t: torch.Tensor) -> list:
    return t.detach().double().tolist()


def reference_step(markov: MarkovHead, prev: int, hidden_post: list[float], state: list[float]
                   ) -> tuple[list[float], list[float], list[float]]:
    """One Markov step in float64 from the formulas: (e = W1[prev], v with bias = W2 · v, new rnn state)."""
    r = markov.rank
    e = _rows(markov.w1.weight[prev])
    if markov.kind == "vanilla":
        return e, e, state
    if markov.kind == "gated":
        w, b = _rows(markov.gate_proj.weight), _rows(markov.gate_proj.bias)
        x = hidden_post + e
        return e, [_sigmoid(_dot(w[i], x) + b[i]) * e[i] for i in range(r)], state
    w, b = _rows(markov.joint_proj.weight), _rows(markov.joint_proj.bias)
    x = state + e + hidden_post
    y = [_dot(w[i], x) + b[i] for i in range(3 * r)]
    g = [_sigmoid(y[i]) for i in range(r)]
    v = [math.tanh(y[2 * r + i]) for i in range(r)]
    return e, v, [g[i] * state[i] + (1 - g[i]) * math.tanh(y[r + i]) for i in range(r)]


def reference_bias(markov: MarkovHead, v: list[float]) -> list[float]:
    return [_dot(row, v) for row in _rows(markov.w2.weight)]


def reference_chain(base_logits: torch.Tensor, hidden_pre: torch.Tensor, hidden_post: torch.Tensor, anchor: int,
                    markov: MarkovHead | None, confidence: ConfidenceHead | None,
                    d2t: torch.Tensor | None = None) -> Chain:
    """Greedy chain in float64 Python loops."""
    u, h_post = _rows(base_logits), _rows(hidden_post)
    h_conf = _rows(confidence.select_hidden(hidden_pre, hidden_post)) if confidence is not None else None
    vocab = len(u[0])
    state = [0.0] * (markov.rank if markov is not None else 0)
    prev, tokens, logprobs, confs = anchor, [], [], []
    for k in range(len(u)):
        z = list(u[k])
        e: list[float] = []
        if markov is not None:
            e, v, state = reference_step(markov, prev, h_post[k], state)
            z = [zj + bj for zj, bj in zip(z, reference_bias(markov, v), strict=True)]
        best = 0
        for j in range(1, vocab):
            if z[j] > z[best]:
                best = j
        lse = z[best] + math.log(sum(math.exp(zj - z[best]) for zj in z))
        logprobs.append(z[best] - lse)
        if confidence is not None:
            x = h_conf[k] + (e if confidence.with_markov else [])
            w, b = _rows(confidence.proj.weight)[0], _rows(confidence.proj.bias)[0]
            temps = confidence.temperatures.tolist()
            confs.append(_sigmoid((_dot(w, x) + b) / temps[min(k, len(temps) - 1)]))
        prev = best if d2t is None else best + int(d2t[best])
        tokens.append(prev)
    conf = torch.tensor(confs, dtype=torch.float64) if confidence is not None else None
    return Chain(tokens, torch.tensor(logprobs, dtype=torch.float64), conf)


def path_score(lp: list[list[float]], ranks: tuple[int, ...]) -> float:
    s = 0.0
    for d, r in enumerate(ranks):
        s += lp[d][r]
    return s


def brute_force_tree(lp: list[list[float]], budget: int, chain_seed: bool = False) -> list[tuple[int, ...]]:
    """Rank tuples of the tree's nodes in pop order: every path over the per-depth top-K sorted by (-score, ranks)."""
    depth, k = len(lp), len(lp[0])
    paths = [t for d in range(1, depth + 1) for t in itertools.product(range(k), repeat=d)]
    order = sorted(paths, key=lambda t: (-path_score(lp, t), t))
    if not chain_seed:
        return order[:budget]
    chain = [(0,) * d for d in range(1, min(depth, budget) + 1)]
    rest = [t for t in order if t not in chain]
    return chain + rest[: budget - len(chain)]


def _abs_max(t: torch.Tensor) -> float:
    return float(t.detach().double().abs().max())


def markov_v_error(markov: MarkovHead, hidden: torch.Tensor, steps: int) -> tuple[float, float, float]:
    """(max |v|, a bound on v's float32 error, and on the rnn state's) over `steps` chained steps: vanilla v = e
    exactly; gated sigmoid(G [h ; e] + b) e, the argument within gamma_{H+r+1} of its magnitude (sigmoid: 1/4 of
    that); rnn tanh(o), [g, c, o] = J [s ; e ; h] + b, the state's error carried on through J's state columns."""
    e_max, h_max, n = _abs_max(markov.w1.weight), _abs_max(hidden), markov.rank + markov.hidden_size + 1
    if markov.kind == "vanilla":
        return e_max, 0.0, 0.0
    if markov.kind == "gated":
        g = markov.gate_proj
        arg = float(g.weight.double().abs().sum(1).max()) * max(h_max, e_max) + _abs_max(g.bias)
        return e_max, e_max * sigmoid_error(gamma(n) * arg) + unit_roundoff() * e_max, 0.0
    j, r = markov.joint_proj, markov.rank
    arg = float(j.weight.double().abs().sum(1).max()) * max(1.0, h_max, e_max) + _abs_max(j.bias)
    through_state = float(j.weight.double().abs()[:, :r].sum(1).max())
    v_error = state_error = 0.0
    for _ in range(steps):  # |s| <= 1: s' = g s + (1 - g) tanh(c), g = sigmoid(.), tanh 1-Lipschitz
        d = gamma(n + r) * arg + through_state * state_error
        v_error = d + gamma(3)
        state_error = 2 * sigmoid_error(d) + state_error + d + gamma(3) + 3 * unit_roundoff()
    return 1.0, v_error, state_error


def z_bound(u: torch.Tensor, markov: MarkovHead | None, hidden: torch.Tensor) -> tuple[float, float]:
    """(max |Z|, a bound on Z's float32 error) of Z = U + W2 v over u's rows (steps): gamma_{r+1} of |W2| |v| plus
    |W2| times v's error, and the add's rounding."""
    if markov is None:
        return _abs_max(u), 0.0
    v_max, v_error, _ = markov_v_error(markov, hidden, u.shape[0])
    w2 = float(markov.w2.weight.double().abs().sum(1).max())
    z_max = _abs_max(u) + w2 * v_max
    return z_max, unit_roundoff() * z_max + w2 * (gamma(markov.rank + 1) * v_max + v_error)


def chain_tolerances(u: torch.Tensor, markov: MarkovHead | None, conf: ConfidenceHead | None,
                     h_pre: torch.Tensor, h_post: torch.Tensor, sides: int = 1) -> tuple[float, float]:
    """tests/tolerance.py's bounds on a float32 chain's (log-probs, confidences), `sides` of them: the log-softmax of
    Z (`z_bound`) over the draft vocabulary, and sigmoid((w . [h ; e] + b) / T) (gamma_{n+2} of |w| |x| + |b|, over
    the smallest T)."""
    z_max, z_error = z_bound(u, markov, h_post)
    logprob = sides * log_softmax_error(u.shape[-1], z_max, z_error)
    if conf is None:
        return logprob, 0.0
    x_max = max(_abs_max(h_pre), _abs_max(h_post), _abs_max(markov.w1.weight) if markov is not None else 0.0)
    return logprob, confidence_tolerance(conf, x_max, u.shape[0], sides)


def confidence_tolerance(conf: ConfidenceHead, x_max: float, rows: int, sides: int = 1) -> float:
    """sigmoid((w . x + b) / T) for |x| <= x_max over `rows` positions: gamma_{n+2} of |w| |x| + |b| (the dot, the
    bias, the divide) over the smallest T, through sigmoid."""
    w = conf.proj.weight.detach().double().abs()
    arg = (float(w.sum()) * x_max + _abs_max(conf.proj.bias)) / float(conf.position_temperatures(rows).min())
    return sides * sigmoid_error(gamma(w.shape[1] + 2) * arg)
