"""Reduced draft vocabulary: most frequent ids of the target's own outputs, d2t offsets, coverage."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.train.vocab import DraftVocab, build_draft_vocab, coverage, token_counts


def test_top_ids_ties_forced_ids_and_mappings():
    counts = token_counts([torch.tensor([5, 5, 5, 9, 9, 1, 7]), torch.tensor([[9, 3], [1, 8]])], 12)
    assert counts.tolist() == [0, 2, 0, 1, 0, 3, 0, 1, 1, 3, 0, 0]
    vocab = build_draft_vocab(counts, 4)
    assert vocab.draft_to_target.tolist() == [1, 3, 5, 9]  # 5 and 9 (3 each), 1 (2), then 3 wins the tie by id
    assert vocab.d2t.tolist() == [1, 2, 3, 6]
    assert (torch.arange(4) + vocab.d2t).tolist() == vocab.draft_to_target.tolist()
    t2d = vocab.t2d
    assert t2d.tolist() == [-1, 0, -1, 1, -1, 2, -1, -1, -1, 3, -1, -1]
    assert torch.equal(DraftVocab.from_d2t(vocab.d2t, 12).draft_to_target, vocab.draft_to_target)
    forced = build_draft_vocab(counts, 4, always=[11])
    assert forced.draft_to_target.tolist() == [1, 5, 9, 11]
    assert coverage(vocab, counts) == pytest.approx(9 / 11)
    assert coverage(DraftVocab.full(12), counts) == 1.0
    unseen = build_draft_vocab(counts, 9)  # every seen id, then unseen ones by increasing id
    assert unseen.draft_to_target.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]


def test_bad_sizes():
    counts = torch.ones(8, dtype=torch.long)
    for size in (0, 9):
        with pytest.raises(ValueError):
            build_draft_vocab(counts, size)
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 1, always=[1, 2])
