"""A reduced draft vocabulary: the V_d ids the target itself emits most often.

Draft ids are the chosen target ids in increasing order, stored as speculators' offsets: target = draft + d2t[draft].
`t2d` maps the other way ([V], -1 for target ids outside the draft vocabulary); it is training-only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftVocab:
    draft_to_target: Tensor  # [V_d] int64, strictly increasing target ids
    vocab_size: int  # the target's

    def __post_init__(self) -> None:
        ids = self.draft_to_target
        assert ids.dim() == 1 and ids.numel() > 0, ids.shape
        assert bool((ids[1:] > ids[:-1]).all()) and 0 <= int(ids[0]) and int(ids[-1]) < self.vocab_size

    @property
    def size(self) -> int:
        return self.draft_to_target.numel()

    @property
    def d2t(self) -> Tensor:
        """[V_d] offsets: target id = draft id + d2t[draft id]."""
        return self.draft_to_target - torch.arange(self.size)

    @property
    def t2d(self) -> Tensor:
        """[V] draft id of each target id, -1 where the draft vocabulary lacks it."""
        t2d = torch.full((self.vocab_size,), -1, dtype=torch.long)
        t2d[self.draft_to_target] = torch.arange(self.size)
        return t2d

    @classmethod
    def full(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.arange(vocab_size), vocab_size)

    @classmethod
    def from_d2t(cls, d2t: Tensor, vocab_size: int) -> DraftVocab:
        return cls(d2t.long() + torch.arange(d2t.numel()), vocab_size)


def token_counts(sequences: Iterable[Tensor], vocab_size: int) -> Tensor:
    """[V] int64 occurrences of each id over the given token sequences."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in sequences:
        counts += torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size)
    return counts


def build_draft_vocab(counts: Tensor, size: int, always: Sequence[int] = ()) -> DraftVocab:
    """The `size` most frequent ids (ties: lower id first), plus the `always` ids (e.g. EOS) in place of the
    least frequent ones. Ids never seen fill the rest in increasing order."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab}")
    forced = list(dict.fromkeys(int(i) for i in always))
    if len(forced) > size:
        raise ValueError(f"{len(forced)} forced ids do not fit a draft vocabulary of {size}")
    # Stable sort by decreasing count keeps ties in increasing id order.
    order = torch.sort(counts.long(), descending=True, stable=True).indices
    taken = set(forced)
    rest = [i for i in order.tolist() if i not in taken][: size - len(forced)]
    return DraftVocab(torch.tensor(sorted(forced + rest), dtype=torch.long), vocab)


def coverage(vocab: DraftVocab, counts: Tensor) -> float:
    """The fraction of the counted tokens that the draft vocabulary can produce."""
    total = int(counts.sum())
    return float(counts[vocab.draft_to_target].sum()) / total if total else 1.0


def coverage_report(vocab: DraftVocab, train_counts: Tensor, heldout_counts: Tensor | None = None) -> str:
    parts = [f"draft vocabulary {vocab.size}/{vocab.vocab_size}: covers {coverage(vocab, train_counts):.1%} of the "
             f"target's generated train tokens ({int((train_counts > 0).sum())} distinct)"]
    if heldout_counts is not None:
        parts.append(f"{coverage(vocab, heldout_counts):.1%} of held-out tokens")
    return ", ".join(parts)
