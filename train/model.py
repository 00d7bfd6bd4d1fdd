"""Teacher-forced DSpark forward over many anchors at once, and a drafter warm-started from its target.

A batch packs several sequences: their context rows (the target's features at every position before the latest
anchor) and one block [anchor, MASK x (B-1)] per anchor at positions p..p+B-1. Every block query sees the context
rows of its own sequence with position < p (never the anchor's own feature) and its own block's rows, all of them
in full-attention layers (dspark_algorithm.md §1.4, §3.1). The weights are Drafter's own modules, so one anchor
here gives exactly Drafter.forward_block's base logits.

Draft row j of a block predicts the token at p + j + 1 (both slot conventions: DFlash drops the block's row 0),
and its Markov bias reads the previous token y_j of the target's own continuation, y_0 = the anchor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from dspark_grpc.runtime.drafting.markov import greedy_chains as greedy_chains_of
from dspark_grpc.runtime.drafting.markov import markov_step
from dspark_grpc.runtime.formats.drafter_config import default_target_layer_ids
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.runtime.models.drafter import BlockKV, Drafter, sliding_mask
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.train.data import TargetSequence
from dspark_grpc.train.vocab import DraftVocab
from torch import Tensor


@dataclass
class AnchorBatch:
    context: Tensor  # [R, m * H_t] target features of the context rows, all sequences packed
    context_pos: Tensor  # [R] absolute positions
    context_seq: Tensor  # [R] which sequence of the batch
    anchor_tokens: Tensor  # [A]
    anchor_pos: Tensor  # [A]
    anchor_seq: Tensor  # [A]
    prev_tokens: Tensor  # [A, K] teacher-forced previous token of each draft row (target ids): anchor, y_1, ...
    labels: Tensor  # [A, K] the target's token each row predicts (target ids), 0 where invalid
    valid: Tensor  # [A, K] bool: the sequence reaches that label
    topk_values: Tensor  # [A, K, k] the target's top-k logits at the row's position (p + j)
    topk_ids: Tensor  # [A, K, k]

    def to(self, device: torch.device | str) -> AnchorBatch:
        return AnchorBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    @property
    def num_anchors(self) -> int:
        return self.anchor_tokens.shape[0]


@dataclass
class BlockRows:
    hidden_pre: Tensor  # [A, K, H] before the final norm
    hidden_post: Tensor  # [A, K, H]
    base_logits: Tensor  # [A, K, V_d] float32, without the Markov bias


def anchor_range(seq: TargetSequence, num_drafts: int, full_blocks: bool = False) -> tuple[int, int]:
    """[first, last] anchor positions with a label from the target's continuation (full_blocks: every row's)."""
    n = seq.tokens.shape[0]
    last = n - 1 - (num_drafts if full_blocks else 1)
    return seq.prompt_len - 1, last


def make_batch(sequences: Sequence[TargetSequence], anchors: Sequence[Sequence[int]], num_drafts: int) -> AnchorBatch:
    """Blocks at the given anchor positions of each sequence (each in anchor_range)."""
    assert len(sequences) == len(anchors)
    K = num_drafts
    parts: dict[str, list[Tensor]] = {f.name: [] for f in fields(AnchorBatch)}
    for s, (seq, positions) in enumerate(zip(sequences, anchors, strict=True)):
        if not positions:
            continue
        first, last = anchor_range(seq, K)
        pos = torch.tensor(sorted(positions), dtype=torch.long)
        assert first <= int(pos[0]) and int(pos[-1]) <= last, (positions, first, last)
        n, rows = seq.tokens.shape[0], int(pos[-1])
        parts["context"].append(seq.features[:rows].reshape(rows, -1))
        parts["context_pos"].append(torch.arange(rows))
        parts["context_seq"].append(torch.full((rows,), s))
        parts["anchor_tokens"].append(seq.tokens[pos])
        parts["anchor_pos"].append(pos)
        parts["anchor_seq"].append(torch.full((pos.numel(),), s))
        j = pos[:, None] + torch.arange(K)[None, :]  # [A, K] the position each row's distribution is read at
        valid = j + 1 < n
        parts["valid"].append(valid)
        parts["prev_tokens"].append(seq.tokens[j.clamp(max=n - 1)])
        parts["labels"].append(torch.where(valid, seq.tokens[(j + 1).clamp(max=n - 1)], 0))
        t = (j - (seq.prompt_len - 1)).clamp(max=seq.topk_values.shape[0] - 1)
        parts["topk_values"].append(seq.topk_values[t])
        parts["topk_ids"].append(seq.topk_ids[t])
    if not parts["anchor_pos"]:
        raise ValueError("a batch needs at least one anchor")
    return AnchorBatch(**{name: torch.cat(values) for name, values in parts.items()})


def sample_anchors(seq: TargetSequence, count: int, num_drafts: int, generator: torch.Generator) -> list[int]:
    first, last = anchor_range(seq, num_drafts)
    available = last - first + 1
    if available <= 0:
        return []
    chosen = torch.randperm(available, generator=generator)[: min(count, available)] + first
    return sorted(chosen.tolist())


def spread_anchors(seq: TargetSequence, count: int, num_drafts: int) -> list[int]:
    """Up to `count` evenly spaced anchors whose whole block has labels (for evaluation)."""
    first, last = anchor_range(seq, num_drafts, full_blocks=True)
    if last < first:
        return []
    return sorted(set(torch.linspace(first, last, min(count, last - first + 1)).round().long().tolist()))


def block_masks(drafter: Drafter, batch: AnchorBatch) -> dict[str, Tensor]:
    """Per layer type, the [A * B, R + A * B] bool mask of the packed blocks (True = may attend)."""
    c = drafter.config
    B, A, device = c.block_size, batch.num_anchors, batch.anchor_pos.device
    q_pos = (batch.anchor_pos[:, None] + torch.arange(B, device=device)).reshape(-1)
    q_anchor = batch.anchor_pos.repeat_interleave(B)
    q_seq = batch.anchor_seq.repeat_interleave(B)
    q_block = torch.arange(A, device=device).repeat_interleave(B)
    context = (batch.context_seq[None, :] == q_seq[:, None]) & (batch.context_pos[None, :] < q_anchor[:, None])
    full = torch.cat([context, q_block[:, None] == q_block[None, :]], dim=1)
    masks = {"full_attention": full}
    if "sliding_attention" in c.layer_types:
        assert c.sliding_window is not None
        key_pos = torch.cat([batch.context_pos, q_pos])
        masks["sliding_attention"] = full & sliding_mask(q_pos, key_pos, c.sliding_window, c.causal_sliding)
    return masks


def forward_blocks(drafter: Drafter, batch: AnchorBatch) -> BlockRows:
    """The drafter's backbone on every block of the batch (differentiable): base logits of each draft row."""
    c = drafter.config
    B, A = c.block_size, batch.num_anchors
    m, width = len(c.target_layer_ids), c.target_hidden_size
    assert batch.context.shape[1:] == (m * width,), (batch.context.shape, m, width)
    ctx = drafter.hidden_norm(drafter.fc(batch.context.to(drafter.dtype)))
    ctx_cos, ctx_sin = drafter.rope(batch.context_pos, ctx.dtype)
    tokens = torch.full((A, B), c.mask_token_id, dtype=torch.long, device=drafter.device)
    tokens[:, 0] = batch.anchor_tokens
    positions = (batch.anchor_pos[:, None] + torch.arange(B, device=batch.anchor_pos.device)).reshape(-1)
    x = drafter.embed(tokens.reshape(-1))
    cos, sin = drafter.rope(positions, x.dtype)
    masks = block_masks(drafter, batch)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.attention.project_kv(ctx, ctx_cos, ctx_sin)
        x = layer(x, cos, sin, masks[c.layer_types[i]], BlockKV(k, v))
    rows = x.view(A, B, -1)
    if c.slot_convention == "dflash":
        rows = rows[:, 1:]
    assert rows.shape == (A, c.num_drafts, c.hidden_size), rows.shape
    post = drafter.norm(rows)
    return BlockRows(rows, post, drafter.lm_head(post).float())


