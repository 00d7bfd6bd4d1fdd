"""A tiny target (trigram logits over 6 tokens), a different tiny drafter (bigram logits), the first 3 tokens
they emit by AR sampling and by speculation, and the statistics that compare them with the exact AR distribution.

Samples advance in waves: every unfinished sample drafts one chain (or tree) at once, chains are accepted by one
batched call, trees by one accept_tree call each, and each sample appends its accepted tokens and the bonus."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from dspark_grpc.runtime.drafting.acceptance import accept_chains, accept_tree, draft_sparse_distribution, sample_sparse
from dspark_grpc.runtime.drafting.sampling import SamplingParams, sample, target_probs
from torch import Tensor

V = 6
PROMPT = (2, 4)
EMIT = 3  # compare the joint distribution of the first EMIT tokens: V**EMIT cells
CHAIN = 3
DRAFT_TEMPERATURE = 0.8
DRAFT_TOP_K = 4

ChainRule = Callable[[Tensor, Tensor, Tensor, Tensor, SamplingParams, torch.Generator], tuple[Tensor, Tensor]]


def tiny_target(seed: int = 0) -> Tensor:
    """[V, V, V]: logits of the next token given the previous two."""
    return 1.5 * torch.randn(V, V, V, generator=torch.Generator().manual_seed(seed))


def tiny_drafter(target: Tensor, seed: int = 1) -> Tensor:
    """[V, V]: draft logits of the next token given the previous one: the target's bigram marginal plus noise,
    so drafts are often but not always right."""
    bigram = target.softmax(dim=-1).mean(dim=0).log()
    return bigram + 0.8 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))


def exact_joint(target: Tensor, params: SamplingParams) -> Tensor:
    """[V**3] float64: P(x1, x2, x3) under AR sampling, flattened as x1 * V^2 + x2 * V + x3."""
    probs = target_probs(target.double(), params)
    a, b = PROMPT
    p1 = probs[a, b]
    p2 = probs[b]  # [x1, x2]
    p3 = probs  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).flatten()


def cells(tokens: Tensor) -> Tensor:
    """[N, >= 3] emitted tokens -> [N] cell index of the first three."""
    return tokens[:, 0] * V * V + tokens[:, 1] * V + tokens[:, 2]


def ar_samples(target: Tensor, params: SamplingParams, n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    prev2 = torch.full((n,), PROMPT[0])
    prev1 = torch.full((n,), PROMPT[1])
    out = []
    for _ in range(EMIT):
        x = sample(target[prev2, prev1], params, g)
        out.append(x)
        prev2, prev1 = prev1, x
    return cells(torch.stack(out, dim=1))


def _contexts(states: list[list[int]], active: list[int]) -> tuple[Tensor, Tensor]:
    last = [(list(PROMPT) + states[b])[-2:] for b in active]
    both = torch.tensor(last)
    return both[:, 0], both[:, 1]


def _emit(states: list[list[int]], active: list[int], paths: list[list[int]], bonuses: list[int],
          nodes: list[list[int]]) -> int:
    accepted = 0
    for b, path, bonus, toks in zip(active, paths, bonuses, nodes, strict=True):
        states[b] += [toks[k] for k in path[1:]] + [bonus]
        accepted += len(path) - 1
    return accepted


def _cells(states: list[list[int]]) -> Tensor:
    return cells(torch.tensor([s[:EMIT] for s in states]))


def speculative_samples(target: Tensor, drafter: Tensor, params: SamplingParams, n: int, seed: int,
                        rule: ChainRule = accept_chains, greedy_draft: bool = False,
                        reported_temperature: float | None = None) -> tuple[Tensor, float]:
    """Chains of CHAIN tokens sampled from the drafter, verified with `rule` (batched like accept_chains), until
    EMIT tokens are out. -> (cells [n], mean accepted tokens per round).

    Ways to get it wrong: greedy_draft drafts the argmax but still reports the softmax as q; reported_temperature
    reports q at another temperature than the one the chain was sampled at."""
    g = torch.Generator().manual_seed(seed)
    states: list[list[int]] = [[] for _ in range(n)]
    accepted, rounds = 0, 0
    while active := [b for b in range(n) if len(states[b]) < EMIT]:
        ctx = list(_contexts(states, active))
        ids, logprobs = [], []
        for _ in range(CHAIN):
            row_ids, row_lp = draft_sparse_distribution(drafter[ctx[-1]], DRAFT_TEMPERATURE, DRAFT_TOP_K)
            ctx.append(row_ids[:, 0] if greedy_draft else sample_sparse(row_ids, row_lp, g))
            if reported_temperature is not None:
                row_ids, row_lp = draft_sparse_distribution(drafter[ctx[-2]], reported_temperature, DRAFT_TOP_K)
            ids.append(row_ids)
            logprobs.append(row_lp)
        chain = torch.stack(ctx[1:], dim=1)  # [B, CHAIN + 1], root first
        logits = target[torch.stack(ctx[:-1], dim=1), chain]  # [B, CHAIN + 1, V]
        m, bonus = rule(logits, chain, torch.stack(ids, dim=1), torch.stack(logprobs, dim=1), params, g)
        paths = [list(range(k + 1)) for k in m.tolist()]
        accepted += _emit(states, active, paths, bonus.tolist(), chain.tolist())
        rounds += len(active)
    return _cells(states), accepted / rounds


def random_tree_shape(g: torch.Generator) -> tuple[list[int], list[int]]:
    """(parents, sibling rank) of a random tree of depth <= 3 with at least one node besides the root."""
    parents, ranks, frontier = [-1], [0], [0]
    for _ in range(3):
        nxt = []
        for node in frontier:
            for rank in range(int(torch.randint(1 if node == 0 else 0, 3, (), generator=g))):
                parents.append(node)
                ranks.append(rank)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents, ranks


def tree_samples(target: Tensor, drafter: Tensor, params: SamplingParams, n: int, seed: int) -> tuple[Tensor, float]:
    """One random tree shape per wave; the r-th child of a node is the drafter's rank-r token after it (a
    deterministic top-k tree, as DDTree builds); accept_tree walks it. -> (cells [n], mean accepted per round)."""
    g = torch.Generator().manual_seed(seed)
    ranking = drafter.argsort(dim=-1, descending=True)
    states: list[list[int]] = [[] for _ in range(n)]
    accepted, rounds = 0, 0
    while active := [b for b in range(n) if len(states[b]) < EMIT]:
        parents, ranks = random_tree_shape(g)
        prev2, prev1 = _contexts(states, active)
        toks, before = [prev1], [prev2]
        for node in range(1, len(parents)):
            toks.append(ranking[toks[parents[node]], ranks[node]])
            before.append(toks[parents[node]])
        tokens = torch.stack(toks, dim=1)
        logits = target[torch.stack(before, dim=1), tokens]  # [B, nodes, V]
        trees = tokens.tolist()
        results = [accept_tree(logits[i], trees[i], parents, params, g) for i in range(len(active))]
        accepted += _emit(states, active, [r[0] for r in results], [r[1] for r in results], trees)
        rounds += len(active)
    return _cells(states), accepted / rounds


def accept_chains_resample_from_p(logits: Tensor, tokens: Tensor, draft_ids: Tensor, draft_logprobs: Tensor,
                                  params: SamplingParams, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """BIASED: min(1, p/q) acceptance, but a rejection draws from p instead of norm(max(0, p - q))."""
    p = target_probs(logits, params).double()
    q_x = torch.where(draft_ids == tokens[:, 1:, None], draft_logprobs.double().exp(), 0.0).sum(dim=-1)
    p_x = p[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    u = torch.rand(q_x.shape, dtype=torch.float64, generator=generator)
    m = (u * q_x < p_x).long().cumprod(dim=-1).sum(dim=-1)
    p_m = p.gather(1, m[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    return m, torch.multinomial(p_m, 1, generator=generator).squeeze(-1)


def tv_noise(expected: Tensor, n: int) -> float:
    """The TV distance an exact sampler's n-sample histogram has from `expected` on average (normal approximation)."""
    return 0.5 * float((2 * expected * (1 - expected) / (math.pi * n)).sqrt().sum())


