"""Which part of a verified proposal the target accepts, and the draft distributions it needs to know.

Two lossless rules; the target picks one per verify from what the proposal carries:

- Rejection sampling (`accept_chain`, batched `accept_chains`; Leviathan et al. / Chen et al.) for a chain
  that comes with the sparse draft distribution q_k each token x_k was *actually* drawn from. Accept x_k
  with probability min(1, p_k(x_k) / q_k(x_k)), p_k the target's distribution at the parent; at the first
  rejection emit a sample of norm(max(0, p_k - q_k)) (p_k if that is ~0); after a fully accepted chain emit
  a bonus from p at the last node. A drafted token is accepted with probability sum_x min(p_k, q_k) =
  1 - TV(p_k, q_k), the most any exact rule gets from one draw.
- Sample-and-match (`accept_tree`; SpecInfer's naive rule) for trees, and for chains sent without draft
  distributions: at each visited node draw y from the target's own distribution there; if y is a child of
  the node, move to it, otherwise y is the bonus token. Every emitted token is a target sample, so the rule
  is exact for any tree, however it was built. A drafted x ~ q is accepted with sum_x q(x) p(x) only.

min(1, p/q) is exact only when x was drawn from exactly q. DDTree's children are the deterministic top-k of
the draft, not draws from it: with q = the draft softmax the rule over-emits the top-ranked tokens (a top-1
chain accepts x = argmax q with probability min(1, p(x)/q(x)), unrelated to p(x)), so trees use
sample-and-match (dspark_algorithm.md §5). For the same reason q must be the distribution at the drafter's
sampling temperature and truncation, not softmax(Z) or another T; the drafter's T need not equal the
target's.

p is `target_probs` (temperature, top-k, top-p), the same function AR decoding samples from. At temperature 0
it is one-hot and both rules are greedy matching: accept while the drafted token is the target's argmax, then
emit the argmax; no random numbers are drawn. The drafter side is `draft_sparse_distribution` (softmax of the
top-k corrected logits at T, renormalized) and `sample_sparse` (a draw from it), so the q the target receives
is the one the chain was sampled from.
"""

from __future__ import annotations

import math

import torch
from dspark_grpc.runtime.drafting.sampling import SamplingParams, draw_device, multinomial, sample, target_probs
from torch import Tensor

# How far the exp of a draft row's log-probs may sum from 1 (float32 log_softmax is ~1e-6 off).
Q_SUM_TOLERANCE = 1e-3
# Below this the residual max(0, p - q) is rounding noise: the rejection branch draws from p instead.
RESIDUAL_FLOOR = 1e-9


def children_by_token(tokens: list[int], parents: list[int]) -> list[dict[int, int]]:
    children: list[dict[int, int]] = [{} for _ in tokens]
    for node in range(1, len(tokens)):
        children[parents[node]].setdefault(tokens[node], node)
    return children


def accept_tree(logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """Sample-and-match. Returns (accepted root-to-node path starting at 0, bonus token)."""
    assert logits.dim() == 2 and logits.shape[0] == len(tokens) == len(parents)
    children = children_by_token(tokens, parents)
    path = [0]
    while True:
        y = int(sample(logits[path[-1]], params, generator))
        child = children[path[-1]].get(y)
        if child is None:
            return path, y
        path.append(child)


def dense_draft_probs(draft_ids: Tensor, draft_logprobs: Tensor, vocab: int) -> Tensor:
    """Sparse draft rows (ids [..., K], -1 = padding; log-probs [..., K]) -> dense float64 probabilities [..., vocab].

    An id listed twice gets the sum of its entries, the chance that drawing from the row gives it. Raises
    ValueError for ids outside the vocabulary, log-probs above 0 or NaN, and rows whose mass is not 1.
    """
    if draft_ids.dim() == 0 or draft_logprobs.shape != draft_ids.shape:
        raise ValueError(f"draft ids and log-probs must have one shape [..., K]; got {tuple(draft_ids.shape)} and "
                         f"{tuple(draft_logprobs.shape)}")
    if draft_ids.dtype.is_floating_point or draft_ids.dtype.is_complex or draft_ids.dtype == torch.bool:
        raise ValueError(f"draft ids must be an integer tensor, got {draft_ids.dtype}")
    if not draft_logprobs.dtype.is_floating_point:
        raise ValueError(f"draft log-probs must be a float tensor, got {draft_logprobs.dtype}")
    lead, width = draft_ids.shape[:-1], draft_ids.shape[-1]
    ids = draft_ids.long().reshape(-1, width)
    if ids.shape[0] == 0:
        return torch.zeros(*lead, vocab, dtype=torch.float64, device=draft_ids.device)
    if width == 0:
        raise ValueError(f"draft rows are empty (K = 0) for {ids.shape[0]} drafted tokens")
    low, high = (int(x) for x in torch.aminmax(ids))
    if low < -1 or high >= vocab:
        row, col = ((ids < -1) | (ids >= vocab)).nonzero()[0].tolist()
        raise ValueError(f"draft id {int(ids[row, col])} in row {_row(row, lead)}, column {col} is outside the target "
                         f"vocabulary [0, {vocab}) (-1 marks padding); map draft ids to target ids first")
    probs = torch.where(ids >= 0, draft_logprobs.reshape(-1, width).double(), -math.inf).exp()
    if not bool((probs <= 1 + 1e-6).all()):  # NaN fails too
        row = int((~(probs <= 1 + 1e-6)).nonzero()[0, 0])
        raise ValueError(f"draft log-probs must be <= 0 and not NaN; row {_row(row, lead)} is "
                         f"{draft_logprobs.reshape(-1, width)[row].tolist()}")
    # Column 0 collects the padding (probability 0); real id t lands in column t + 1.
    dense = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float64, device=ids.device)
    dense.scatter_add_(-1, ids + 1, probs)
    sums = dense.sum(dim=-1, keepdim=True)
    for row, total in enumerate(sums.flatten().tolist()):
        if not abs(total - 1) <= Q_SUM_TOLERANCE:
            raise ValueError(f"draft row {_row(row, lead)} sums to {total:.6g}, not 1: send the log-probs of the whole "
                             f"(renormalized) distribution the token was drawn from, e.g. draft_sparse_distribution")
    return (dense[:, 1:] / sums).reshape(*lead, vocab)


