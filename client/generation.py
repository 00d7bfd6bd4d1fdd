"""The generation loop, written once over the TargetSession protocol.

The SDK runs it over a gRPC stream; the target service's Generate RPC runs the very same loop
in-process. It only speaks dspark.v1 messages, so it needs no torch.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dspark_grpc.client.planner import AR, PlannerMemory, StepPlanner, VerifyCosts
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2

PROTOCOL_VERSION = common_pb2.PROTOCOL_VERSION_1


class RequestError(Exception):
    """An operation failed with a gRPC status code (google.rpc.Code numbering) and a message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{_CODE_NAMES.get(code, code)}: {message}")
        self.code = code
        self.message = message


_CODE_NAMES = {1: "CANCELLED", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
               8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION", 13: "INTERNAL", 14: "UNAVAILABLE"}


class TargetOps(Protocol):
    """One request, one response, in order (a TargetSession stream or an in-process dispatcher)."""

    def call(self, request: target_pb2.TargetSessionRequest) -> target_pb2.TargetSessionResponse: ...


def checked(response: target_pb2.TargetSessionResponse) -> target_pb2.TargetSessionResponse:
    if response.status.code:
        raise RequestError(response.status.code, response.status.message)
    return response


class StopStrings:
    """Holds back text that may be the start of a stop string; cuts the text before the first stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        buf = self.held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


class DraftOps(Protocol):
    """A DraftSession stream: one response per request, in order; `timeout` bounds the wait for one."""

    def call(self, request: draft_pb2.DraftSessionRequest, timeout: float | None = None
             ) -> draft_pb2.DraftSessionResponse: ...

    def send(self, request: draft_pb2.DraftSessionRequest) -> None: ...

    def receive(self, timeout: float | None = None) -> draft_pb2.DraftSessionResponse: ...


@dataclass
class SpeculationConfig:
    drafter: DraftOps
    info: draft_pb2.GetDrafterInfoResponse
    kind: int = draft_pb2.PROPOSAL_KIND_CHAIN
    budget: int = 0  # 0 = the drafter's default (its whole block for a chain)
    kernel: int = draft_pb2.KERNEL_CHOICE_UNSPECIFIED
    proposer: int = draft_pb2.PROPOSER_UNSPECIFIED  # the drafter's default
    adaptive: bool = False  # plan each step (client.planner.StepPlanner)
    timeout_s: float | None = 10.0  # per drafter call; slower means the drafter is treated as failed (None: no bound)
    verify_costs: Sequence[common_pb2.CostTable] = ()  # the target's start-up cost tables, for the planner
    memory: PlannerMemory | None = None  # planner estimates shared across requests

    def planner_arms(self) -> list[int]:
        """Proposers the adaptive planner chooses among: the one asked for, else the drafter's default and, beside
        a DSpark default, the nearly free prompt lookup. Not beside hybrid: hybrid already follows every n-gram
        continuation, and as a separate arm prompt lookup took the steps where text repeats, which left the hybrid
        arm's estimate with the hard steps only (measured: adaptive then ran AR 80 % of the time, at AR's speed,
        where always-hybrid was 1.24x AR)."""
        if self.proposer != draft_pb2.PROPOSER_UNSPECIFIED:
            return [self.proposer]
        default = self.info.default_proposer or draft_pb2.PROPOSER_DSPARK
        arms = [default]
        if default == draft_pb2.PROPOSER_DSPARK and draft_pb2.PROPOSER_NGRAM in self.info.proposers:
            arms.append(draft_pb2.PROPOSER_NGRAM)
        return arms


class Speculator:
    """The client's side of one draft session. Any drafter failure turns it off for the rest of the request
    (the request goes on target-only: same tokens) and records why."""

    def __init__(self, spec: SpeculationConfig) -> None:
        self.spec = spec
        self.session_id = ""
        self.failure: str | None = None
        self._ids = iter(range(1, 1 << 62))
        self._unanswered: deque[str] = deque()  # what each request sent and not yet answered was
        self._failed_op: str | None = None

    @property
    def active(self) -> bool:
        return self.failure is None

    def _call(self, **op: object):
        self._failed_op = None
        self._send(**op)
        while len(self._unanswered) > 1:  # pipelined appends: their replies come first, each checked
            self._receive()
        return self._receive()

    def _send(self, **op: object) -> None:
        request = draft_pb2.DraftSessionRequest(request_id=next(self._ids), **op)
        self._unanswered.append(next(iter(op)))
        try:
            self.spec.drafter.send(request)
        except Exception as e:  # noqa: BLE001 - transport errors, a dead drafter: all fail closed
            raise _request_error(e) from e

    def _receive(self):
        self._failed_op = self._unanswered.popleft()
        try:
            response = self.spec.drafter.receive(timeout=self.spec.timeout_s)
        except Exception as e:  # noqa: BLE001 - transport errors, timeouts, a dead drafter: all fail closed
            raise _request_error(e) from e
        response = checked(response)
        return getattr(response, response.WhichOneof("result"))

    def _guard(self, what: str, **op: object):
        if not self.active:
            return None
        try:
            return self._call(**op)
        except RequestError as e:
            self._fail(self._failed_op or what, e)
            return None

    def _fail(self, what: str, e: RequestError) -> None:
        self.failure = f"drafter {what} failed ({_CODE_NAMES.get(e.code, e.code)}: {e.message}); " \
                       "continued target-only"

    def open(self, target: common_pb2.Fingerprint) -> None:
        opened = self._guard("open", open=draft_pb2.OpenDraft(protocol_version=PROTOCOL_VERSION, target=target))
        if opened is not None:
            self.session_id = opened.session_id

    def append(self, start: int, tokens: list[int], capture: common_pb2.HiddenCapture) -> None:
        """Send the committed rows without waiting: the reply (checked) is read before the next proposal's, which
        saves a round trip per step."""
        op = draft_pb2.AppendContext(session_id=self.session_id, start_position=start, tokens=tokens)
        if capture.layer_ids:  # prompt lookup alone takes token ids only
            op.capture.CopyFrom(capture)
        if self.active:
            try:
                self._send(append=op)
            except RequestError as e:
                self._fail("append", e)

    def propose(self, anchor: int, position: int, sampling: common_pb2.SamplingParams,
                proposer: int | None = None) -> draft_pb2.Proposal | None:
        if sampling.HasField("seed"):
            # The drafter's coins must be independent of the target's (both seeded from the request's seed) for
            # rejection sampling to stay exact, and fresh at every step: derive a per-position seed.
            sampling = common_pb2.SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                                 top_k=sampling.top_k, seed=_draft_seed(sampling.seed, position))
        proposal = self._guard("propose", propose=draft_pb2.Propose(
            session_id=self.session_id, anchor_token=anchor, anchor_position=position, kind=self.spec.kind,
            budget=self.spec.budget, kernel=self.spec.kernel,
            proposer=self.spec.proposer if proposer is None else proposer, sampling=sampling))
        if proposal is None:
            return None
        if not proposal.tree.tokens or proposal.tree.tokens[0] != anchor:
            self.failure = "drafter returned a tree whose root is not the anchor; continued target-only"
            return None
        return proposal

    def release(self) -> None:
        if self.session_id and self.active:
            try:
                self._call(release=draft_pb2.ReleaseDraft(session_id=self.session_id))
            except RequestError:
                pass


def generate_deltas(target: TargetOps, prompt: common_pb2.Prompt, config: GenerationConfig,
                    eos_token_ids: frozenset[int], stats: common_pb2.GenerationStats,
                    speculation: SpeculationConfig | None = None) -> Iterator[Delta]:
    """Prefill, then one target forward per step (verifying the drafter's proposal when speculating);
    yields what each step adds. Releases its sessions on every exit."""
    if config.max_new_tokens <= 0:
        raise RequestError(3, f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    ids = iter(range(1, 1 << 62))

    def call(**op: object) -> target_pb2.TargetSessionResponse:
        return checked(target.call(target_pb2.TargetSessionRequest(request_id=next(ids), **op)))

    drafter = Speculator(speculation) if speculation is not None else None
    planner = None
    if speculation is not None and speculation.adaptive:
        planner = StepPlanner(speculation.planner_arms(), VerifyCosts(speculation.verify_costs), speculation.memory)
    open_op = target_pb2.OpenSession(protocol_version=PROTOCOL_VERSION)
    if drafter is not None:
        open_op.capture_layer_ids.extend(speculation.info.target_layer_ids)
        open_op.drafter_target.CopyFrom(speculation.info.target)
    try:
        opened = call(open=open_op).opened
    except RequestError as e:
        if drafter is None or e.code != 9:  # FAILED_PRECONDITION: the target refused this drafter
            raise
        drafter.failure = f"the target refused the drafter ({e.message}); target-only"
        opened = call(open=target_pb2.OpenSession(protocol_version=PROTOCOL_VERSION)).opened
    sid = opened.session_id
    stop = StopStrings(list(config.stop))
    drafted: list[int] = []  # per depth: steps that drafted a token at that depth
    accepted: list[int] = []  # per depth: steps whose accepted path reached that depth
    t0 = time.perf_counter()
    try:
        if drafter is not None and drafter.active:
            drafter.open(opened.fingerprint)
        pre = call(prefill=target_pb2.Prefill(session_id=sid, prompt=prompt, sampling=config.sampling)).prefilled
        t_prefill = time.perf_counter()
        stats.prompt_tokens = len(pre.prompt_tokens)
        stats.prefill_seconds = t_prefill - t0
        length = len(pre.prompt_tokens)
        if drafter is not None:
            drafter.append(0, list(pre.prompt_tokens), pre.capture)
        emitted, texts = [pre.next_token], [pre.text]
        while True:
            delta = Delta("", [])
            for token, piece in zip(emitted, texts, strict=True):
                if token in eos_token_ids and not config.ignore_eos:
                    delta.finish_reason = common_pb2.FINISH_REASON_EOS
                    break
                delta.token_ids.append(token)
                stats.generated_tokens += 1
                safe, hit = stop.push(piece)
                delta.text += safe
                if hit:
                    delta.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
                    break
                if stats.generated_tokens >= config.max_new_tokens:
                    delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    break
            if not delta.finish_reason and length + 1 > opened.max_length:
                delta.finish_reason = common_pb2.FINISH_REASON_CONTEXT_FULL
            if delta.finish_reason and delta.finish_reason != common_pb2.FINISH_REASON_STOP_STRING:
                delta.text += stop.flush()
            if delta.finish_reason:
                _finish_stats(stats, time.perf_counter() - t_prefill, drafted, accepted, drafter, planner)
                yield delta
                return
            yield delta

            pending = emitted[-1]
            tree, proposers, predicted = None, [], None
            t_draft = time.perf_counter()
            arm = planner.choose(stats.steps + 1) if planner is not None and drafter.active else None
            if drafter is not None and drafter.active and arm != AR:
                proposal = drafter.propose(pending, length, config.sampling, proposer=arm)
                wall = time.perf_counter() - t_draft
                stats.draft_seconds += wall
                if proposal is not None:
                    stats.transport_seconds += max(wall - proposal.compute_seconds, 0.0)
                    tree, kept = _fit_tree(proposal.tree, opened.max_length - length)
                    proposers = [proposal.node_proposers[i] for i in kept if i < len(proposal.node_proposers)]
                    if planner is not None:
                        tree, predicted = _cut_chain(planner, tree, proposal.confidences)
            draft_wall = time.perf_counter() - t_draft
            if tree is None:
                tree = common_pb2.TokenTree(tokens=[pending], parents=[-1])
            t_step = time.perf_counter()
            verified = call(verify=target_pb2.Verify(session_id=sid, tree=tree, commit=True)).verified
            wall = time.perf_counter() - t_step
            stats.verify_seconds += wall
            stats.transport_seconds += max(wall - verified.compute_seconds, 0.0)
            stats.steps += 1
            stats.committed_per_step.append(len(verified.accepted_path))
            depth = _depth(tree.parents)
            if planner is not None and arm is not None:
                planner.observe(arm, len(tree.tokens), len(verified.accepted_path) - 1, draft_wall,
                                time.perf_counter() - t_draft, verified.compute_seconds, verified.batch_sessions,
                                verified.batch_rows, predicted)
            if depth:
                stats.speculative_steps += 1
                _count(drafted, depth)
                _count(accepted, len(verified.accepted_path) - 1)
                for node in verified.accepted_path[1:]:
                    name = _PROPOSER_NAMES.get(proposers[node] if node < len(proposers) else 0, "unknown")
                    stats.accepted_by_proposer[name] += 1
            else:
                stats.ar_steps += 1
            committed = [tree.tokens[n] for n in verified.accepted_path]
            if drafter is not None:
                drafter.append(length, committed, verified.capture)
            length = verified.length
            emitted = committed[1:] + [verified.next_token]
            texts = list(verified.token_texts)
    finally:
        if planner is not None:
            planner.finish()
        if drafter is not None:
            drafter.release()
        try:
            call(release=target_pb2.Release(session_id=sid))
        except Exception:  # noqa: BLE001 - the stream may already be gone; the server frees it then
            pass


def _request_error(e: Exception) -> RequestError:
    if isinstance(e, RequestError):
        return e
    code = getattr(e, "code", None)
    return RequestError(code if isinstance(code, int) else 14, f"{type(e).__name__}: {e}")


def _draft_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x5EED) % (1 << 63)


_PROPOSER_NAMES = {v: k.removeprefix("PROPOSER_").lower() for k, v in draft_pb2.Proposer.items()}


def _depth(parents) -> int:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


def _fit_tree(tree: common_pb2.TokenTree, room: int) -> tuple[common_pb2.TokenTree, list[int]]:
    """Drop nodes deeper than the context has room for (the root needs one row, each depth one more).
    Returns the tree and the original indices of the nodes kept."""
    keep, depth = [], {}
    for i, p in enumerate(tree.parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
        if depth[i] < room:
            keep.append(i)
    if len(keep) == len(tree.tokens):
        return tree, keep
    index = {old: new for new, old in enumerate(keep)}
    return common_pb2.TokenTree(tokens=[tree.tokens[i] for i in keep],
                                parents=[-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep]), keep


def _cut_chain(planner: StepPlanner, tree: common_pb2.TokenTree, confidences: common_pb2.Tensor
               ) -> tuple[common_pb2.TokenTree, float | None]:
    """Cut a chain that carries confidences to the depth the planner picks; also sum_d prod_{j<=d} c_j over what
    is kept, the accepted tokens the uncalibrated confidences predict (for the planner's calibration). Trees and
    chains without confidences pass unchanged."""
    n = len(tree.tokens) - 1
    if n < 1 or not confidences.data or list(tree.parents) != list(range(-1, n)):
        return tree, None
    values = list(struct.unpack(f"<{len(confidences.data) // 4}f", confidences.data))[:n]
    m = planner.cut_chain(values)
    survival, expected = 1.0, 0.0
    for c in values[:m]:
        survival *= min(max(c, 0.0), 1.0)
        expected += survival
    if m < n:
        cut = common_pb2.TokenTree(tokens=tree.tokens[: m + 1], parents=tree.parents[: m + 1])
        for name in ("node_logprobs", "child_token_ids", "child_logprobs"):
            if tree.HasField(name):
                getattr(cut, name).CopyFrom(_first_rows(getattr(tree, name), m + 1))
        tree = cut
    return tree, expected


def _first_rows(t: common_pb2.Tensor, rows: int) -> common_pb2.Tensor:
    """The first `rows` rows of a tensor message (any dtype: bytes per row from its size)."""
    row_bytes = len(t.data) // t.shape[0] if t.shape and t.shape[0] else 0
    return common_pb2.Tensor(dtype=t.dtype, shape=[rows, *t.shape[1:]], data=t.data[: rows * row_bytes])


def _count(counts: list[int], depth: int) -> None:
    """counts[d-1] += 1 for d in 1..depth."""
    counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1


def _finish_stats(stats: common_pb2.GenerationStats, decode_seconds: float, drafted: list[int],
                  accepted: list[int], drafter: Speculator | None, planner: StepPlanner | None) -> None:
    stats.decode_seconds = decode_seconds
    # tokens committed per target forward, bonus included (the prefill's token is not a decode step's)
    if stats.steps:
        stats.acceptance_length = (stats.generated_tokens - 1) / stats.steps
    accepted = accepted + [0] * (len(drafted) - len(accepted))
    del stats.per_position_acceptance[:], stats.drafted_per_position[:], stats.accepted_per_position[:]
    stats.drafted_per_position.extend(drafted)
    stats.accepted_per_position.extend(accepted)
    stats.per_position_acceptance.extend(a / d for a, d in zip(accepted, drafted, strict=True))
    if drafter is None:
        stats.mode_run = common_pb2.DECODE_MODE_AR
    else:
        stats.mode_run = common_pb2.DECODE_MODE_SPECULATION if stats.speculative_steps else common_pb2.DECODE_MODE_AR
        reasons = [drafter.failure] if drafter.failure else []
        if planner is not None:
            stats.planned_ar_steps = planner.planned_ar
            stats.truncated_drafts = planner.truncated
            if planner.switches:
                reasons.append("adaptive: " + "; ".join(planner.switches))
        stats.fallback_reason = "; ".join(reasons)
    total = stats.prefill_seconds + decode_seconds
    if total > 0:
        stats.tokens_per_second = stats.generated_tokens / total
