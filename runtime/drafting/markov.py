"""DSpark's sequential stage: the low-rank Markov (bigram) head, the confidence head and the draft chain.

Z_k = U_k + W2 · f(W1[prev_k]), prev_0 = the anchor, prev_k = the token drafted at slot k-1 (as a target id).
W1 is indexed by target ids, W2 produces draft-vocab logits; `d2t` holds offsets: target = draft + d2t[draft].
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from dspark_grpc.runtime.drafting.acceptance import draft_sparse_distribution
from dspark_grpc.runtime.drafting.sampling import multinomial
from dspark_grpc.runtime.models.linear import Linear
from dspark_grpc.runtime.models.transformer import Embedding
from dspark_grpc.speculation.wire import AUTO, FUSED, TORCH
from torch import Tensor, nn

MARKOV_KINDS = ("vanilla", "gated", "rnn")
KERNELS = (AUTO, FUSED, TORCH)


class MarkovHead(nn.Module):
    def __init__(self, kind: str, target_vocab: int, draft_vocab: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        if kind not in MARKOV_KINDS:
            raise ValueError(f"markov head kind must be one of {MARKOV_KINDS}, got {kind!r}")
        self.kind, self.rank, self.hidden_size = kind, rank, hidden_size
        self.w1 = Embedding(target_vocab, rank)
        self.w2 = Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)
        self._biases: OrderedDict[int, Tensor] | None = None  # see cache_biases
        self._biases_capacity = 0
        self._biases_lock: threading.Lock | None = None  # created with the cache: a plain head stays copyable

    @property
    def target_vocab(self) -> int:
        return self.w1.weight.shape[0]

    @property
    def draft_vocab(self) -> int:
        return self.w2.weight.shape[0]

    def cache_biases(self, capacity: int) -> MarkovHead:
        """Serving: keep W2 · W1[prev] of the last `capacity` previous tokens (fp32 rows of draft_vocab).

        A vanilla head's bias depends on the previous token only, and a chain step's matrix-vector product reads
        all of W2 (2 MB at 8192 x 64): measured on one CPU thread, a 4-slot chain's post-processing 0.43 -> 0.20 ms.
        Frozen vanilla heads only; the cached rows are the products themselves, so chains are bit-identical."""
        if self.kind != "vanilla" or self.w2.weight.requires_grad:
            raise ValueError("only a frozen vanilla Markov head can cache its biases")
        if capacity <= 0:
            raise ValueError(f"bias cache capacity must be positive, got {capacity}")
        self._biases, self._biases_capacity, self._biases_lock = OrderedDict(), capacity, threading.Lock()
        return self

    def project(self, v: Tensor, prev: Tensor, cached: bool = True) -> Tensor:
        """W2 · v [A, V_d] fp32 for v [A, r] from markov_step(prev [A]) (prev is the cache's key, see
        cache_biases; `cached` False: computed, as a traced graph must)."""
        if not cached or self._biases is None:
            return self._times_w2(v)
        rows = [self._cached_bias(v, i, token) for i, token in enumerate(prev.tolist())]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _times_w2(self, v: Tensor) -> Tensor:
        """W2 · v in fp32: on W2's Q8_0 blocks where runtime/models/linear.py:quantize_linears gave it some (the
        fast precision on the CPU: a quarter of fp32's bytes to read each chain step), else in fp32."""
        if self.w2.blocks is not None:
            return self.w2(v.float())
        return F.linear(v, self.w2.weight.float())

    def _cached_bias(self, v: Tensor, i: int, token: int) -> Tensor:
        with self._biases_lock:
            row = self._biases.get(token)
            if row is not None:
                self._biases.move_to_end(token)
                return row
        row = self._times_w2(v[i : i + 1])  # [1, V_d]
        with self._biases_lock:
            self._biases[token] = row
            if len(self._biases) > self._biases_capacity:
                self._biases.popitem(last=False)
        return row


