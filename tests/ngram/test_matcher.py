"""Prompt lookup: hand-written matches, scores, dedup and limits; the incremental index == the scan."""

from __future__ import annotations

import math
import random

import pytest
from dspark_grpc.runtime.drafting.ngram import Candidate, NgramIndex, match_score, ngram_candidates


def cand(tokens: list[int], n: int) -> Candidate:
    return Candidate(tokens, math.log(n / (n + 1)), n)


def test_score_grows_with_match_length():
    scores = [match_score(n) for n in range(1, 9)]
    assert all(s < 0 for s in scores) and scores == sorted(scores) and len(set(scores)) == len(scores)
    assert match_score(1) == pytest.approx(math.log(0.5)) and match_score(4) == pytest.approx(math.log(0.8))


def test_repeated_phrase_continuation_stops_at_context_end():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3]
    assert ngram_candidates(tokens) == [cand([4, 9, 1, 2, 3], 3)]
    assert ngram_candidates(tokens, max_tokens=2) == [cand([4, 9], 3)]
    assert ngram_candidates(tokens, max_ngram=2) == [cand([4, 9, 1, 2, 3], 2)]


def test_most_recent_occurrence_first():
    tokens = [5, 7, 5, 8, 5, 9, 5]
    assert ngram_candidates(tokens, max_tokens=3) == [cand([9, 5], 1), cand([8, 5, 9], 1), cand([7, 5, 8], 1)]
    assert ngram_candidates(tokens, max_tokens=3, max_candidates=2) == [cand([9, 5], 1), cand([8, 5, 9], 1)]
    assert ngram_candidates(tokens, max_tokens=3, max_occurrences=1) == [cand([9, 5], 1)]


def test_longer_match_preferred_over_more_recent():
    tokens = [1, 2, 3, 4, 2, 3, 5, 1, 2, 3]
    assert ngram_candidates(tokens) == [cand([4, 2, 3, 5, 1, 2, 3], 3), cand([5, 1, 2, 3], 2)]
    assert ngram_candidates(tokens, min_ngram=3) == [cand([4, 2, 3, 5, 1, 2, 3], 3)]
    assert ngram_candidates(tokens, max_ngram=2) == [cand([5, 1, 2, 3], 2), cand([4, 2, 3, 5, 1, 2, 3], 2)]


def test_prefix_candidates_merge_into_the_longer_keeping_the_better_score():
    assert ngram_candidates([7, 7, 7, 7]) == [cand([7, 7, 7], 3)]
    assert ngram_candidates([1, 2, 1, 2, 1, 2]) == [cand([1, 2, 1, 2], 4)]
    assert ngram_candidates([1, 2, 1, 2, 1, 2], max_candidates=1, max_tokens=3) == [cand([1, 2, 1], 4)]


def test_shorter_continuation_of_a_weaker_match_is_dropped():
    # the recent n=2 match continues [8, 1], the older n=3 match [8, 6]: cut to one token they are one candidate
    tokens = [1, 2, 3, 8, 6, 0, 2, 3, 8, 1, 2, 3]
    assert ngram_candidates(tokens, max_tokens=2) == [cand([8, 6], 3), cand([8, 1], 2)]
    assert ngram_candidates(tokens, max_tokens=1) == [cand([8], 3)]


def test_no_match():
    assert ngram_candidates([]) == []
    assert ngram_candidates([4]) == []
    assert ngram_candidates([1, 2, 3, 4]) == []
    assert ngram_candidates([1, 2, 3, 2], min_ngram=2) == []
    assert NgramIndex(4).candidates() == [] and NgramIndex(4, [4]).candidates() == []


def test_bad_arguments():
    for kwargs in (dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_tokens=0), dict(max_candidates=0)):
        with pytest.raises(ValueError):
            ngram_candidates([1, 2, 1], **kwargs)
    with pytest.raises(ValueError, match="above the index"):
        NgramIndex(2, [1, 2, 1]).candidates(max_ngram=3)
    with pytest.raises(ValueError, match="truncate"):
        NgramIndex(2, [1, 2, 1]).truncate(4)


def fresh_positions(tokens: list[int], max_ngram: int) -> dict:
    return NgramIndex(max_ngram, tokens).positions


@pytest.mark.parametrize("seed", range(20))
def test_index_equals_scan_through_extends_and_truncates(seed: int):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 12])
    index_ngram = rng.randint(1, 5)
    index = NgramIndex(index_ngram)
    tokens: list[int] = []
    for _ in range(30):
        if tokens and rng.random() < 0.3:
            length = rng.randint(0, len(tokens))
            index.truncate(length)
            del tokens[length:]
            assert index.positions == fresh_positions(tokens, index_ngram)
        else:
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            index.extend(chunk)
            tokens += chunk
        assert index.tokens == tokens and len(index) == len(tokens)
        max_ngram = rng.randint(1, index_ngram)
        kwargs = dict(min_ngram=rng.randint(1, max_ngram), max_tokens=rng.randint(1, 10),
                      max_candidates=rng.randint(1, 6), max_occurrences=rng.randint(1, 10))
        assert index.candidates(max_ngram, **kwargs) == ngram_candidates(tokens, max_ngram, **kwargs)
    assert index.candidates() == ngram_candidates(tokens, index_ngram)


def test_candidates_are_real_continuations():
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(300)]
    cands = NgramIndex(4, tokens).candidates(max_candidates=8, max_occurrences=16)
    assert cands
    for c in cands:
        n = c.match_length
        suffix = tokens[-n:]
        assert any(tokens[e - n + 1:e + 1] == suffix and tokens[e + 1:e + 1 + len(c.tokens)] == c.tokens
                   for e in range(n - 1, len(tokens) - 1))
        assert c.score == match_score(n)
    for a in cands:
        for b in cands:
            assert a is b or a.tokens[:len(b.tokens)] != b.tokens, "a candidate is a prefix of another"


def test_anchored_candidates_are_the_scans_with_the_anchor_and_leave_the_index_as_it_was():
    from dspark_grpc.runtime.drafting.ngram import anchored_candidates

    rng = random.Random(5)
    tokens = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex(4, tokens)
    before = (list(index.tokens), {k: list(v) for k, v in index.positions.items()})
    for anchor in range(6):
        got = anchored_candidates(index, anchor, min_ngram=2, max_tokens=8)
        assert got == ngram_candidates([*tokens, anchor], max_ngram=4, min_ngram=2, max_tokens=8)
        assert (index.tokens, index.positions) == before
