"""Prompt lookup: draft candidates copied from earlier occurrences of the context's last n tokens.

The context ends AT the anchor (the target's pending token): the suffix that is matched ends with the anchor,
and a candidate is the text that followed an earlier occurrence of that suffix, i.e. a guess of what follows
the anchor. Occurrences are visited longest match first (n = max_ngram .. min_ngram), most recent first, at
most `max_occurrences` per n; a continuation stops after `max_tokens` tokens or at the end of the context.
A candidate equal to, or a prefix of, an earlier one is merged into it; an earlier one that is a prefix of a
new continuation is extended by it (keeping its own, higher or equal, score).

Score: every token of a candidate found by a match of length n gets log p(n) with p(n) = n / (n + 1), an
estimated per-token acceptance probability (1: 0.5, 2: 0.67, 3: 0.75, 4: 0.8). A path's score is the sum
along it, as for DDTree log-probs, so n-gram branches and DDTree branches compete in one best-first trim.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dspark_grpc.runtime.drafting.ddtree import DraftTree

SOURCE_ROOT, SOURCE_BASE, SOURCE_NGRAM, SOURCE_BOTH = 0, 1, 2, 3


@dataclass
class Candidate:
    tokens: list[int]  # what follows the anchor
    score: float  # per-token log-prob-like score: match_score(match_length)
    match_length: int


def match_score(n: int) -> float:
    return math.log(n / (n + 1))


def _check_args(max_ngram: int, min_ngram: int, max_tokens: int, max_candidates: int, max_occurrences: int) -> None:
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    if max_tokens < 1 or max_candidates < 1 or max_occurrences < 1:
        raise ValueError(f"max_tokens, max_candidates and max_occurrences must be >= 1, got "
                         f"{max_tokens}, {max_candidates}, {max_occurrences}")


def _collect(tokens: Sequence[int], occurrences: Iterable[tuple[int, int]], max_tokens: int,
             max_candidates: int) -> list[Candidate]:
    """occurrences: (match length, end position of the earlier match) in priority order."""
    out: list[Candidate] = []
    for n, end in occurrences:
        cont = list(tokens[end + 1:end + 1 + max_tokens])
        for cand in out:
            common = min(len(cand.tokens), len(cont))
            if cand.tokens[:common] == cont[:common]:
                if len(cont) > len(cand.tokens):
                    cand.tokens = cont
                break
        else:
            if len(out) < max_candidates:
                out.append(Candidate(cont, match_score(n), n))
    return out


def _scan_occurrences(tokens: Sequence[int], max_ngram: int, min_ngram: int,
                      max_occurrences: int) -> list[tuple[int, int]]:
    last = len(tokens) - 1
    if last < 1:
        return []
    anchor = tokens[last]
    by_n: list[list[int]] = [[] for _ in range(max_ngram + 1)]
    for end in range(last - 1, -1, -1):
        if tokens[end] != anchor:
            continue
        m = 1
        while m < max_ngram and m <= end and tokens[end - m] == tokens[last - m]:
            m += 1
        for n in range(min_ngram, m + 1):
            if len(by_n[n]) < max_occurrences:
                by_n[n].append(end)
    return [(n, end) for n in range(max_ngram, min_ngram - 1, -1) for end in by_n[n]]


def ngram_candidates(tokens: Sequence[int], max_ngram: int = 4, min_ngram: int = 1, max_tokens: int = 8,
                     max_candidates: int = 4, max_occurrences: int = 8) -> list[Candidate]:
    """Candidates for what follows tokens[-1], best first, by a scan of the whole context (see NgramIndex)."""
    _check_args(max_ngram, min_ngram, max_tokens, max_candidates, max_occurrences)
    occurrences = _scan_occurrences(tokens, max_ngram, min_ngram, max_occurrences)
    return _collect(tokens, occurrences, max_tokens, max_candidates)


class NgramIndex:
    """A session's tokens with, per n-gram (n <= max_ngram), the end positions of its occurrences in order."""

    def __init__(self, max_ngram: int = 4, tokens: Sequence[int] = ()):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.positions: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, positions = self.tokens, self.positions
        for t in tokens:
            toks.append(t)
            end = len(toks) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                positions.setdefault(tuple(toks[end - n + 1:]), []).append(end)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"cannot truncate {len(self.tokens)} tokens to {length}")
        toks, positions = self.tokens, self.positions
        for end in range(len(toks) - 1, length - 1, -1):
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(toks[end - n + 1:end + 1])
                ends = positions[key]
                ends.pop()
                if not ends:
                    del positions[key]
        del toks[length:]

    def candidates(self, max_ngram: int | None = None, min_ngram: int = 1, max_tokens: int = 8,
                   max_candidates: int = 4, max_occurrences: int = 8) -> list[Candidate]:
        """Equal to ngram_candidates(self.tokens, ...) in O(max_ngram * max_occurrences) dictionary work."""
        max_ngram = self.max_ngram if max_ngram is None else max_ngram
        if max_ngram > self.max_ngram:
            raise ValueError(f"max_ngram {max_ngram} is above the index's {self.max_ngram}")
        _check_args(max_ngram, min_ngram, max_tokens, max_candidates, max_occurrences)
        toks = self.tokens
        last = len(toks) - 1
        occurrences: list[tuple[int, int]] = []
        for n in range(min(max_ngram, last), min_ngram - 1, -1):
            ends = self.positions[tuple(toks[last - n + 1:])]
            # the final entry is the suffix itself (end == last)
            occurrences.extend((n, end) for end in reversed(ends[-1 - max_occurrences:-1]))
        return _collect(toks, occurrences, max_tokens, max_candidates)