def corrected_logits(drafter: Drafter, rows: BlockRows, prev_tokens: Tensor) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced Z = U + W2 v(prev) [A, K, V_d] and the Markov embeddings W1[prev] [A, K, r] (None without)."""
    if drafter.markov is None:
        return rows.base_logits, None
    state, logits, embeddings = None, [], []
    for k in range(prev_tokens.shape[1]):
        z, e, state = markov_step(drafter.markov, rows.base_logits[:, k], prev_tokens[:, k], rows.hidden_post[:, k],
                                  state)
        logits.append(z)
        embeddings.append(e)
    return torch.stack(logits, dim=1), torch.stack(embeddings, dim=1)


def confidence_logits(drafter: Drafter, rows: BlockRows, embeddings: Tensor | None) -> Tensor | None:
    """Raw confidence logits [A, K] (no calibration temperature), as the serving chain computes them."""
    head = drafter.confidence
    if head is None:
        return None
    hidden = head.select_hidden(rows.hidden_pre, rows.hidden_post)
    A, K, H = hidden.shape
    emb = None if embeddings is None or not head.with_markov else embeddings.reshape(A * K, -1)
    return head.logits(hidden.reshape(A * K, H), emb).view(A, K)


@torch.no_grad()
def greedy_chains(drafter: Drafter, rows: BlockRows, anchors: Tensor) -> tuple[Tensor, Tensor | None]:
    """The greedy DSpark chain of every block, as serving drafts it (drafting.markov.greedy_chains): (drafted target
    ids [A, K], raw confidence logits [A, K] or None)."""
    chains = greedy_chains_of(rows.base_logits, anchors, drafter.markov, rows.hidden_post, drafter.d2t)
    return chains.tokens, confidence_logits(drafter, rows, chains.embeddings)


def accepted_lengths(drafted: Tensor, labels: Tensor, valid: Tensor) -> Tensor:
    """[A] the number of leading drafted tokens equal to the target's greedy continuation."""
    hit = (drafted == labels) & valid
    return hit.long().cumprod(dim=1).sum(dim=1)


