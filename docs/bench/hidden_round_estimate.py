"""Would drafting the next round during the verify pay? Outcome hit rates and late-capture acceptance (issue 59 item 3).

    PYTHONPATH=. .venv/bin/python docs/bench/hidden_round_estimate.py docs/prompts/heldout.jsonl [--limit N] \
        [--chain K] [--drafter DIR] [--json OUT]
    PYTHONPATH=. .venv/bin/python docs/bench/hidden_round_estimate.py humaneval --limit 20 --json OUT

The sequences are drafter_estimate.py's (`prompt_sequences`): each prompt continued greedily by the embedded target
(128 new tokens) with the captures of every token. Each sequence is walked as greedy speculative decoding visits it:
at anchor p (the token at p; captures of positions < p) the drafter drafts a greedy chain d1..dK, k = how many match
the target, the bonus b is the target's token at p + k + 1, the next anchor is p + k + 1. Reported:

1. the baseline tokens per step (k + 1) with on-time captures;
2. how often the verify's outcome (k, b) is among the drafter's N likeliest guesses, made before the verify: for k < K
   b among the drafter's top alternatives to d_{k+1} at slot k + 1, for k = K b among its top tokens one slot deeper
   (the block drafted one MASK longer: [anchor, MASK x K]); ranked by the drafter's softmax (P(d1..dk) * P(b)) and by
   its calibrated confidence head (c1..ck * (1 - c_{k+1}) * P(b | not d_{k+1}));
3. the next chain's (anchor b at p + k + 1) tokens per step when the captures of a, d1..dk (rows p..p+k, which the
   hidden verify produces) are late: (i) those rows absent from the context (the block keeps its true positions),
   (ii) a, d1..dk put in the block as known tokens ahead of b: block [a, d1..dk, b, MASK x (B-1)] at positions
   p..p+k+B, the drafts read from the slots from b on;
4. decoding simulated with a cache of the top-N guessed outcomes drafted with late captures: a hit serves the next
   round from the cache (drafted late), a miss drafts it after the verify (on time, as today).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from dspark_grpc.bench.prompts import HUMANEVAL
from dspark_grpc.runtime.drafting.markov import chain_confidences, greedy_chains, markov_step
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.drafter_formats import load_drafter
from dspark_grpc.runtime.models.drafter import BlockKV, Drafter, sliding_mask
from dspark_grpc.train.data import TargetSequence
from torch import Tensor

from docs.bench import drafter_estimate

TOP_N = (1, 2, 3, 4, 8)
CACHE_N = (1, 2, 4)
ALTERNATIVES = 8  # per slot: enough for an exact rank up to max(TOP_N)
CHUNK = 192  # blocks per drafter forward
RANKINGS = ("softmax", "confidence")
LATE = ("i", "ii")
VERIFY_COST, ROUND_COST = 1.0, 0.4  # in AR steps, for the crude time model of item 4


@dataclass(frozen=True)
class Spec:
    """One drafter block: rows < ctx of the context, the block `tokens` (+ MASKs) at positions start.., the anchor
    at index `anchor` of the block."""

    q: int  # the anchor's position
    mode: str  # "on" | "i" | "ii"
    prev: int  # the previous anchor p (late modes), = q on time
    ctx: int
    start: int
    tokens: tuple[int, ...]


@dataclass
class ChainResult:
    k: int  # drafts accepted
    has_bonus: bool  # the sequence holds the bonus token (else no outcome to guess)
    rank: dict[str, int | None]  # the actual outcome's rank (0 = top) per ranking; None: not among the candidates


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sequences_for(source: str, layer_ids: list[int], limit: int | None) -> list[TargetSequence]:
    """drafter_estimate.prompt_sequences, on the first `limit` prompts."""
    if source == HUMANEVAL:
        if limit is not None:
            drafter_estimate.HUMANEVAL_LIMIT = min(limit, drafter_estimate.HUMANEVAL_LIMIT)
        return drafter_estimate.prompt_sequences(Path(source), layer_ids)
    lines = Path(source).read_text().splitlines()
    if limit is None or limit >= len(lines):
        return drafter_estimate.prompt_sequences(Path(source), layer_ids)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("\n".join(lines[:limit]) + "\n")
    return drafter_estimate.prompt_sequences(Path(f.name), layer_ids)


def context_kv(drafter: Drafter, seq: TargetSequence) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Positions [R] and per layer (K, V) of every captured row of the sequence."""
    rows = seq.features.reshape(seq.features.shape[0], -1).to(device=drafter.device, dtype=drafter.dtype)
    pos = torch.arange(rows.shape[0], device=drafter.device)
    return pos, drafter.context_kv(rows, pos)