def _upper_tail(chi2: float, df: int) -> float:
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


def goodness_of_fit(samples: Tensor, expected: Tensor) -> tuple[float, float]:
    """Pearson chi-square of sampled cells against exact probabilities -> (TV distance, p-value).

    Cells expected fewer than 5 times are pooled into one bin; a sample in a zero-probability cell gives p = 0.
    """
    n = samples.numel()
    observed = torch.bincount(samples, minlength=expected.numel()).double()
    tv = 0.5 * float((observed / n - expected).abs().sum())
    if bool((observed[expected == 0] > 0).any()):
        return tv, 0.0
    want = expected * n
    big = want >= 5
    obs = torch.cat([observed[big], observed[~big].sum()[None]])
    exp = torch.cat([want[big], want[~big].sum()[None]])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return tv, _upper_tail(chi2, int(keep.sum()) - 1)


def homogeneity(a: Tensor, b: Tensor, size: int) -> tuple[float, float]:
    """Two-sample chi-square (are a and b draws from one distribution?) -> (TV distance, p-value).

    Cells with fewer than 10 samples in a and b together are pooled into one bin."""
    ca = torch.bincount(a, minlength=size).double()
    cb = torch.bincount(b, minlength=size).double()
    tv = 0.5 * float((ca / ca.sum() - cb / cb.sum()).abs().sum())
    big = ca + cb >= 10
    ca = torch.cat([ca[big], ca[~big].sum()[None]])
    cb = torch.cat([cb[big], cb[~big].sum()[None]])
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    chi2 = float(((ca - ea) ** 2 / ea).sum() + ((cb - eb) ** 2 / eb).sum())
    return tv, _upper_tail(chi2, int(keep.sum()) - 1)


def verdict(samples: Tensor, expected: Tensor) -> dict[str, float]:
    """The exactness test: Pearson p-value and TV against the exact distribution, and the TV to expect from noise.

    A sampler passes with p > 1e-3 and tv < 2 * noise (noise ~ 0.023 for 216 cells and 20k samples)."""
    tv, p = goodness_of_fit(samples, expected)
    return {"tv": tv, "p": p, "noise": tv_noise(expected, samples.numel())}


def looks_exact(v: dict[str, float]) -> bool:
    return v["p"] > 1e-3 and v["tv"] < 2 * v["noise"]
