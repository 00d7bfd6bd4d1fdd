"""The greedy Markov chain (vanilla head) + confidence head as ONE Triton program.

Per slot k: e = W1[prev]; one pass over vocab tiles computes z = U[k] + W2 · e with a running max/argmax
(ties -> lowest index) and an online logsumexp, so log p(x_k) = max - lse comes out of the same pass; then
c_k = sigmoid((w · [h_k ; e] + b) / T_k) and prev = x_k (+ d2t[x_k]). The chain is sequential: grid (1,).
On CPU it runs only under TRITON_INTERPRET=1, set before triton is first imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dspark_grpc.runtime.drafting.markov import ConfidenceHead, MarkovHead

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still works; markov.choose_kernel refuses kernel="fused"
    triton = tl = None


# triton (its own library kernels included) picks the interpreter or the compiler when it is imported.
_INTERPRET = triton is not None and bool(triton.knobs.runtime.interpret)


def triton_runnable(device: torch.device | str) -> bool:
    """Triton can run here: TRITON_INTERPRET=1 was set before triton was imported, or `device` is a CUDA device."""
    if triton is None:
        return False
    if _INTERPRET:
        return True
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _chain_kernel(
    u_ptr, w1_ptr, w2_ptr, d2t_ptr, anchor_ptr, h_ptr, cw_ptr, cb_ptr, temps_ptr,
    tok_ptr, lp_ptr, conf_ptr,
    n_slots, vocab, rank, hidden, n_temps,
    stride_u, stride_w1, stride_w2, stride_h,
    HAS_MARKOV: tl.constexpr, HAS_D2T: tl.constexpr, HAS_CONF: tl.constexpr, CONF_MARKOV: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    prev = tl.load(anchor_ptr)
    for k in range(n_slots):
        e = tl.zeros([BLOCK_R], dtype=tl.float32)
        if HAS_MARKOV:
            e = tl.load(w1_ptr + prev * stride_w1 + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        best = float("-inf")
        best_idx = 0
        m = float("-inf")
        s = 0.0
        for v0 in range(0, vocab, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < vocab
            z = tl.load(u_ptr + k * stride_u + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            if HAS_MARKOV:
                w2 = tl.load(w2_ptr + offs_v[:, None] * stride_w2 + offs_r[None, :],
                             mask=mask_v[:, None] & mask_r[None, :], other=0.0).to(tl.float32)
                z += tl.sum(w2 * e[None, :], axis=1)
            z = tl.where(mask_v, z, float("-inf"))
            tile_max, tile_idx = tl.max(z, axis=0, return_indices=True, return_indices_tie_break_left=True)
            better = tile_max > best  # strict: an earlier tile keeps a tie
            best_idx = tl.where(better, v0 + tile_idx, best_idx)
            best = tl.where(better, tile_max, best)
            m_new = tl.maximum(m, tile_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        if HAS_CONF:
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for h0 in range(0, hidden, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                mask_h = offs_h < hidden
                hv = tl.load(h_ptr + k * stride_h + offs_h, mask=mask_h, other=0.0).to(tl.float32)
                acc += hv * tl.load(cw_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
            logit = tl.sum(acc, axis=0) + tl.load(cb_ptr).to(tl.float32)
            if CONF_MARKOV:
                logit += tl.sum(tl.load(cw_ptr + hidden + offs_r, mask=mask_r, other=0.0).to(tl.float32) * e, axis=0)
            temp = tl.load(temps_ptr + tl.minimum(k, n_temps - 1))
            tl.store(conf_ptr + k, tl.sigmoid(logit / temp))
        tok = best_idx.to(tl.int64)
        if HAS_D2T:
            tok += tl.load(d2t_ptr + tok)
        tl.store(tok_ptr + k, tok)
        tl.store(lp_ptr + k, best - m - tl.log(s))
        prev = tok


_chain_kernel = None if triton is None else triton.jit(_chain_kernel)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def markov_chain_fused(base_logits: Tensor, hidden_pre: Tensor, hidden_post: Tensor, anchor: int,
                       markov: MarkovHead | None, confidence: ConfidenceHead | None, d2t: Tensor | None = None,
                       block_v: int | None = None, num_warps: int = 8) -> tuple[list[int], Tensor, Tensor | None]:
    """The greedy chain of `markov.draft_chain` in one kernel launch (tokens, log-probabilities, confidences); the
    same tokens as the torch path. Its inputs are checked by the caller (markov.draft_chain)."""
    device = base_logits.device
    if not triton_runnable(device):
        raise RuntimeError(f"the fused Triton chain cannot run on {device} here (markov.choose_kernel says why)")
    n, vocab = base_logits.shape
    assert hidden_pre.shape[0] == n and hidden_post.shape == hidden_pre.shape
    u = base_logits.contiguous()
    rank = 0
    w1 = w2 = u
    if markov is not None:
        rank = markov.rank
        w1, w2 = markov.w1.weight.detach().contiguous(), markov.w2.weight.detach().contiguous()
    d2t_t = u if d2t is None else d2t.to(device=device, dtype=torch.int64).contiguous()
    anchor_t = torch.tensor([anchor], dtype=torch.int64, device=device)
    h = cw = cb = temps = u
    hidden = 1
    if confidence is not None:
        h = confidence.select_hidden(hidden_pre, hidden_post).contiguous()
        hidden = h.shape[1]
        assert hidden == confidence.hidden_size, f"hidden rows are {hidden} wide, not {confidence.hidden_size}"
        cw = confidence.proj.weight.detach().reshape(-1).contiguous()
        cb = confidence.proj.bias.detach().contiguous()
        temps = confidence.temperatures.to(device=device, dtype=torch.float32).contiguous()
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    logprobs = torch.empty(n, dtype=torch.float32, device=device)
    conf = torch.empty(n, dtype=torch.float32, device=device)
    block_r = _pow2(max(rank, 16))
    if block_v is None:
        block_v = min(_pow2(vocab), 4096) if _INTERPRET else max(16, min(1024, 16384 // block_r))
    assert block_v & (block_v - 1) == 0, f"block_v must be a power of two, got {block_v}"
    block_h = min(_pow2(hidden), 4096 if _INTERPRET else 1024)
    _chain_kernel[(1,)](
        u, w1, w2, d2t_t, anchor_t, h, cw, cb, temps,
        tokens, logprobs, conf,
        n, vocab, rank, hidden, temps.numel(),
        u.stride(0), w1.stride(0), w2.stride(0), h.stride(0),
        HAS_MARKOV=markov is not None, HAS_D2T=d2t is not None, HAS_CONF=confidence is not None,
        CONF_MARKOV=confidence is not None and confidence.with_markov,
        BLOCK_V=block_v, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=num_warps,
    )
    return tokens.tolist(), logprobs, conf if confidence is not None else None