def block_hidden(drafter: Drafter, ctx_pos: Tensor, kv: list[tuple[Tensor, Tensor]], specs: Sequence[Spec],
                 length: int) -> Tensor:
    """The drafter's rows [A, length, H] (before the final norm) for blocks of one length: spec.tokens then MASKs
    at positions spec.start.., attending to context rows < spec.ctx and (full attention) to their whole block."""
    c, device = drafter.config, drafter.device
    A = len(specs)
    tokens = torch.full((A, length), c.mask_token_id, dtype=torch.long)
    for i, s in enumerate(specs):
        tokens[i, :len(s.tokens)] = torch.tensor(s.tokens)
    q_pos = (torch.tensor([s.start for s in specs])[:, None] + torch.arange(length)).reshape(-1).to(device)
    limit = torch.tensor([s.ctx for s in specs], device=device).repeat_interleave(length)
    q_block = torch.arange(A, device=device).repeat_interleave(length)
    full = torch.cat([ctx_pos[None, :] < limit[:, None], q_block[:, None] == q_block[None, :]], dim=1)
    masks = {"full_attention": full}
    if "sliding_attention" in c.layer_types:
        key_pos = torch.cat([ctx_pos, q_pos])
        masks["sliding_attention"] = full & sliding_mask(q_pos, key_pos, c.sliding_window, c.causal_sliding)
    x = drafter.embed(tokens.reshape(-1).to(device))
    cos, sin = drafter.rope(q_pos, x.dtype)
    for i, layer in enumerate(drafter.layers):
        k, v = kv[i]
        x = layer(x, cos, sin, masks[c.layer_types[i]], BlockKV(k, v))
    return x.view(A, length, -1)


def to_target(drafter: Drafter, ids: Tensor) -> Tensor:
    return ids if drafter.d2t is None else ids + drafter.d2t[ids]


@torch.no_grad()
def draft(drafter: Drafter, seq: TargetSequence, ctx_pos: Tensor, kv: list[tuple[Tensor, Tensor]],
          specs: Sequence[Spec], K: int) -> list[ChainResult]:
    """The greedy chain of each spec (its first K drafts), scored against the target's sequence."""
    c = drafter.config
    D = c.num_drafts
    off = 0 if c.slot_convention == "dspark" else 1  # the block row that drafts the token after the anchor
    a0 = len(specs[0].tokens) - 1
    assert all(len(s.tokens) - 1 == a0 for s in specs)
    rows = block_hidden(drafter, ctx_pos, kv, specs, a0 + c.block_size)[:, a0 + off: a0 + off + D]
    post = drafter.norm(rows)
    base = drafter.lm_head(post).float()  # [A, D, V_d]
    anchors = torch.tensor([s.tokens[-1] for s in specs], device=drafter.device)
    g = greedy_chains(base, anchors, drafter.markov, post, drafter.d2t)
    conf = chain_confidences(drafter.confidence, rows, post, g.embeddings)
    logp = torch.log_softmax(g.logits, dim=-1)  # [A, D, V_d]: slot j's corrected distribution, prev = d_j
    if K < D:
        deeper = logp[:, K]
    else:  # one slot deeper: the block one MASK longer, its last row, Markov bias from d_K
        longer = block_hidden(drafter, ctx_pos, kv, specs, a0 + c.block_size + 1)[:, a0 + off + D]
        z, _, _ = markov_step(drafter.markov, drafter.lm_head(drafter.norm(longer)).float(), g.tokens[:, K - 1],
                              drafter.norm(longer))
        deeper = torch.log_softmax(z, dim=-1)
    drafted = g.tokens[:, :K].cpu()
    lp_drafted = g.logprobs[:, :K].double().cpu()
    # Alternatives at slots 1..K (excluding the draft) and the deeper slot.
    slot_lp = torch.cat([logp[:, :K], deeper[:, None]], dim=1)  # [A, K + 1, V_d]
    top_lp, top_ids = slot_lp.topk(ALTERNATIVES + 1, dim=-1)
    top_t = to_target(drafter, top_ids).cpu()
    top_lp = top_lp.double().cpu()
    conf = None if conf is None else conf[:, :K].double().cpu().clamp(1e-9, 1 - 1e-9)
    n = seq.tokens.shape[0]
    results = []
    for i, s in enumerate(specs):
        q = s.q
        labels = seq.tokens[q + 1: q + 1 + K]
        hit = (drafted[i, :labels.shape[0]] == labels).long().cumprod(0)
        k = int(hit.sum())
        rank: dict[str, int | None] = dict.fromkeys(RANKINGS)
        has_bonus = q + k + 1 < n and labels.shape[0] == K
        if has_bonus:
            rank = outcome_ranks(drafted[i], lp_drafted[i], top_t[i], top_lp[i], None if conf is None else conf[i],
                                 k, int(seq.tokens[q + k + 1]))
        results.append(ChainResult(k, has_bonus, rank))
    return results


