"""The proposers, one class each behind one interface (`Proposer`): what a draft session's next proposal is.

- `PromptLookup` ("ngram"): the continuations of the context's own n-grams that end at the anchor (no checkpoint).
- `DSparkDrafts` ("dspark"): the DSpark drafter's chain, or its DDTree, from one block forward; the forwards of
  concurrent proposals share one drafter pass (a StepBatcher, `drafter_pass`).
- `Hybrid` ("hybrid"): a chain follows the n-gram continuation where the context repeats itself, the DSpark chain
  elsewhere; a tree merges the n-gram branches into the DSpark tree under one node budget.

The engine (draft_service/engine.py) checks a request, picks the proposer by name and resolves its budget in the
range the proposer gives (`budgets`); the proposer drafts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch
from dspark_grpc.runtime.drafting.ddtree import DraftTree, build_ddtree
from dspark_grpc.runtime.drafting.markov import Chain, choose_kernel, draft_chain, draft_chains
from dspark_grpc.runtime.drafting.ngram import (
    SOURCE_BASE,
    SOURCE_BOTH,
    SOURCE_NGRAM,
    SOURCE_ROOT,
    Candidate,
    NgramIndex,
    anchored_candidates,
    merge_trees,
    ngram_tree,
)
from dspark_grpc.runtime.models.drafter import BlockOutput, DraftContext, Drafter
from dspark_grpc.runtime.models.tree import tree_depths
from dspark_grpc.serving.batching import StepBatcher
from dspark_grpc.speculation.wire import DSPARK, HYBRID, NGRAM, TORCH

if TYPE_CHECKING:
    from dspark_grpc.draft_service.engine import DraftLimits
    from dspark_grpc.runtime.kernels.compiled_draft import CompiledChain


@dataclass
class DraftSession:
    context: DraftContext | None  # None without a DSpark drafter
    index: NgramIndex
    lock: threading.Lock = field(default_factory=threading.Lock)  # one operation of the session at a time

    @property
    def tokens(self) -> list[int]:
        return self.index.tokens

    @property
    def length(self) -> int:
        return len(self.index)


@dataclass
class ProposalResult:
    tokens: list[int]  # node 0 = the anchor
    parents: list[int]
    logprobs: list[float]
    confidences: torch.Tensor | None  # [depth] along the main chain
    sources: list[str]  # per node: "" for the root, then the proposer that proposed it (hybrid: both did)
    # A sampled chain: the sparse distribution node k was drawn from, in row k-1 ([n, k] target ids, log-probs).
    draft_ids: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None
    batch_sessions: int = 0  # sessions that shared its drafter pass (0: no drafter pass)
    proposer: str = ""  # the proposer that ran (the request's, or the default)
    compute_seconds: float = 0.0


@dataclass(frozen=True)
class ProposalRequest:
    """A checked request: the anchor sits right after the session's context; `budget` is in the proposer's range;
    `kernel` is a known kernel name (runtime/drafting/markov.py `KERNELS`)."""

    session: DraftSession
    anchor_token: int
    tree: bool
    budget: int
    kernel: str
    temperature: float = 0.0
    generator: torch.Generator | None = None


class Proposer(Protocol):
    name: str

    def budgets(self, tree: bool) -> tuple[int, int]:
        """(default, largest) budget: draft tokens of a chain, nodes of a tree (the root not counted)."""

    def propose(self, request: ProposalRequest) -> ProposalResult: ...


class PromptLookup:
    name = NGRAM

    def __init__(self, limits: DraftLimits) -> None:
        self.limits = limits

    def budgets(self, tree: bool) -> tuple[int, int]:
        return self.limits.default_tree_budget if tree else self.limits.ngram_chain, self.limits.max_tree_budget

    def candidates(self, request: ProposalRequest) -> list[Candidate]:
        return anchored_candidates(request.session.index, request.anchor_token, self.limits.ngram_min, request.budget)

    def propose(self, request: ProposalRequest, candidates: list[Candidate] | None = None) -> ProposalResult:
        candidates = self.candidates(request) if candidates is None else candidates
        t = ngram_tree(request.anchor_token, candidates if request.tree else candidates[:1], request.budget)
        return ProposalResult(t.tokens, t.parents, t.logprobs, None, ["", *[NGRAM] * (len(t.tokens) - 1)])


@dataclass(frozen=True)
class PassJob:
    context: DraftContext
    anchor_token: int
    greedy_chain: bool  # the pass also drafts its greedy chain (torch kernel), batched with the pass's others
    chain_only: bool = False  # only that chain is wanted (not the block's logits: no tree)


def drafter_pass(d: Drafter, jobs: list[PassJob], compiled: CompiledChain | None = None
                 ) -> list[tuple[BlockOutput | None, Chain | None]]:
    """One drafter pass for the sessions of `jobs`, then the greedy chains of those that want one, as one batched
    chain (runtime/drafting/markov.py `draft_chains`) instead of one per session. A lone session that wants only
    its greedy chain takes the `compiled` graph where there is one and it `takes` the context (no BlockOutput
    then)."""
    if (compiled is not None and len(jobs) == 1 and jobs[0].greedy_chain and jobs[0].chain_only
            and compiled.takes(jobs[0].context)):
        return [(None, compiled(jobs[0].context, jobs[0].anchor_token))]
    outs = d.forward_blocks([(job.context, job.anchor_token) for job in jobs])
    chains: list[Chain | None] = [None] * len(jobs)
    greedy = [i for i, job in enumerate(jobs) if job.greedy_chain]
    if greedy:
        stacked = [torch.stack([getattr(outs[i], f) for i in greedy])
                   for f in ("base_logits", "hidden_pre_norm", "hidden_post_norm")]
        anchors = torch.tensor([jobs[i].anchor_token for i in greedy], device=d.device)
        for i, chain in zip(greedy, draft_chains(*stacked, anchors, d.markov, d.confidence, d.d2t), strict=True):
            chains[i] = chain
    return list(zip(outs, chains, strict=True))


class DSparkDrafts:
    name = DSPARK

    def __init__(self, drafter: Drafter, passes: StepBatcher[PassJob, tuple[BlockOutput | None, Chain | None]],
                 limits: DraftLimits) -> None:
        self.drafter, self.passes, self.limits = drafter, passes, limits

    def budgets(self, tree: bool) -> tuple[int, int]:
        if tree:
            return self.limits.default_tree_budget, self.limits.max_tree_budget
        return self.drafter.config.num_drafts, self.drafter.config.num_drafts

    def propose(self, request: ProposalRequest) -> ProposalResult:
        d, r = self.drafter, request
        kernel = choose_kernel(r.kernel, None if d.markov is None else d.markov.kind, r.temperature, d.device)
        assert r.session.context is not None
        job = PassJob(r.session.context, r.anchor_token, greedy_chain=kernel == TORCH and r.temperature == 0,
                      chain_only=not r.tree)
        result, info = self.passes.submit(job, then=lambda out: dspark_proposal(
            d, out[0], r.anchor_token, r.tree, r.budget, kernel, r.temperature, r.generator, self.limits,
            chain=out[1]))
        result.batch_sessions = info.jobs
        return result


def dspark_proposal(d: Drafter, out: BlockOutput | None, anchor_token: int, tree: bool, budget: int, kernel: str,
                    temperature: float, generator: torch.Generator | None, limits: DraftLimits,
                    chain: Chain | None = None) -> ProposalResult:
    """One session's DSpark chain (the first `budget` slots) or DDTree (`budget` nodes) from its block output;
    `chain`: its whole greedy chain, drafted already (`drafter_pass`; then `out` may be None)."""
    if tree:
        assert out is not None
        t = build_ddtree(out.base_logits, anchor_token, budget, limits.tree_top_k, markov=d.markov,
                         hidden_post=out.hidden_post_norm, d2t=d.d2t, chain_seed=True)
        chain = chain or draft_chain(out.base_logits, out.hidden_pre_norm, out.hidden_post_norm, anchor_token,
                                     d.markov, d.confidence, d.d2t, kernel=kernel)
        return ProposalResult(t.tokens, t.parents, t.logprobs, chain.confidences,
                              ["", *[DSPARK] * (len(t.tokens) - 1)])
    if chain is not None:  # a greedy chain's first slots are the chain of fewer slots
        chain = Chain(chain.tokens[:budget], chain.logprobs[:budget],
                      None if chain.confidences is None else chain.confidences[:budget])
    else:
        assert out is not None
        chain = draft_chain(out.base_logits[:budget], out.hidden_pre_norm[:budget], out.hidden_post_norm[:budget],
                            anchor_token, d.markov, d.confidence, d.d2t, kernel=kernel, temperature=temperature,
                            generator=generator, sample_top_k=limits.sample_top_k)
    tokens = [anchor_token, *chain.tokens]
    return ProposalResult(tokens, list(range(-1, len(tokens) - 1)), [0.0, *chain.logprobs.tolist()],
                          chain.confidences, ["", *[DSPARK] * chain.logprobs.numel()], chain.draft_ids,
                          chain.draft_logprobs)


_SOURCE_NAMES = {SOURCE_ROOT: "", SOURCE_BASE: DSPARK, SOURCE_NGRAM: NGRAM, SOURCE_BOTH: HYBRID}


class Hybrid:
    name = HYBRID

    def __init__(self, lookup: PromptLookup, dspark: DSparkDrafts, limits: DraftLimits) -> None:
        self.lookup, self.dspark, self.limits = lookup, dspark, limits

    def budgets(self, tree: bool) -> tuple[int, int]:
        return self.lookup.budgets(tree)

    def propose(self, request: ProposalRequest) -> ProposalResult:
        candidates = self.lookup.candidates(request)
        if not request.tree and candidates and candidates[0].match_length >= self.limits.hybrid_min_match:
            return self.lookup.propose(request, candidates)
        budget = request.budget if request.tree else min(request.budget, self.dspark.budgets(False)[1])
        dspark = self.dspark.propose(replace(request, budget=budget))
        if not (request.tree and candidates):
            return dspark
        merged, sources = merge_trees(DraftTree(dspark.tokens, dspark.parents, dspark.logprobs,
                                                tree_depths(dspark.parents)), candidates, request.budget)
        return ProposalResult(merged.tokens, merged.parents, merged.logprobs, dspark.confidences,
                              [_SOURCE_NAMES[x] for x in sources], batch_sessions=dspark.batch_sessions)
