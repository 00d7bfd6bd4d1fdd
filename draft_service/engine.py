"""The draft engine: per-session drafter context and proposals. Plain Python, no gRPC.

A session holds the committed rows of its sequence that the target has sent: token ids (indexed for prompt
lookup) and, with a DSpark drafter, the target's hidden-state captures at the drafter's `target_layer_ids`,
projected into the drafter's context K/V. A proposal drafts after the anchor (the target's pending token, at
position = context length) by one of the proposers (draft_service/proposers.py, one class each): the DSpark
chain or DDTree, prompt lookup, hybrid. The engine checks the request and resolves its budget; the proposer drafts.

Concurrent DSpark proposals of different sessions share one drafter pass: their block forwards go through a
StepBatcher (one worker thread runs whatever is queued as one `Drafter.forward_blocks`, then each session's chain
or tree, as its job's `then`). A per-session lock keeps a session's appends, truncations and
proposals from interleaving.

Start-up cost tables (`profile_costs`, logged at start-up): seconds of one proposal round in which `lanes` sessions
(1, 2, 4) share a drafter pass, by budget (the DSpark chain at its block size, trees of 4..32 nodes). A
prompt-lookup-only service makes none: an n-gram proposal is a few dictionary look-ups (microseconds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from dspark_grpc.draft_service.proposers import (
    DraftSession,
    DSparkDrafts,
    Hybrid,
    PassJob,
    PromptLookup,
    ProposalRequest,
    ProposalResult,
    Proposer,
    drafter_pass,
    dspark_proposal,
)
from dspark_grpc.runtime.drafting.markov import Chain, KernelChoiceError, KernelUnavailable, check_kernel
from dspark_grpc.runtime.drafting.ngram import NgramIndex
from dspark_grpc.runtime.drafting.sampling import check_temperature
from dspark_grpc.runtime.formats.checkpoint import PRECISIONS, default_model_path, load_checkpoint
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter, load_drafter
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.kernels.compiled_draft import CompiledChain, can_compile_drafter
from dspark_grpc.runtime.models.drafter import BlockOutput, Drafter
from dspark_grpc.serving.batching import BatchInfo, StepBatcher
from dspark_grpc.serving.cost_profile import drafter_cost_tables
from dspark_grpc.serving.service_metrics import DraftServiceMetrics
from dspark_grpc.serving.sessions import SessionStore
from dspark_grpc.serving.threads import ThreadGovernor
from dspark_grpc.speculation.cost_table import CostTable
from dspark_grpc.speculation.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from dspark_grpc.speculation.wire import CHAIN, DSPARK, HYBRID, NGRAM, PROTOCOL_VERSION, TREE

# How long a round's drafter pass waits for a proposal of the round that has not queued yet (only a proposal thread
# that never gets to run is waited for this long: one that needs no pass says so when it ends).
ROUND_WAIT_S = 2.0
PROPOSERS = (DSPARK, NGRAM, HYBRID)
# A DSpark drafter self-distilled with dspark-train for the embedded SmolLM2-135M-Instruct (docs/PERFORMANCE.md).
EMBEDDED_DRAFTER = Path(__file__).with_name("drafters") / "smollm2-135m-instruct-dspark"
# A target drafts all its sessions on one stream: one principal holding up to its --max-sessions (16 by default)
# draft sessions. One principal may hold one such target's worth, and the service holds two of them and the reserve
# (serving/sessions.py: an eighth, 4): a client that takes all it may (a stranger's flood on one connection) leaves
# a target with default flags all 16 of its draft sessions, and still a newcomer finds one.
DEFAULT_MAX_PER_PRINCIPAL = 16
DEFAULT_MAX_SESSIONS = 2 * DEFAULT_MAX_PER_PRINCIPAL + 4


@dataclass(frozen=True)
class DraftLimits:
    max_sessions: int = DEFAULT_MAX_SESSIONS
    idle_ttl_s: float = 600.0
    max_tree_budget: int = 64
    default_tree_budget: int = 16
    tree_top_k: int = 8
    default_kernel: str = "auto"  # for requests that do not choose
    default_proposer: str = ""  # "" = hybrid with a DSpark drafter, ngram without
    ngram_max: int = 4  # longest suffix matched by prompt lookup
    ngram_min: int = 2  # shortest (a single repeated token predicts little)
    ngram_chain: int = 8  # default n-gram chain length
    hybrid_min_match: int = 2  # a hybrid chain follows the n-gram continuation from this match length on
    sample_top_k: int = 32  # a sampled DSpark chain draws from the top-k of its corrected distribution
    # serving/sessions.py: None = max_sessions - reserved_sessions, 0 = no cap of its own; reserved_sessions None =
    # an eighth of max_sessions, at least one
    max_sessions_per_principal: int | None = DEFAULT_MAX_PER_PRINCIPAL
    reserved_sessions: int | None = None
    max_context: int = 1 << 16  # rows a session without a DSpark drafter may hold (with one: its max length)
    # Drafter passes on one thread while that measures faster (another process took a core; serving/threads.py).
    adaptive_threads: bool = True


class DraftEngine:
    def __init__(self, drafter: Drafter | None, vocab_size: int, target_fingerprint: tuple[str, str], name: str,
                 limits: DraftLimits):
        self.drafter = drafter
        self.config = drafter.config if drafter is not None else None
        self.vocab_size = vocab_size
        self.target_fingerprint = target_fingerprint
        self.name = name
        self.limits = limits
        self.default_proposer = limits.default_proposer or (HYBRID if drafter is not None else NGRAM)
        if drafter is None and self.default_proposer != NGRAM:
            raise ValueError(f"proposer {self.default_proposer!r} needs a DSpark drafter (--drafter); "
                             f"available: {(NGRAM,)}")
        self.sessions: SessionStore[DraftSession] = SessionStore(
            limits.max_sessions, limits.idle_ttl_s, max_per_principal=limits.max_sessions_per_principal,
            reserved=limits.reserved_sessions)
        self.metrics: DraftServiceMetrics | None = None
        self.propose_costs: list[CostTable] = []  # by lanes; see profile_costs
        self.compiled: CompiledChain | None = None  # a lone session's greedy chain as one graph (see `load`)
        self._passes: StepBatcher[PassJob, tuple[BlockOutput | None, Chain | None]] | None = None
        self.threads = ThreadGovernor(torch.get_num_threads())
        # a draft is only a guess: no check that the drafter's outputs do not depend on its thread count
        self.threads.enabled = limits.adaptive_threads and self.threads.enabled
        if drafter is not None:
            B = drafter.config.block_size

            def run_passes(jobs: list[PassJob]) -> list[tuple[BlockOutput | None, Chain | None]]:
                return self.threads.run(lambda: drafter_pass(drafter, jobs, self.compiled), B * len(jobs))

            # on one torch thread a lone pass runs on the thread that asked for it (StepBatcher.inline)
            self._passes = StepBatcher(run_passes, rows=lambda job: B,
                                       max_rows=B * limits.max_sessions, name="drafter-pass",
                                       on_batch=self._observe_pass, session=lambda job: id(job.context),
                                       inline=self.one_thread)
        lookup = PromptLookup(limits)
        self.proposers: dict[str, Proposer] = {NGRAM: lookup}  # by name, in the order the service lists them
        if drafter is not None:
            dspark = DSparkDrafts(drafter, self._passes, limits)
            self.proposers = {DSPARK: dspark, NGRAM: lookup, HYBRID: Hybrid(lookup, dspark, limits)}

    def one_thread(self) -> bool:
        """The drafter's torch work runs on one thread (no OpenMP team): any thread may run it."""
        return self.threads.threads == 1 and not self.threads.enabled

    def close(self) -> None:
        if self._passes is not None:
            self._passes.close()

    def _observe_pass(self, info: BatchInfo) -> None:
        if self.metrics is not None:
            self.metrics.observe_forward(info.jobs, info.rows, info.seconds)

    @classmethod
    def load(cls, drafter_path: str | Path | None, target_path: str | Path | None = None,
             dtype: torch.dtype = torch.float32, limits: DraftLimits | None = None, progress: bool = True,
             seed: int = 0, precision: str = "exact", device: torch.device | str = "cpu", compile: str = "off",
             compile_cache: Path | None = None) -> DraftEngine:
        """`drafter_path` None = prompt lookup only; "random" = a seeded random DSpark drafter for the target;
        "embedded" = the drafter shipped with the package for the embedded default target (EMBEDDED_DRAFTER).
        `precision` "fast": the drafter's projections and head as Q8_0 blocks on our CPU kernels (int8 weights and
        activations; a drafter's rounding changes which tokens it proposes, never the target's output). `device`:
        where the drafter runs, loaded on the CPU and moved there; off the CPU "fast" runs in `dtype` on torch's
        matmuls (the Q8_0 kernels are CPU-only), said in one line. `compile` "fast"/"max": a lone session's greedy
        chain runs as one compiled graph (runtime/kernels/compiled_draft.py; loaded from or saved to
        `compile_cache`), where the drafter can take it."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if str(drafter_path) == "embedded":
            drafter_path = EMBEDDED_DRAFTER
        target_path = Path(target_path) if target_path else default_model_path()
        ckpt = load_checkpoint(target_path, progress=progress)
        if ckpt.gguf_metadata is not None:
            tokenizer = TextTokenizer.from_gguf_metadata(ckpt.gguf_metadata)
        else:
            tokenizer = TextTokenizer.from_hf_dir(ckpt.hf_dir)
        fingerprint = (ckpt.config.fingerprint(), tokenizer.fingerprint())
        drafter, name = None, f"prompt lookup for {ckpt.config.name}"
        if str(drafter_path) == "random":
            lm_head = ckpt.weights.get("output.weight", ckpt.weights["tok_embeddings.weight"])
            drafter = init_random_drafter(ckpt.config, seed=seed, target_embed=ckpt.weights["tok_embeddings.weight"],
                                          target_lm_head=lm_head)
            name = f"random drafter (seed {seed}) for {ckpt.config.name}"
        elif drafter_path is not None:
            drafter = load_drafter(drafter_path, target_path=target_path, dtype=dtype)
            name = Path(drafter_path).name
        if drafter is not None:
            check_drafter_fits_target(drafter, ckpt.config)
            device = torch.device(device)
            if progress and device.type != "cpu" and precision == "fast":
                print(f"[dspark-draft] {device}: precision fast runs in {str(dtype).removeprefix('torch.')} on torch's "
                      "matmuls (the Q8_0 kernels are CPU-only)", flush=True)
            drafter = drafter.to(dtype).to(device).eval().requires_grad_(False).pack(quantize=precision == "fast")
        engine = cls(drafter, ckpt.config.vocab_size, fingerprint, name, limits or DraftLimits())
        if drafter is not None and compile != "off":
            reason = can_compile_drafter(drafter)
            if reason is None:
                engine.compiled = CompiledChain(drafter, compile_cache, compile)
                engine.compiled.warm_up(progress)
            elif progress:
                print(f"[dspark-draft] the drafter runs eagerly: {reason}", flush=True)
        return engine

    # -- sessions ---------------------------------------------------------------------------------

    def open_session(self, target: tuple[str, str] | None, protocol_version: int = PROTOCOL_VERSION,
                     owner: object = None, session_id: str = "") -> str:
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"protocol version {protocol_version} is not supported; this drafter speaks "
                                     f"version {PROTOCOL_VERSION}")
        if target is None or not all(target):
            raise InvalidArgument("open.target must carry the target's model and tokenizer fingerprints "
                                  "(TargetService.GetModelInfo.fingerprint)")
        if target != self.target_fingerprint:
            raise FailedPrecondition(
                f"this drafter was built for another target (model {self.target_fingerprint[0][:12]}…, tokenizer "
                f"{self.target_fingerprint[1][:12]}…), not model {target[0][:12]}…, tokenizer {target[1][:12]}…")
        context = self.drafter.new_context() if self.drafter is not None else None
        return self.sessions.create(DraftSession(context, NgramIndex(self.limits.ngram_max)), owner, session_id)

    def release(self, session_id: str) -> None:
        self.sessions.release(session_id)

    def release_owner(self, owner: object) -> list[str]:
        return self.sessions.release_owner(owner)

    # -- context ------------------------------------------------------------------------------------

    def append(self, session_id: str, start: int, tokens: list[int], layer_ids: list[int],
               features: torch.Tensor | None) -> int:
        """Rows [start, start + n). Rows already held must be identical (idempotent); a gap is refused."""
        s = self.sessions.get(session_id)
        with s.lock:  # the rows' fc + K/V wait for the session's next drafter pass (runtime/models/drafter.py)
            return self._append(s, start, tokens, layer_ids, features)

    def _append(self, s: DraftSession, start: int, tokens: list[int], layer_ids: list[int],
                features: torch.Tensor | None) -> int:
        n = len(tokens)
        if start < 0:
            raise InvalidArgument(f"start_position must be >= 0, got {start}")
        if start > s.length:
            raise FailedPrecondition(f"gap: the context holds rows [0, {s.length}) and these rows start at {start}; "
                                     f"send rows from {s.length} on")
        limit = s.context.cache.max_length if s.context is not None else self.limits.max_context
        if start + n > limit:
            raise ResourceExhausted(f"rows [{start}, {start + n}) do not fit: a drafter session holds at most "
                                    f"{limit} rows; truncate the context or open a new session")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} out of range [0, {self.vocab_size})")
        if self.drafter is not None:
            self._check_features(n, layer_ids, features)
        overlap = min(s.length - start, n)
        if tokens[:overlap] != s.tokens[start : start + overlap]:
            raise FailedPrecondition(f"rows [{start}, {start + overlap}) differ from the rows already held; "
                                     "truncate the context first")
        if overlap < n:
            if s.context is not None:
                s.context.append(features[overlap:], start + overlap)
            s.index.extend(tokens[overlap:])
        return s.length

    def _check_features(self, n: int, layer_ids: list[int], features: torch.Tensor | None) -> None:
        if features is None:
            raise InvalidArgument("append.capture is missing: the DSpark drafter needs the target's hidden states")
        expected_layers = list(self.config.target_layer_ids)
        if list(layer_ids) != expected_layers:
            raise InvalidArgument(f"capture layer ids {list(layer_ids)} differ from the drafter's target_layer_ids "
                                  f"{expected_layers}")
        width = (len(expected_layers), self.config.target_hidden_size)
        if features.dim() != 3 or tuple(features.shape[1:]) != width or features.shape[0] != n:
            raise InvalidArgument(f"capture rows have shape {list(features.shape)}; expected [{n}, {width[0]}, "
                                  f"{width[1]}] (rows, layers, target hidden size)")
        if not features.is_floating_point():
            raise InvalidArgument(f"capture rows must be bfloat16 (or float16/float32), not {features.dtype}")
        if not bool(features.isfinite().all()):  # NaN/inf features give NaN draft probabilities
            raise InvalidArgument("capture rows contain NaN or infinite values")

    def truncate(self, session_id: str, length: int) -> int:
        s = self.sessions.get(session_id)
        with s.lock:
            if not 0 <= length <= s.length:
                raise InvalidArgument(f"truncate length must be in [0, {s.length}], got {length}")
            if s.context is not None:
                s.context.truncate(length)
            s.index.truncate(length)
            return s.length

    # -- proposals ----------------------------------------------------------------------------------

    def propose(self, session_id: str, anchor_token: int, anchor_position: int, tree: bool = False,
                budget: int = 0, kernel: str = "", temperature: float = 0.0,
                generator: torch.Generator | None = None, proposer: str = "") -> ProposalResult:
        s = self.sessions.get(session_id)
        proposer = proposer or self.default_proposer
        t0 = time.perf_counter()
        try:
            with s.lock:
                out = self._propose(s, anchor_token, anchor_position, tree, budget, kernel, temperature, generator,
                                    proposer)
        except KernelChoiceError as e:  # the model math's refusals, as the request's status
            raise InvalidArgument(str(e)) from None
        except KernelUnavailable as e:
            raise FailedPrecondition(str(e)) from None
        finally:
            if self._passes is not None:  # a proposal that needed no drafter pass: its round does not wait for it
                self._passes.unexpect(id(s.context))
        out.proposer, out.compute_seconds = proposer, time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.observe_proposal(proposer, TREE if tree else CHAIN, len(out.tokens) - 1,
                                          out.compute_seconds)
        return out

    def expect_proposals(self, session_ids: list[str], owner: object = None,
                         within_s: float = ROUND_WAIT_S) -> None:
        """The proposals of these sessions (of `owner`) are about to be asked for from their own threads (a
        DraftRound): their drafter passes run as one. Each must end with `proposal_done`, whether it ran or not."""
        if self._passes is None:
            return
        contexts = []
        for sid in session_ids:
            try:
                contexts.append(id(self.sessions.get(sid, owner).context))
            except NotFound:
                pass  # its proposal fails on its own
        self._passes.expect(contexts, within_s)

    def proposal_done(self, session_id: str, owner: object = None) -> None:
        """A round's proposal has ended (drafted, or refused before its pass): the pass no longer waits for it."""
        if self._passes is None:
            return
        try:
            self._passes.unexpect(id(self.sessions.get(session_id, owner).context))
        except NotFound:
            pass

    def _propose(self, s: DraftSession, anchor_token: int, anchor_position: int, tree: bool, budget: int,
                 kernel: str, temperature: float, generator: torch.Generator | None, proposer: str
                 ) -> ProposalResult:
        if proposer not in self.proposers:
            raise InvalidArgument(f"proposer {proposer!r} is not available here; this drafter offers "
                                  f"{tuple(self.proposers)}")
        if budget < 0:
            raise InvalidArgument(f"budget must be >= 0 (0 = the default), got {budget}")
        try:
            check_temperature(temperature)
        except ValueError as e:
            raise InvalidArgument(f"sampling: {e}") from e
        if not 0 <= anchor_token < self.vocab_size:
            raise InvalidArgument(f"anchor token {anchor_token} out of range [0, {self.vocab_size})")
        if anchor_position != s.length:
            raise FailedPrecondition(f"the anchor must sit right after the context: the context has {s.length} rows, "
                                     f"the anchor is at {anchor_position}")
        if s.length == 0:
            raise FailedPrecondition("the context is empty: append the prompt's rows first")
        kernel = kernel or self.limits.default_kernel
        check_kernel(kernel)
        p = self.proposers[proposer]
        default, limit = p.budgets(tree)
        budget = budget or default
        if not 1 <= budget <= limit:
            raise InvalidArgument(f"budget {budget} out of range: 1..{limit} for a {TREE if tree else CHAIN} "
                                  f"from the {proposer} proposer")
        return p.propose(ProposalRequest(s, anchor_token, tree, budget, kernel, temperature, generator))

    # -- cost tables --------------------------------------------------------------------------------

    def profile_costs(self, cache_dir: str | Path | None, lanes: tuple[int, ...] = (1, 2, 4),
                      tree_budgets: tuple[int, ...] = (4, 8, 16, 32), context: int = 128, repeats: int = 3,
                      max_seconds: float = 2.0) -> list[CostTable]:
        """One proposal cost table per lane count (serving/cost_profile.py `drafter_cost_tables`), kept in
        `propose_costs`: sizes = proposal budgets, the chain at num_drafts (where that is also a tree budget, the
        tree, which runs the chain as well) and the tree budgets up to the limit. Timed on the drafter passes'
        worker, where the passes they price run (an OpenMP team of the calling thread's beside the worker's would
        make every barrier sleep: target_service/engine.py `profile_costs`)."""
        d = self.drafter
        if d is None or self._passes is None:
            self.propose_costs = []
            return []
        budgets = {b for b in tree_budgets if b <= self.limits.max_tree_budget}
        name = f"dspark:{drafter_fingerprint(d)}:{self.limits.default_kernel}:top{self.limits.tree_top_k}"
        self.propose_costs = self._passes.call(lambda: drafter_cost_tables(
            d, cache_dir, name, self.target_fingerprint[0], sorted(budgets | {d.config.num_drafts}),
            lambda out, anchor, b: dspark_proposal(d, out, anchor, b in budgets, b, self.limits.default_kernel, 0.0,
                                                   None, self.limits),
            lanes=lanes, context=context, repeats=repeats, max_seconds=max_seconds))
        return self.propose_costs


def drafter_fingerprint(drafter: Drafter) -> str:
    """sha256 of the drafter's configuration (its shape; what its step cost depends on)."""
    canonical = json.dumps(dataclasses.asdict(drafter.config), sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def check_drafter_fits_target(drafter: Drafter, target) -> None:
    c = drafter.config
    problems = []
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab {c.vocab_size} vs the target's {target.vocab_size}")
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {c.target_hidden_size} vs {target.hidden_size}")
    if max(c.target_layer_ids) >= target.num_layers:
        problems.append(f"target_layer_ids {list(c.target_layer_ids)} beyond the target's {target.num_layers} layers")
    if problems:
        raise ValueError("the drafter does not fit this target: " + "; ".join(problems))
