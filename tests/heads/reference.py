"""Slow, obviously-correct references: the DSpark chain element by element, DDTree by enumerating every path."""

from __future__ import annotations

import itertools
import math

import torch
from dspark_grpc.runtime.drafting.markov import Chain, ConfidenceHead, MarkovHead


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