def decoded_steps(accepted: dict[int, int], first: int, last: int) -> tuple[int, int]:
    """(tokens, steps) of greedy speculative decoding over one sequence from anchor `first` on, where the chain
    drafted at anchor p accepts accepted[p] drafts: that step commits accepted[p] + 1 tokens and the next one
    drafts at p + accepted[p] + 1; it ends past `last`. Every anchor it visits must be in `accepted`."""
    tokens = steps = 0
    p = first
    while p <= last:
        a = accepted[p]
        tokens, steps, p = tokens + a + 1, steps + 1, p + a + 1
    return tokens, steps


# -- initialisation ------------------------------------------------------------------------------------------------

_LAYER_TENSORS = ("attention_norm.weight", "ffn_norm.weight", "attention.wq.weight", "attention.wk.weight",
                  "attention.wv.weight", "attention.wo.weight", "attention.q_norm.weight", "attention.k_norm.weight",
                  "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's evenly spaced capture layers, the last one being the input of the first warm-started layer."""
    last = num_target_layers - 1 - num_draft_layers
    spread = default_target_layer_ids(num_target_layers, max(num_draft_layers, 2))[:-1]
    return tuple(sorted({i for i in spread if i < last} | {max(last, 0)}))


def init_drafter(
    target: Transformer,
    vocab: DraftVocab,
    *,
    num_layers: int = 2,
    block_size: int = 4,
    target_layer_ids: Sequence[int] | None = None,
    markov_rank: int = 128,
    markov_head_type: str = "vanilla",
    mask_token_id: int | None = None,
    seed: int = 0,
    warm_start: bool = True,
) -> Drafter:
    """A trainable DSpark drafter for `target`: the embedding and (draft rows of the) lm_head are the target's and
    stay frozen; with warm_start the layers are copies of the target's last `num_layers` layers (where shapes
    match), fc passes the last captured layer through, hidden_norm is the first copied layer's input norm and the
    final norm is the target's. The Markov head starts with W2 = 0 and the confidence head at c = 0.5."""
    t = target.config
    ids = default_layer_ids(t.num_layers, num_layers) if target_layer_ids is None else tuple(target_layer_ids)
    embed = target.tok_embeddings.weight.detach().float().cpu()
    lm_head = (embed if target.output is None else target.output.weight).detach().float().cpu()
    drafter = init_random_drafter(t, num_layers=num_layers, block_size=block_size, target_layer_ids=ids,
                                  markov_rank=markov_rank, markov_head_type=markov_head_type, confidence=True,
                                  seed=seed, target_embed=embed, mask_token_id=mask_token_id,
                                  draft_vocab_size=vocab.size)
    if vocab.vocab_size != t.vocab_size:
        raise ValueError(f"draft vocabulary built for {vocab.vocab_size} ids, the target has {t.vocab_size}")
    drafter.config = dataclasses.replace(drafter.config, name=f"dspark-train drafter for {t.name}")
    target_state = {k: v.detach().float().cpu() for k, v in target.state_dict().items()}
    with torch.no_grad():
        drafter.lm_head.weight.copy_(lm_head[vocab.draft_to_target])
        if drafter.d2t is not None:
            drafter.d2t.copy_(vocab.d2t)
        if drafter.markov is not None:
            drafter.markov.w2.weight.zero_()
        if drafter.confidence is not None:
            drafter.confidence.proj.weight.zero_()
            drafter.confidence.proj.bias.zero_()
        if warm_start:
            _warm_start(drafter, target_state, t.num_layers)
    return drafter


def _warm_start(drafter: Drafter, target_state: dict[str, Tensor], num_target_layers: int) -> None:
    c = drafter.config
    first = num_target_layers - c.num_layers
    for i, layer in enumerate(drafter.layers):
        ours = layer.state_dict()
        for name in _LAYER_TENSORS:
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                ours[name].fill_(1.0)
            theirs = target_state.get(f"layers.{first + i}.{name}")
            if theirs is not None and theirs.shape == ours[name].shape:
                ours[name].copy_(theirs)
    drafter.norm.weight.copy_(target_state["norm.weight"])
    drafter.hidden_norm.weight.copy_(target_state[f"layers.{first}.attention_norm.weight"])
    if c.target_hidden_size == c.hidden_size:
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, -c.hidden_size:] = torch.eye(c.hidden_size)


def trainable_parameters(drafter: Drafter) -> list[tuple[str, torch.nn.Parameter]]:
    """Everything but the target's frozen tables (embedding, lm_head); sets requires_grad accordingly."""
    params = []
    for name, p in drafter.named_parameters():
        train = not name.startswith(("embed.", "lm_head."))
        p.requires_grad_(train)
        if train:
            params.append((name, p))
    return params