def outcome_ranks(drafted: Tensor, lp_drafted: Tensor, top_t: Tensor, top_lp: Tensor, conf: Tensor | None, k: int,
                  bonus: int) -> dict[str, int | None]:
    """The rank of the outcome (k, bonus) among the candidates (j, b): b one of the top alternatives at slot j + 1
    (other than d_{j+1} for j < K), scored by each ranking; None where it is not a candidate (rank >= ALTERNATIVES)."""
    K = drafted.shape[0]
    scores: dict[str, list[float]] = {r: [] for r in RANKINGS}
    actual: dict[str, float | None] = dict.fromkeys(RANKINGS)
    cum_lp = torch.cat([torch.zeros(1, dtype=torch.float64), lp_drafted.cumsum(0)])
    cum_c = None if conf is None else torch.cat([torch.zeros(1, dtype=torch.float64), conf.log().cumsum(0)])
    for j in range(K + 1):
        kept = 0
        for lp, b in zip(top_lp[j].tolist(), top_t[j].tolist(), strict=True):
            if j < K and b == int(drafted[j]):
                continue
            if kept == ALTERNATIVES:
                break
            kept += 1
            sm = float(cum_lp[j]) + lp
            if cum_c is None:
                cf = sm
            elif j < K:
                p_draft = math.exp(float(lp_drafted[j]))
                cf = float(cum_c[j]) + math.log(1 - float(conf[j])) + lp - math.log(max(1e-12, 1 - p_draft))
            else:
                cf = float(cum_c[j]) + lp
            scores["softmax"].append(sm)
            scores["confidence"].append(cf)
            if j == k and b == bonus:
                actual["softmax"], actual["confidence"] = sm, cf
    return {r: None if actual[r] is None else sum(x > actual[r] for x in scores[r]) for r in RANKINGS}


def specs_for(seq: TargetSequence, K: int, B: int) -> tuple[int, int, list[Spec]]:
    """Anchors first..last (full chains, as evaluate's decoded_length) and every block the walks may visit: on time,
    and late after each possible previous anchor p = q - j - 1 (j = 0..K drafts accepted there)."""
    first, last = seq.prompt_len - 1, seq.tokens.shape[0] - 1 - K
    tok = seq.tokens.tolist()
    specs = []
    for q in range(first, last + 1):
        specs.append(Spec(q, "on", q, q, q, (tok[q],)))
        for j in range(K + 1):
            p = q - j - 1
            if p < first:
                break
            specs.append(Spec(q, "i", p, p, q, (tok[q],)))
            specs.append(Spec(q, "ii", p, p, p, tuple(tok[p: q + 1])))
    return first, last, specs


def sequence_results(drafter: Drafter, seq: TargetSequence, K: int) -> tuple[int, int, dict]:
    first, last, specs = specs_for(seq, K, drafter.config.block_size)
    ctx_pos, kv = context_kv(drafter, seq)
    out: dict[tuple[int, str, int], ChainResult] = {}
    groups: dict[int, list[Spec]] = {}
    for s in specs:
        groups.setdefault(len(s.tokens), []).append(s)
    for group in groups.values():
        for b in range(0, len(group), CHUNK):
            chunk = group[b: b + CHUNK]
            for s, r in zip(chunk, draft(drafter, seq, ctx_pos, kv, chunk, K), strict=True):
                out[(s.q, s.mode, s.prev)] = r
    return first, last, out


def mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def figures(per_seq: list[tuple[int, int, dict]], K: int) -> dict:
    # 1-3: the on-time walk.
    steps = 0
    tokens: list[int] = []
    ks = [0] * (K + 1)
    ranks: dict[str, list[int | None]] = {r: [] for r in RANKINGS}
    nxt: dict[str, list[int]] = {m: [] for m in ("on", *LATE)}
    nxt_hit: dict[tuple[str, int], dict[str, list[int]]] = {}
    by_k: dict[int, dict[str, list[int]]] = {}  # by the k of the step before (k + 1 late rows)
    for first, last, res in per_seq:
        p = first
        while p <= last:
            r = res[(p, "on", p)]
            steps += 1
            tokens.append(r.k + 1)
            ks[r.k] += 1
            q = p + r.k + 1
            if r.has_bonus:
                for name in RANKINGS:
                    ranks[name].append(r.rank[name])
            if q <= last:
                for m in nxt:
                    nxt[m].append(res[(q, m, q if m == "on" else p)].k + 1)
                    by_k.setdefault(r.k, {x: [] for x in nxt})[m].append(res[(q, m, q if m == "on" else p)].k + 1)
                for name in RANKINGS:
                    for n in CACHE_N:
                        rk = r.rank[name]
                        if rk is not None and rk < n:
                            d = nxt_hit.setdefault((name, n), {m: [] for m in nxt})
                            for m in nxt:
                                d[m].append(res[(q, m, q if m == "on" else p)].k + 1)
            p = q
    hit_rates = {name: {str(n): sum(1 for x in ranks[name] if x is not None and x < n) / len(ranks[name])
                        for n in TOP_N} for name in RANKINGS}
    open_loop = {name: {str(n): {"hit_share": len(nxt_hit.get((name, n), {"on": []})["on"]) / len(nxt["on"]),
                                 **{f"next_tokens_{m}": mean(nxt_hit.get((name, n), {m: []})[m]) for m in nxt}}
                        for n in CACHE_N} for name in RANKINGS}
    # 4: closed-loop simulation with a top-N cache drafted late.
    sims = {}
    for name in RANKINGS:
        for mode in LATE:
            for n in CACHE_N:
                sims[f"{name}/{mode}/N={n}"] = simulate(per_seq, name, mode, n)
    return {
        "steps": steps,
        "tokens_per_step_on_time": mean(tokens),
        "k_distribution": [x / steps for x in ks],
        "outcome_steps": len(ranks["softmax"]),
        "outcome_hit_rate": hit_rates,
        "next_chain_steps": len(nxt["on"]),
        "next_chain_tokens_per_step": {m: mean(v) for m, v in nxt.items()},
        "next_chain_on_cache_hits": open_loop,
        "next_chain_by_previous_k": {str(k): {"steps": len(v["on"]), **{m: mean(x) for m, x in v.items()}}
                                     for k, v in sorted(by_k.items())},
        "simulated": sims,
    }


def simulate(per_seq: list[tuple[int, int, dict]], ranking: str, mode: str, n: int) -> dict:
    """Decoding with a top-n cache: after a step at p whose outcome is among its n likeliest guesses, the next chain
    is the one drafted with captures < p (`mode`); otherwise it is drafted on time."""
    steps = hits = 0
    tokens = hit_tokens = 0
    for first, last, res in per_seq:
        p, prev = first, None
        while p <= last:
            r = res[(p, "on", p)] if prev is None else res[(p, mode, prev)]
            steps += 1
            tokens += r.k + 1
            if prev is not None:
                hits += 1
                hit_tokens += r.k + 1
            rk = r.rank[ranking]
            q = p + r.k + 1
            prev = p if rk is not None and rk < n else None
            p = q
    hit_share = hits / steps
    rate = tokens / steps
    return {"steps": steps, "hit_share": hit_share, "tokens_per_step": rate,
            "tokens_per_step_on_hits": hit_tokens / hits if hits else None,
            "time_per_step": VERIFY_COST + (1 - hit_share) * ROUND_COST}