def markov_step(markov: MarkovHead | None, base_logits: Tensor, prev: Tensor, hidden: Tensor | None = None,
                state: Tensor | None = None, cached: bool = True) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One chain step for A rows at once, fp32 and differentiable: U_k [A, V_d], x_{k-1} [A] (target ids; the
    anchor at k = 0), h_k [A, H] after the final norm (read by gated/rnn heads), the rnn state s_k [A, r] (None:
    s_0 = 0) -> (Z_k = U_k + W2 · v [A, V_d], e = W1[x_{k-1}] [A, r], s_{k+1}); without a head Z_k = U_k.

    vanilla v = e; gated v = sigmoid(G [h ; e] + b) * e; rnn [g, c, o] = J [s ; e ; h] + b, v = tanh(o),
    s' = sigmoid(g) * s + (1 - sigmoid(g)) * tanh(c)."""
    assert base_logits.dim() == 2 and prev.shape == base_logits.shape[:1], (base_logits.shape, prev.shape)
    if markov is None:
        return base_logits.float(), None, None
    A = prev.shape[0]
    assert base_logits.shape[1] == markov.draft_vocab, f"markov head drafts {markov.draft_vocab} tokens"
    e = markov.w1.weight[prev].float()
    v = e
    if markov.kind != "vanilla":
        assert hidden is not None and hidden.shape == (A, markov.hidden_size), "gated/rnn heads read h_k [A, H]"
        h = hidden.float()
        if markov.kind == "gated":
            v = torch.sigmoid(_linear(markov.gate_proj, torch.cat([h, e], dim=-1))) * e
        else:
            s = torch.zeros_like(e) if state is None else state.float()
            assert s.shape == e.shape, f"rnn state must be [A, r], got {tuple(s.shape)}"
            g, c, o = _linear(markov.joint_proj, torch.cat([s, e, h], dim=-1)).split(markov.rank, dim=-1)
            g = torch.sigmoid(g)
            v, state = torch.tanh(o), g * s + (1 - g) * torch.tanh(c)
    return base_logits.float() + markov.project(v, prev, cached), e, state


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k ; W1[prev_k]]) / T_k); positions past the temperature table use its last entry."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool, pre_norm: bool,
                 temperatures: list[float] | None = None) -> None:
        super().__init__()
        self.hidden_size, self.rank, self.with_markov, self.pre_norm = hidden_size, rank, with_markov, pre_norm
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)
        temps = torch.tensor([1.0] if temperatures is None else list(temperatures), dtype=torch.float32)
        if temps.numel() == 0 or not bool(torch.isfinite(temps).all() and (temps > 0).all()):
            raise ValueError(f"calibration temperatures must be a non-empty list of finite values > 0, "
                             f"got {temperatures}")
        # Calibration comes from the serving config, not from the checkpoint.
        self.register_buffer("temperatures", temps, persistent=False)

    def select_hidden(self, hidden_pre: Tensor, hidden_post: Tensor) -> Tensor:
        return hidden_pre if self.pre_norm else hidden_post

    def position_temperatures(self, n: int, start: int = 0) -> Tensor:
        idx = torch.arange(start, start + n, device=self.temperatures.device).clamp(max=self.temperatures.numel() - 1)
        return self.temperatures[idx]

    def logits(self, hidden: Tensor, markov_emb: Tensor | None = None) -> Tensor:
        """hidden [K, H], markov_emb [K, r] (W1 of each slot's previous token) -> raw logits [K] fp32."""
        assert hidden.dim() == 2 and hidden.shape[1] == self.hidden_size, f"hidden {tuple(hidden.shape)}"
        x = hidden.float()
        if self.with_markov:
            assert markov_emb is not None and markov_emb.shape == (hidden.shape[0], self.rank), \
                "this confidence head takes [h_k ; W1[prev_k]]: pass markov_emb [K, r]"
            x = torch.cat([x, markov_emb.float().to(x.device)], dim=-1)
        return _linear(self.proj, x).squeeze(-1)

    def forward(self, hidden: Tensor, markov_emb: Tensor | None = None, start: int = 0) -> Tensor:
        """Calibrated confidences [K]; row i is block position start + i."""
        logits = self.logits(hidden, markov_emb)
        return torch.sigmoid(logits / self.position_temperatures(logits.shape[0], start).to(logits.device))


@dataclass
class Chain:
    tokens: list[int]  # target ids
    logprobs: Tensor  # [K] fp32: log-prob of each token under the distribution it was drafted from
    confidences: Tensor | None  # [K] fp32
    # When sampled from a top-k truncated distribution: that exact distribution per slot (target ids, [K, k]),
    # which lossless rejection sampling at the target needs.
    draft_ids: Tensor | None = None
    draft_logprobs: Tensor | None = None