def anchored_candidates(index: NgramIndex, anchor: int, min_ngram: int, max_tokens: int) -> list[Candidate]:
    """Candidates for what follows `anchor` placed after the index's tokens (the matched suffix ends at the anchor),
    best first; the index is left as it was. The draft service's prompt lookup and the target's (which skips the
    round of a pure lookup step) find the same ones."""
    length = len(index)
    index.extend([anchor])
    try:
        return index.candidates(min_ngram=min_ngram, max_tokens=max_tokens)
    finally:
        index.truncate(length)


def candidates_tree(anchor: int, candidates: Sequence[Candidate]) -> DraftTree:
    """The trie of the candidates below the anchor; a shared node gets the best score of those through it."""
    tree = DraftTree([anchor], [-1], [0.0], [0])
    children: dict[tuple[int, int], int] = {}
    for cand in candidates:
        node = 0
        for t in cand.tokens:
            child = children.get((node, t))
            if child is None:
                child = children[(node, t)] = len(tree.tokens)
                tree.tokens.append(t)
                tree.parents.append(node)
                tree.logprobs.append(cand.score)
                tree.depths.append(tree.depths[node] + 1)
            else:
                tree.logprobs[child] = max(tree.logprobs[child], cand.score)
            node = child
    return tree


def _check_budget(budget: int) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0 (nodes below the root), got {budget!r}")


def _best_first(parents: Sequence[int], logprobs: Sequence[float], budget: int) -> list[int]:
    """The nodes (root included, ascending) of the best `budget` root paths by summed log-prob, prefix-closed."""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    kept = [0]
    heap = [(-logprobs[c], c) for c in children[0]]
    heapq.heapify(heap)
    while heap and len(kept) <= budget:
        neg, node = heapq.heappop(heap)
        kept.append(node)
        for c in children[node]:
            heapq.heappush(heap, (neg - logprobs[c], c))
    return sorted(kept)


def _subtree(tree: DraftTree, kept: Sequence[int]) -> DraftTree:
    new = {old: i for i, old in enumerate(kept)}
    return DraftTree([tree.tokens[i] for i in kept], [new[tree.parents[i]] if i else -1 for i in kept],
                     [tree.logprobs[i] for i in kept], [tree.depths[i] for i in kept])


def ngram_tree(anchor: int, candidates: Sequence[Candidate], budget: int) -> DraftTree:
    """A draft tree from n-gram candidates alone (a chain for one candidate), at most `budget` nodes below."""
    _check_budget(budget)
    tree = candidates_tree(anchor, candidates)
    return _subtree(tree, _best_first(tree.parents, tree.logprobs, budget))


def merge_trees(base: DraftTree, extra: DraftTree | Sequence[Candidate], budget: int) -> tuple[DraftTree, list[int]]:
    """The union of both trees' root paths (one node per token path), trimmed best-first to `budget` nodes.

    A node in both keeps the higher of its two log-probs. Nodes keep their union order: base nodes first, in
    base order, then the extra nodes. Returns the tree and per node its source: SOURCE_ROOT for node 0,
    SOURCE_BASE, SOURCE_NGRAM (from `extra`), or SOURCE_BOTH.
    """
    _check_budget(budget)
    root = base.tokens[0]
    if not isinstance(extra, DraftTree):
        extra = candidates_tree(root, extra)
    if extra.tokens[0] != root:
        raise ValueError(f"the trees have different roots: {root} and {extra.tokens[0]}")
    union = DraftTree([root], [-1], [0.0], [0])
    sources = [SOURCE_ROOT]
    nodes: dict[tuple[int, int], int] = {}
    for source, tree in ((SOURCE_BASE, base), (SOURCE_NGRAM, extra)):
        remap = [0]
        for i in range(1, len(tree.tokens)):
            parent, lp = remap[tree.parents[i]], tree.logprobs[i]
            node = nodes.get((parent, tree.tokens[i]))
            if node is None:
                node = nodes[(parent, tree.tokens[i])] = len(union.tokens)
                union.tokens.append(tree.tokens[i])
                union.parents.append(parent)
                union.logprobs.append(lp)
                union.depths.append(union.depths[parent] + 1)
                sources.append(source)
            else:
                union.logprobs[node] = max(union.logprobs[node], lp)
                sources[node] |= source
            remap.append(node)
    kept = _best_first(union.parents, union.logprobs, budget)
    return _subtree(union, kept), [sources[i] for i in kept]