def accept_chain(logits: Tensor, tokens: list[int], draft_ids: Tensor, draft_logprobs: Tensor,
                 params: SamplingParams, generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative (rejection) sampling of a chain. Returns (accepted path [0, 1, ..., m], bonus token).

    logits [n+1, V]: the target at each chain node, tokens [n+1]: the chain with the root at 0, draft_ids /
    draft_logprobs [n, K]: row k-1 is the sparse distribution token k was drawn from (-1 pads ids).
    """
    n = len(tokens) - 1
    if n < 0 or logits.dim() != 2 or logits.shape[0] != n + 1:
        raise ValueError(f"logits must be [len(tokens)={n + 1}, V] and the chain needs its root; got logits "
                         f"{tuple(logits.shape)}")
    if draft_ids.dim() != 2 or draft_ids.shape[0] != n:
        raise ValueError(f"draft ids must be [n={n}, K]: one row per drafted token, got {tuple(draft_ids.shape)}")
    bad = [t for t in tokens if not 0 <= t < logits.shape[1]]
    if bad:
        raise ValueError(f"chain tokens {bad[:5]} are outside the target vocabulary [0, {logits.shape[1]})")
    q = dense_draft_probs(draft_ids, draft_logprobs, logits.shape[1]).to(logits.device)
    chain = torch.tensor([tokens], dtype=torch.long, device=logits.device)
    m, bonus = _accept(logits[None], chain, q[None], params, generator)
    return list(range(int(m[0]) + 1)), int(bonus[0])


def accept_chains(logits: Tensor, tokens: Tensor, draft_ids: Tensor, draft_logprobs: Tensor,
                  params: SamplingParams, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """`accept_chain` for B chains of one length n at once: logits [B, n+1, V], tokens [B, n+1] (roots at 0),
    draft_ids / draft_logprobs [B, n, K] -> (accepted count m [B], bonus token [B]); chain b keeps nodes 0..m[b].
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2] or tokens.shape[1] == 0:
        raise ValueError(f"logits must be [B, n+1, V] and tokens [B, n+1] (the chains, roots first); got "
                         f"{tuple(logits.shape)} and {tuple(tokens.shape)}")
    batch, n, vocab = logits.shape[0], logits.shape[1] - 1, logits.shape[2]
    if draft_ids.dim() != 3 or draft_ids.shape[:2] != (batch, n):
        raise ValueError(f"draft ids must be [B={batch}, n={n}, K]: one row per drafted token, "
                         f"got {tuple(draft_ids.shape)}")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"chain tokens must be integers, got {tokens.dtype}")
    tokens = tokens.long().to(logits.device)
    if bool(((tokens < 0) | (tokens >= vocab)).any()):
        bad = tokens[(tokens < 0) | (tokens >= vocab)].tolist()
        raise ValueError(f"chain tokens {bad[:5]} are outside the target vocabulary [0, {vocab})")
    q = dense_draft_probs(draft_ids, draft_logprobs, vocab).to(logits.device)
    return _accept(logits, tokens, q, params, generator)