def print_report(fig: dict, label: str) -> None:
    K = len(fig["k_distribution"]) - 1
    base = fig["tokens_per_step_on_time"]
    print(f"\n== {label}: {fig['steps']} steps (on-time walk), K = {K}")
    print(f"1. tokens per step, on-time captures: {base:.3f}")
    print("   k distribution: " + "  ".join(f"k={k}: {x:.3f}" for k, x in enumerate(fig["k_distribution"])))
    print(f"2. outcome (k, b) among the drafter's top N guesses ({fig['outcome_steps']} steps with a bonus):")
    print("   ranking      " + "".join(f"  N={n:<5}" for n in TOP_N))
    for name, rates in fig["outcome_hit_rate"].items():
        print(f"   {name:<12} " + "".join(f"  {rates[str(n)]:.3f}  " for n in TOP_N))
    nt = fig["next_chain_tokens_per_step"]
    print(f"3. next chain's tokens per step, same {fig['next_chain_steps']} steps: on time {nt['on']:.3f}, late (i) "
          f"rows absent {nt['i']:.3f}, late (ii) rows as block tokens {nt['ii']:.3f}")
    print("   by the previous step's k (k + 1 rows late):  k  steps  on time  late(i)  late(ii)")
    for k, d in fig["next_chain_by_previous_k"].items():
        print(f"   {'':<44} {k:<2} {d['steps']:5}  {d['on']:7.3f}  {d['i']:7.3f}  {d['ii']:7.3f}")
    print("   on the steps a top-N cache hits (open loop, on-time walk):")
    print("   ranking      N  hit share  on time  late(i)  late(ii)")
    for name, by_n in fig["next_chain_on_cache_hits"].items():
        for n, d in by_n.items():
            f = lambda x: "   -   " if x is None else f"{x:7.3f}"  # noqa: E731
            print(f"   {name:<12} {n:<2} {d['hit_share']:9.3f}  {f(d['next_tokens_on'])}  {f(d['next_tokens_i'])}  "
                  f"{f(d['next_tokens_ii'])}")
    print(f"4. decoding simulated with a top-N cache drafted late (misses drafted on time); throughput relative to "
          f"today = (tokens/step / ({VERIFY_COST} + miss share * {ROUND_COST})) / ({base:.3f} / "
          f"{VERIFY_COST + ROUND_COST})")
    print("   ranking/late/N        hit share  tokens/step  on hits  rel. throughput")
    for key, s in fig["simulated"].items():
        rel = (s["tokens_per_step"] / s["time_per_step"]) / (base / (VERIFY_COST + ROUND_COST))
        on_hits = "   -   " if s["tokens_per_step_on_hits"] is None else f"{s['tokens_per_step_on_hits']:7.3f}"
        print(f"   {key:<22} {s['hit_share']:9.3f}  {s['tokens_per_step']:11.3f}  {on_hits}  {rel:8.3f}")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", help="a bench prompts .jsonl, or 'humaneval'")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts")
    ap.add_argument("--chain", type=int, default=None, help="drafts per chain (default: the drafter's num_drafts)")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    ap.add_argument("--json", default=None, help="write the config and figures here")
    args = ap.parse_args(argv)
    from docs.bench.figures import shipped_drafter

    drafter_path = Path(args.drafter) if args.drafter else shipped_drafter()
    drafter = load_drafter(drafter_path, target_path=default_model_path()).eval()
    c = drafter.config
    K = c.num_drafts if args.chain is None else args.chain
    if not 1 <= K <= c.num_drafts:
        sys.exit(f"--chain must be within 1..{c.num_drafts}")
    t0 = time.perf_counter()
    sequences = [s for s in sequences_for(args.source, list(c.target_layer_ids), args.limit) if s.mode == "greedy"]
    t1 = time.perf_counter()
    per_seq = [sequence_results(drafter, s, K) for s in sequences]
    t2 = time.perf_counter()
    fig = figures(per_seq, K)
    label = f"{args.source} ({len(sequences)} sequences)"
    print(f"{label}: generated in {t1 - t0:.0f} s, drafted in {t2 - t1:.0f} s; drafter {drafter_path} "
          f"(block {c.block_size}, {c.slot_convention} slots, chain K = {K})")
    print_report(fig, label)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        config = {"source": args.source, "limit": args.limit, "sequences": len(sequences), "chain": K,
                  "drafter": str(drafter_path), "block_size": c.block_size, "new_tokens": drafter_estimate.NEW_TOKENS,
                  "alternatives_per_slot": ALTERNATIVES, "time_model": {"verify": VERIFY_COST, "round": ROUND_COST}}
        out.write_text(json.dumps({"commit": git_head(), "config": config, "figures": fig}, indent=1) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