@dataclass
class ChainSteps:
    draft_tokens: list[int]
    tokens: list[int]
    logprobs: Tensor  # [K]
    embeddings: Tensor | None  # [K, r] = W1[prev_k]
    logits: Tensor  # [K, V_d] corrected logits Z_k
    draft_ids: Tensor | None = None  # [K, k] with sample_top_k: the sparse distributions sampled from
    draft_logprobs: Tensor | None = None


def to_target(draft_token: int, d2t: Tensor | None) -> int:
    return draft_token if d2t is None else draft_token + int(d2t[draft_token])


def _linear(layer: nn.Linear, x: Tensor) -> Tensor:
    bias = None if layer.bias is None else layer.bias.float()
    return F.linear(x, layer.weight.float(), bias)


def check_chain_inputs(base_logits: Tensor, anchor: int, markov: MarkovHead | None, d2t: Tensor | None,
                       confidence: ConfidenceHead | None = None) -> None:
    assert base_logits.dim() == 2, f"base_logits must be [K, V_d], got {tuple(base_logits.shape)}"
    vocab = base_logits.shape[1]
    if markov is not None:
        assert markov.draft_vocab == vocab, f"markov head drafts {markov.draft_vocab} tokens, logits have {vocab}"
        assert 0 <= anchor < markov.target_vocab, f"anchor {anchor} outside [0, {markov.target_vocab})"
    if d2t is not None:
        assert d2t.shape == (vocab,), f"d2t must be [V_d={vocab}], got {tuple(d2t.shape)}"
    if confidence is not None and confidence.with_markov and markov is None:
        raise ValueError("the confidence head takes W1[prev_k] but the drafter has no Markov head")


@dataclass
class GreedyChains:
    """A blocks' greedy chains, K slots each."""

    draft_tokens: Tensor  # [A, K] draft ids
    tokens: Tensor  # [A, K] target ids
    logprobs: Tensor  # [A, K] fp32 under softmax(Z_k)
    embeddings: Tensor | None  # [A, K, r] = W1[prev_k]
    logits: Tensor  # [A, K, V_d] corrected logits Z_k


def greedy_chains(base_logits: Tensor, anchors: Tensor, markov: MarkovHead | None,
                  hidden_post: Tensor | None = None, d2t: Tensor | None = None, cached: bool = True) -> GreedyChains:
    """The greedy chains of A blocks at once, one Markov step per slot over the A rows (ties -> the lowest draft
    id): base_logits [A, K, V_d], anchors [A] target ids, hidden_post [A, K, H] (read by gated/rnn heads);
    `cached`: MarkovHead.project's."""
    assert base_logits.dim() == 3 and anchors.shape == base_logits.shape[:1], (base_logits.shape, anchors.shape)
    A, K = base_logits.shape[:2]
    assert hidden_post is None or hidden_post.shape[:2] == (A, K), hidden_post.shape
    prev, state = anchors.long(), None
    draft_tokens, tokens, logprobs, embeddings, logits = [], [], [], [], []
    for k in range(K):
        hidden = None if hidden_post is None else hidden_post[:, k]
        z, e, state = markov_step(markov, base_logits[:, k], prev, hidden, state, cached)
        x = z.argmax(dim=-1)  # the first maximal index
        logprobs.append(torch.log_softmax(z, dim=-1).gather(1, x[:, None])[:, 0])
        prev = x if d2t is None else x + d2t[x]
        draft_tokens.append(x)
        tokens.append(prev)
        embeddings.append(e)
        logits.append(z)
    empty = torch.zeros(A, 0, dtype=torch.long, device=base_logits.device)
    stack = lambda xs, like: torch.stack(xs, dim=1) if xs else like  # noqa: E731
    emb = None if markov is None else stack(embeddings, torch.zeros(A, 0, markov.rank, device=base_logits.device))
    return GreedyChains(stack(draft_tokens, empty), stack(tokens, empty),
                        stack(logprobs, torch.zeros(A, 0, device=base_logits.device)), emb,
                        stack(logits, base_logits.float()))