def _accept(logits: Tensor, tokens: Tensor, q: Tensor, params: SamplingParams,
            generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits [B, n+1, V], tokens [B, n+1], dense draft probabilities q [B, n, V] -> (m [B], bonus [B])."""
    batch, n, vocab = logits.shape[0], logits.shape[1] - 1, logits.shape[2]
    drafted = tokens[:, 1:, None]
    q_x = q.gather(-1, drafted).squeeze(-1)  # [B, n]
    if not bool((q_x > 0).all()):
        b, k = (~(q_x > 0)).nonzero()[0].tolist()
        chain = f" of chain {b}" if batch > 1 else ""
        raise ValueError(f"chain token {k + 1} ({int(tokens[b, k + 1])}){chain} has no mass in its draft row {k}: "
                         f"the row must be the distribution the token was drawn from, so it must contain it")
    if params.is_greedy:
        best = logits.argmax(dim=-1)  # [B, n+1]
        m = (tokens[:, 1:] == best[:, :-1]).long().cumprod(dim=-1).sum(dim=-1)
        return m, best.gather(-1, m[:, None]).squeeze(-1)
    p = target_probs(logits, params).double()  # [B, n+1, V]
    p_x = p[:, :-1].gather(-1, drafted).squeeze(-1)
    u = torch.rand(batch, n, dtype=torch.float64, generator=generator, device=draw_device(generator, logits))
    accepted = u.to(logits.device) * q_x < p_x  # probability min(1, p/q)
    m = accepted.long().cumprod(dim=-1).sum(dim=-1)
    # Row m: the residual of the first rejected token, or p itself after a full chain (q's row n is zero).
    rows = m[:, None, None].expand(batch, 1, vocab)
    p_m = p.gather(1, rows).squeeze(1)
    q_m = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1).gather(1, rows).squeeze(1)
    residual = (p_m - q_m).clamp_(min=0)
    dist = torch.where(residual.sum(dim=-1, keepdim=True) > RESIDUAL_FLOOR, residual, p_m)
    return m, multinomial(dist, generator).squeeze(-1)


def draft_sparse_distribution(corrected_logits: Tensor, temperature: float, top_k: int,
                              d2t: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """[n, V_d] corrected logits -> (ids [n, top_k] int64, log-probs [n, top_k] float32): the distribution a
    sampling drafter draws each chain token from, softmax(Z / T) over the top_k logits (0 = all), renormalized.

    Temperature 0 is a one-hot at the argmax (ties -> lowest id). Rows shorter than top_k are padded with id -1
    and log-prob -inf. With d2t (target = draft + d2t[draft]) the ids are target ids.
    """
    if corrected_logits.dim() != 2:
        raise ValueError(f"corrected logits must be [n, V_d], got {tuple(corrected_logits.shape)}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 keeps the whole draft vocabulary), got {top_k!r}")
    n, vocab = corrected_logits.shape
    width = top_k or vocab
    z = corrected_logits.float()
    ids = torch.full((n, width), -1, dtype=torch.long, device=z.device)
    logprobs = torch.full((n, width), -math.inf, dtype=torch.float32, device=z.device)
    if temperature == 0:
        ids[:, 0] = z.argmax(dim=-1)
        logprobs[:, 0] = 0.0
    else:
        k = min(width, vocab)
        values, top = (z / temperature).topk(k, dim=-1)
        ids[:, :k] = top
        logprobs[:, :k] = values.log_softmax(dim=-1)
    if d2t is not None:
        real = ids >= 0
        ids = torch.where(real, ids + d2t.to(ids.device).long()[ids.clamp(min=0)], -1)
    return ids, logprobs


def sample_sparse(ids: Tensor, logprobs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Sparse rows (ids [..., K], -1 = padding; log-probs [..., K]) -> [...] ids drawn from each row."""
    if ids.shape != logprobs.shape or ids.dim() == 0:
        raise ValueError(f"ids and log-probs must have the same shape [..., K], got {tuple(ids.shape)} and "
                         f"{tuple(logprobs.shape)}")
    probs = torch.where(ids >= 0, logprobs.double().exp(), 0.0).reshape(-1, ids.shape[-1])
    if not bool((probs.sum(dim=-1) > 0).all()):
        raise ValueError("every sparse row needs at least one id with probability > 0")
    col = multinomial(probs, generator)
    return ids.reshape(-1, ids.shape[-1]).gather(-1, col).view(ids.shape[:-1])


def _row(flat: int, lead: torch.Size) -> str:
    """A flattened row index as the caller's index: 3, or (1, 0) for batched rows."""
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), lead)]
    return str(index[0]) if len(index) == 1 else str(tuple(index))

