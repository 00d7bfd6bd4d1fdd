"""The training loop: seeded batches, AdamW with warmup + cosine decay, held-out acceptance estimates, checkpoints.

Every random choice derives from (seed, epoch) or (seed, step), so a resumed run replays the same batches and,
from the saved weights and optimizer state, reaches the same weights as an uninterrupted one.

Held-out estimate: greedy chains drafted exactly as the serving chain drafts them (drafting.markov.run_chain), on
held-out sequences the target generated greedily, so "draft k equals the target's continuation" is exactly the
greedy speculative step's acceptance. per_position[k] = P(the first k + 1 drafts are accepted), i.e. accepted /
drafted at depth k + 1 for full chains (vLLM's per-position acceptance); acceptance_length = 1 + mean accepted
drafts (tokens per target step, bonus included).

acceptance_length weighs every anchor alike. Decoding visits fewer anchors where drafts are accepted (a step covers
several positions) and more where they are not, so when easy and hard stretches alternate the tokens per step it
reaches are lower. Where the held-out anchors cover every position of a sequence, `decoded_length` walks them as
decoding does (model.decoded_steps): the tokens per step a greedy speculative run with whole chains would reach.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from dspark_grpc.runtime.formats.drafter_formats import save_drafter
from dspark_grpc.runtime.models.drafter import Drafter
from dspark_grpc.train.calibrate import survival_ece
from dspark_grpc.train.data import TargetSequence, stderr_progress
from dspark_grpc.train.losses import LossTerms, LossWeights, dspark_loss
from dspark_grpc.train.model import (
    AnchorBatch,
    accepted_lengths,
    anchor_range,
    confidence_logits,
    corrected_logits,
    decoded_steps,
    forward_blocks,
    greedy_chains,
    make_batch,
    sample_anchors,
    spread_anchors,
    trainable_parameters,
)
from torch import Tensor

STATE_FILE = "train_state.pt"
DRAFTER_DIR = "drafter"


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 1000
    batch: int = 8  # sequences per step
    anchors: int = 32  # anchors per sequence
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of the steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 100  # 0: only at the end
    eval_anchors: int = 16  # per held-out sequence
    eval_batch: int = 8  # held-out sequences per forward
    save_every: int = 0  # 0: only at the end
    losses: LossWeights = field(default_factory=LossWeights)
    time_budget: float = 0.0  # seconds; > 0: `steps` is cut to what fits, from the rate of the first steps


PROBE_STEPS = 30  # steps timed before a time budget sets the schedule's length


@dataclass
class EvalResult:
    step: int
    anchors: int
    loss: float
    ce: float
    tv: float
    kl: float
    bce: float
    soft_acceptance: list[float]  # mean c* per slot, teacher-forced
    per_position: list[float]  # greedy chains: P(first k + 1 drafts accepted)
    conditional: list[float]  # P(draft k accepted | drafts < k accepted)
    acceptance_length: float  # 1 + mean accepted drafts
    survival_ece: list[float]  # of the confidence head's survival, current temperatures
    decoded_length: float | None = None  # tokens per step as decoding visits anchors (None: anchors not dense)

    def line(self) -> str:
        fmt = " ".join
        return (f"eval @ {self.step}: {self.anchors} held-out chains, acceptance length {self.acceptance_length:.3f}, "
                f"per-position [{fmt(f'{x:.3f}' for x in self.per_position)}], conditional "
                f"[{fmt(f'{x:.3f}' for x in self.conditional)}], c* [{fmt(f'{x:.3f}' for x in self.soft_acceptance)}]"
                f", loss {self.loss:.4f} (ce {self.ce:.3f} tv {self.tv:.3f} kl {self.kl:.3f} bce {self.bce:.3f}), "
                f"survival ECE [{fmt(f'{x:.3f}' for x in self.survival_ece)}]"
                + ("" if self.decoded_length is None else f", as decoded {self.decoded_length:.3f}"))


@dataclass
class Chains:
    """Held-out greedy chains: what calibration needs."""

    confidence_logits: Tensor  # [A, K] raw
    accepted: Tensor  # [A]
    sequence: Tensor  # [A] index of the held-out sequence


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") % 2**63)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    warmup = max(1, round(settings.warmup * settings.steps))
    if step < warmup:
        return settings.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_for_step(sequences: Sequence[TargetSequence], step: int, settings: TrainSettings, num_drafts: int
                   ) -> AnchorBatch:
    """Sequences step * batch .. of a per-epoch seeded permutation, anchors drawn with a per-step generator."""
    n, chosen, perms = len(sequences), [], {}
    for j in range(settings.batch):
        epoch, index = divmod(step * settings.batch + j, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=_generator("epoch", settings.seed, epoch))
        chosen.append(sequences[int(perms[epoch][index])])
    g = _generator("anchors", settings.seed, step)
    anchors = [sample_anchors(s, settings.anchors, num_drafts, g) for s in chosen]
    return make_batch(chosen, anchors, num_drafts)


def batch_loss(drafter: Drafter, batch: AnchorBatch, t2d: Tensor, weights: LossWeights) -> LossTerms:
    rows = forward_blocks(drafter, batch)
    logits, embeddings = corrected_logits(drafter, rows, batch.prev_tokens)
    conf = confidence_logits(drafter, rows, embeddings)
    return dspark_loss(logits, conf, batch.topk_values, batch.topk_ids, batch.valid, t2d, weights)


@torch.no_grad()
def evaluate(drafter: Drafter, sequences: Sequence[TargetSequence], settings: TrainSettings, t2d: Tensor,
             step: int = 0) -> tuple[EvalResult, Chains]:
    """Teacher-forced losses and greedy chain acceptance on the greedy held-out sequences."""
    K, device = drafter.config.num_drafts, drafter.device
    t2d = t2d.to(device)
    greedy = [s for s in sequences if s.mode == "greedy"]
    sums = torch.zeros(5, dtype=torch.float64)
    soft, conf, accepted, seq_index, positions = [], [], [], [], []
    count = 0
    for begin in range(0, len(greedy), settings.eval_batch):
        chunk = greedy[begin: begin + settings.eval_batch]
        anchors = [spread_anchors(s, settings.eval_anchors, K) for s in chunk]
        if not any(anchors):
            continue
        batch = make_batch(chunk, anchors, K).to(device)
        rows = forward_blocks(drafter, batch)
        logits, embeddings = corrected_logits(drafter, rows, batch.prev_tokens)
        terms = dspark_loss(logits, confidence_logits(drafter, rows, embeddings), batch.topk_values, batch.topk_ids,
                            batch.valid, t2d, settings.losses)
        A = batch.num_anchors
        sums += A * torch.tensor([float(terms.total), float(terms.ce), float(terms.tv), float(terms.kl),
                                  float(terms.bce)], dtype=torch.float64)
        count += A
        drafted, chain_conf = greedy_chains(drafter, rows, batch.anchor_tokens)
        accepted.append(accepted_lengths(drafted, batch.labels, batch.valid).cpu())
        soft.append(terms.soft_acceptance.cpu())
        conf.append((torch.zeros(A, K) if chain_conf is None else chain_conf).cpu())
        seq_index.append(batch.anchor_seq.cpu() + begin)
        positions.append(batch.anchor_pos.cpu())
    if count == 0:
        raise ValueError("no held-out sequence is long enough for a full block")
    acc = torch.cat(accepted)
    decoded = _decoded_length(greedy, torch.cat(seq_index), torch.cat(positions), acc, K)
    per_position = [float((acc >= k + 1).double().mean()) for k in range(K)]
    conditional = [per_position[0]] + [b / a if a > 0 else 0.0 for a, b in zip(per_position, per_position[1:],
                                                                                  strict=False)]
    chains = Chains(torch.cat(conf), acc, torch.cat(seq_index))
    temps = drafter.config.confidence_temperatures
    ece = survival_ece(chains.confidence_logits, acc, None if temps is None else _pad(temps, K))
    loss, ce, tv, kl, bce = (sums / count).tolist()
    result = EvalResult(step, count, loss, ce, tv, kl, bce, torch.cat(soft).mean(0).tolist(), per_position,
                        conditional, 1.0 + float(acc.double().mean()), ece, decoded)
    return result, chains


def _decoded_length(sequences: Sequence[TargetSequence], seq_index: Tensor, positions: Tensor, accepted: Tensor,
                    num_drafts: int) -> float | None:
    """Tokens per step over the sequences whose every anchor (full blocks) was evaluated, walked as decoding
    visits them; None when no sequence was covered."""
    by_seq: dict[int, dict[int, int]] = {}
    for i, p, a in zip(seq_index.tolist(), positions.tolist(), accepted.tolist(), strict=True):
        by_seq.setdefault(i, {})[p] = a
    tokens = steps = 0
    for i, accepted_at in by_seq.items():
        first, last = anchor_range(sequences[i], num_drafts, full_blocks=True)
        if len(accepted_at) == last - first + 1:
            t, s = decoded_steps(accepted_at, first, last)
            tokens, steps = tokens + t, steps + s
    return tokens / steps if steps else None


def _pad(temps: Sequence[float], n: int) -> list[float]:
    return [float(temps[min(i, len(temps) - 1)]) for i in range(n)]


def suggest_block_size(per_position: Sequence[float], threshold: float = 0.02, convention: str = "dspark") -> int:
    """The smallest block whose drafts include every position accepted at least `threshold` of the time."""
    useful = max([k + 1 for k, p in enumerate(per_position) if p >= threshold], default=1)
    return useful if convention == "dspark" else useful + 1


# -- checkpoints --------------------------------------------------------------------------------------------------


def save_state(out_dir: str | os.PathLike[str], drafter: Drafter, optimizer: torch.optim.Optimizer, step: int,
               extra: dict | None = None) -> Path:
    """out_dir/drafter (speculators layout: loadable by load_drafter with the target) and out_dir/train_state.pt
    (step, optimizer, the trainable tensors exactly, run info)."""
    out = Path(out_dir)
    save_drafter(drafter, out / DRAFTER_DIR, layout="speculators")
    state = {
        "step": step,
        "optimizer": optimizer.state_dict(),
        "trainable": {n: p.detach().cpu().clone() for n, p in drafter.named_parameters() if p.requires_grad},
        "extra": extra or {},
    }
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out / STATE_FILE)
    return out


def load_state(out_dir: str | os.PathLike[str]) -> dict | None:
    path = Path(out_dir) / STATE_FILE
    return torch.load(path, weights_only=True, map_location="cpu") if path.exists() else None


def train(
    drafter: Drafter,
    train_sequences: Sequence[TargetSequence],
    heldout_sequences: Sequence[TargetSequence],
    t2d: Tensor,
    settings: TrainSettings,
    *,
    out_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    until: int | None = None,
    log: Callable[[str], None] | None = None,
    progress: Callable[[str], None] | None = stderr_progress,
) -> list[EvalResult]:
    """Train `drafter` in place for settings.steps steps (stop early after step `until`, as an interrupted run
    would); evaluate every eval_every steps and at the end; save to out_dir every save_every steps and at the end."""
    K, device = drafter.config.num_drafts, drafter.device
    t2d = t2d.to(device)
    params = trainable_parameters(drafter)
    optimizer = torch.optim.AdamW([p for _, p in params], lr=settings.lr, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=settings.weight_decay)
    start = 0
    state = load_state(out_dir) if resume and out_dir is not None else None
    if state is not None:
        with torch.no_grad():
            for name, p in params:
                p.copy_(state["trainable"][name])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    history: list[EvalResult] = []
    end = settings.steps if until is None else min(until, settings.steps)
    t0, done = time.perf_counter(), 0
    step = start
    while step < end:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        batch = batch_for_step(train_sequences, step, settings, K).to(device)
        terms = batch_loss(drafter, batch, t2d, settings.losses)
        optimizer.zero_grad(set_to_none=True)
        terms.total.backward()
        if settings.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in params], settings.grad_clip)
        optimizer.step()
        done += 1
        if progress is not None:
            rate = (time.perf_counter() - t0) / done
            progress(f"step {step + 1}/{settings.steps} loss {float(terms.total.detach()):.4f} "
                     f"(ce {float(terms.ce):.3f} tv {float(terms.tv):.3f} bce {float(terms.bce):.3f}) c* "
                     f"{float(terms.soft_acceptance[:, 0].mean()):.3f} lr {lr_at(step, settings):.2e} "
                     f"{rate:.2f} s/step, eta {rate * (end - step - 1):.0f} s")
        last = step + 1 == settings.steps
        if heldout_sequences and ((settings.eval_every and (step + 1) % settings.eval_every == 0) or last):
            result, _ = evaluate(drafter, heldout_sequences, settings, t2d, step + 1)
            history.append(result)
            if log is not None:
                log(result.line())
        if out_dir is not None and ((settings.save_every and (step + 1) % settings.save_every == 0) or last
                                    or step + 1 == end):
            save_state(out_dir, drafter, optimizer, step + 1, {"settings": _jsonable(asdict(settings))})
        step += 1
        if settings.time_budget > 0 and done == PROBE_STEPS and not last:
            settings = budgeted(settings, step, time.perf_counter() - t0, done)
            end = settings.steps if until is None else min(until, settings.steps)
            if log is not None:
                log(f"time budget {settings.time_budget:.0f} s: {settings.steps} steps at "
                    f"{(time.perf_counter() - t0) / done:.3f} s/step")
    return history


def budgeted(settings: TrainSettings, step: int, elapsed: float, done: int, spare: float = 0.15) -> TrainSettings:
    """settings with `steps` cut to what fits the time budget at the rate so far (a share `spare` of the budget
    kept for evaluations and checkpoints); never more than settings.steps, never fewer than one more step than done
    (the last one evaluates and saves)."""
    rate = elapsed / max(1, done)
    fits = step + int(max(0.0, settings.time_budget * (1 - spare) - elapsed) / max(rate, 1e-9))
    return dataclasses.replace(settings, steps=min(settings.steps, max(step + 1, fits)))


def _jsonable(value: object) -> object:
    return json.loads(json.dumps(value, default=str))