def run_chain(base_logits: Tensor, anchor: int, markov: MarkovHead | None, hidden_post: Tensor | None = None,
              d2t: Tensor | None = None, temperature: float = 0.0,
              generator: torch.Generator | None = None, sample_top_k: int = 0) -> ChainSteps:
    """The Markov-corrected chain in plain torch (fp32); greedy (`greedy_chains`) when temperature == 0. With
    sample_top_k > 0 a sampled token is drawn from the top-k truncated softmax(Z_k / T), and that distribution is
    returned."""
    check_chain_inputs(base_logits, anchor, markov, d2t)
    if temperature == 0:
        g = greedy_chains(base_logits[None], torch.tensor([anchor], device=base_logits.device), markov,
                          None if hidden_post is None else hidden_post[None], d2t)
        return ChainSteps(g.draft_tokens[0].tolist(), g.tokens[0].tolist(), g.logprobs[0],
                          None if g.embeddings is None else g.embeddings[0], g.logits[0])
    n = base_logits.shape[0]
    prev, state, draft_tokens, tokens, logprobs, embeddings, logits = anchor, None, [], [], [], [], []
    sparse_ids, sparse_lps = [], []
    for k in range(n):
        hidden = None if hidden_post is None else hidden_post[k : k + 1]
        prev_t = torch.tensor([prev], device=base_logits.device)
        z, e, state = markov_step(markov, base_logits[k : k + 1], prev_t, hidden, state)
        z = z[0]
        embeddings.append(e)
        if temperature > 0 and sample_top_k > 0:
            ids, lps = draft_sparse_distribution(z[None], temperature, sample_top_k)
            slot = int(multinomial(lps[0].exp(), generator))
            x = int(ids[0, slot])
            logp = torch.full_like(z, float("-inf")).index_put_((ids[0],), lps[0])
            sparse_ids.append(torch.tensor([to_target(int(i), d2t) for i in ids[0]]))
            sparse_lps.append(lps[0])
        else:
            logp = torch.log_softmax(z / temperature, dim=-1)
            x = int(multinomial(logp.exp(), generator))
        draft_tokens.append(x)
        prev = to_target(x, d2t)
        tokens.append(prev)
        logprobs.append(logp[x])
        logits.append(z)
    emb = None if markov is None else torch.cat(embeddings) if embeddings else torch.zeros(0, markov.rank)
    lp = torch.stack(logprobs) if logprobs else torch.zeros(0)
    z_all = torch.stack(logits) if logits else base_logits.float()
    if sparse_ids:
        return ChainSteps(draft_tokens, tokens, lp, emb, z_all, torch.stack(sparse_ids), torch.stack(sparse_lps))
    return ChainSteps(draft_tokens, tokens, lp, emb, z_all)


class KernelChoiceError(ValueError):
    """A kernel the request cannot have (an unknown name, or the fused kernel for what it does not run)."""


class KernelUnavailable(RuntimeError):
    """The fused kernel cannot run on this machine."""


def check_kernel(name: str) -> None:
    if name not in KERNELS:
        raise KernelChoiceError(f"kernel must be one of {KERNELS}, got {name!r}")


def choose_kernel(requested: str, markov_kind: str | None, temperature: float, device: torch.device | str) -> str:
    """-> 'fused' (the Triton chain) or 'torch'. 'auto' fuses on a CUDA device when Triton is there, the head is
    vanilla (or absent) and decoding is greedy; the CPU interpreter (TRITON_INTERPRET=1) is for tests and runs when
    'fused' is asked for by name. A 'fused' request that cannot run is refused. A request's kernel name is checked
    by the caller (`check_kernel`, in DraftEngine.propose)."""
    assert requested in KERNELS, requested
    if requested == TORCH:
        return TORCH
    from dspark_grpc.runtime.kernels.markov_triton import triton_runnable

    fusable = markov_kind in (None, "vanilla") and temperature == 0
    if requested == "auto":
        return FUSED if fusable and torch.device(device).type == "cuda" and triton_runnable(device) else TORCH
    if not fusable:
        raise KernelChoiceError("the fused kernel runs the greedy chain of a vanilla Markov head; ask for the torch "
                              "kernel (or auto)")
    if not triton_runnable(device):
        raise KernelUnavailable("the fused Triton kernel cannot run here (no CUDA device, and the service was not "
                                 "started with TRITON_INTERPRET=1); ask for the torch kernel (or auto)")
    return FUSED


def draft_chain(base_logits: Tensor, hidden_pre: Tensor, hidden_post: Tensor, anchor: int,
                markov: MarkovHead | None, confidence: ConfidenceHead | None, d2t: Tensor | None = None,
                kernel: str = "auto", temperature: float = 0.0, generator: torch.Generator | None = None,
                sample_top_k: int = 0) -> Chain:
    """base_logits [K, V_d], hidden_pre/post [K, H] (before/after the drafter's final norm) -> the DSpark chain.

    Greedy (ties -> lowest draft id) when temperature == 0, else x_k ~ softmax(Z_k / T) with `generator`.
    Chain.logprobs are under softmax(Z_k) when greedy and softmax(Z_k / T) when sampling.
    """
    assert base_logits.dim() == 2 and hidden_pre.dim() == 2 and hidden_post.shape == hidden_pre.shape
    assert hidden_pre.shape[0] == base_logits.shape[0], "one hidden row per drafted slot"
    assert 0 <= temperature < float("inf"), temperature  # a request's temperature is checked by DraftEngine.propose
    check_chain_inputs(base_logits, anchor, markov, d2t, confidence)
    if choose_kernel(kernel, None if markov is None else markov.kind, temperature, base_logits.device) == FUSED:
        from dspark_grpc.runtime.kernels.markov_triton import markov_chain_fused

        return Chain(*markov_chain_fused(base_logits, hidden_pre, hidden_post, anchor, markov, confidence, d2t))
    if temperature == 0:
        return draft_chains(base_logits[None], hidden_pre[None], hidden_post[None],
                            torch.tensor([anchor], device=base_logits.device), markov, confidence, d2t)[0]
    steps = run_chain(base_logits, anchor, markov, hidden_post, d2t, temperature, generator, sample_top_k)
    conf = None
    if confidence is not None:
        conf = confidence(confidence.select_hidden(hidden_pre, hidden_post), steps.embeddings)
    return Chain(steps.tokens, steps.logprobs, conf, steps.draft_ids, steps.draft_logprobs)


def draft_chains(base_logits: Tensor, hidden_pre: Tensor, hidden_post: Tensor, anchors: Tensor,
                 markov: MarkovHead | None, confidence: ConfidenceHead | None,
                 d2t: Tensor | None = None) -> list[Chain]:
    """`draft_chain`'s greedy torch path for A blocks at once (the sessions of one drafter pass): base_logits
    [A, K, V_d], hidden_pre/post [A, K, H], anchors [A] target ids."""
    assert base_logits.dim() == 3 and hidden_pre.shape == hidden_post.shape == base_logits.shape[:2] + \
        hidden_pre.shape[2:], (base_logits.shape, hidden_pre.shape, hidden_post.shape)
    for anchor in anchors.tolist():
        check_chain_inputs(base_logits[0], anchor, markov, d2t, confidence)
    g = greedy_chains(base_logits, anchors, markov, hidden_post, d2t)
    conf = chain_confidences(confidence, hidden_pre, hidden_post, g.embeddings)
    A = g.tokens.shape[0]
    tokens = g.tokens.tolist()
    return [Chain(tokens[i], g.logprobs[i], None if conf is None else conf[i]) for i in range(A)]


def chain_confidences(confidence: ConfidenceHead | None, hidden_pre: Tensor, hidden_post: Tensor,
                      embeddings: Tensor | None) -> Tensor | None:
    """The calibrated confidences [A, K] of A greedy chains: hidden_pre/post [A, K, H], embeddings [A, K, r] (the
    chains' `GreedyChains.embeddings`); None without a confidence head."""
    if confidence is None:
        return None
    A, K = hidden_pre.shape[:2]
    hidden = confidence.select_hidden(hidden_pre, hidden_post).reshape(A * K, confidence.hidden_size)
    emb = None if embeddings is None else embeddings.reshape(A * K, embeddings.shape[-1])
    temps = confidence.position_temperatures(K).to(hidden.device)
    return torch.sigmoid(confidence.logits(hidden, emb).view(A, K) / temps)
