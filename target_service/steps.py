"""One decoding step of a target session, as the target runs it with its own drafter (the Step op).

Per session the target keeps a `SessionDrafting`: the draft session's ops waiting for the next round (its open,
the captures of the rows committed since the last round), in adaptive mode the target's `ModeChooser`, and the
failure that turned drafting off for the rest of the request. A step is: `plan` (AR or a proposer), the session's
ops of the round (`round_ops`), the proposal read back from the round's replies (`read_round`), the tree fitted to
the context and cut to the round's plan (`fit`), then the verify, `committed` and `report`. Captures go from the
target to the drafter only; the client sees token ids and the StepReport.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.speculation.mode_chooser import AR, ModeChooser
from dspark_grpc.speculation.round_planner import predicted_accepted
from dspark_grpc.speculation.tensors import concat_rows, first_rows, float32_tensor, float32_values
from dspark_grpc.speculation.wire import CODE_NAMES, PROTOCOL_VERSION

MAX_MOVES = 3  # a session's moves to another drafter of a pool (then it continues target-only)


@dataclass
class FittedTree:
    tree: common_pb2.TokenTree
    proposers: list[int]  # per node of `tree` (0 for the root)
    predicted_accepted: float | None  # what the chain's confidences predict (for the round's calibration)
    truncated: bool = False  # the round's plan cut the chain


@dataclass
class NextStep:
    """A step planned when the one before it committed: its arm and, drafted ahead, its round's ops and reply, or
    the rest of the last chain (`from_chain`) or a prompt-lookup chain (`from_lookup`) as its proposal: no round."""

    arm: int
    ops: list[draft_pb2.DraftSessionRequest] = field(default_factory=list)
    reply: Future | None = None
    from_chain: draft_pb2.Proposal | None = None
    from_lookup: draft_pb2.Proposal | None = None  # the drafter's prompt lookup done by the target: no round
    waits_turn: bool = False  # AR because the session waits its turn to draft beside AR sessions (`takes_turn`)


@dataclass
class ChainRest:
    """What a chain cut by the round's plan left unverified: draft tokens depth+1.. with their confidences and
    proposers (`depth`: the draft tokens that were verified)."""

    depth: int
    tokens: list[int]
    confidences: list[float]
    proposers: list[int]


@dataclass
class UnsentRows:
    """Committed rows not yet sent to the drafter: from `start`, their tokens and captures (in the target's form)."""

    start: int
    tokens: list[int] = field(default_factory=list)
    rows: list[Any] = field(default_factory=list)


@dataclass
class SessionDrafting:
    """The target's side of one session's draft session (one id on both services)."""

    session_id: str
    options: target_pb2.StepOptions
    info: draft_pb2.GetDrafterInfoResponse
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stream_generation: int = 0  # the link stream the draft session lives on (a new stream has lost it)
    chooser: ModeChooser | None = None  # adaptive mode: the target's, shared by its sessions
    failure: str | None = None
    opened: bool = False  # its open has been sent
    queued: list[draft_pb2.DraftSessionRequest] = field(default_factory=list)
    steps: int = 0
    last_arm: int | None = None  # AR or SPECULATE, as last planned
    switches: list[str] = field(default_factory=list)  # the arm changes not reported yet
    next: NextStep | None = None  # planned (and maybe drafted) when the last step committed
    in_step: bool = False  # its step is under way (a round drafted for it now is verified at once)
    rest: ChainRest | None = None  # of the chain the last step verified, if cut short
    # Rows committed since the last round, as the target keeps them (`append_rows`): encoded into one capture by
    # `encode_rows(start, rows)` when the round is built, not at every step (an AR stretch sends one append).
    encode_rows: Callable[[int, list[Any]], common_pb2.HiddenCapture] | None = None
    unsent: UnsentRows | None = None
    # Everything the drafter was given (one append per queued append, rolled back with the session): kept where the
    # session can move to another drafter of a pool (`reopen`), else None.
    context: list[draft_pb2.AppendContext] | None = None
    target: common_pb2.Fingerprint = field(default_factory=common_pb2.Fingerprint)  # the open's
    moves: int = 0
    notes: list[str] = field(default_factory=list)  # for the next report: moves to another drafter, turns waited
    turn_credit: float | None = None  # see `takes_turn`

    @classmethod
    def start(cls, session_id: str, options: target_pb2.StepOptions, info: draft_pb2.GetDrafterInfoResponse,
              target: common_pb2.Fingerprint, chooser: ModeChooser, stream_generation: int,
              movable: bool = False) -> SessionDrafting:
        s = cls(session_id, options, info, stream_generation=stream_generation, context=[] if movable else None,
                target=target)
        if options.mode == common_pb2.DECODE_MODE_ADAPTIVE:
            s.chooser = chooser
        s.queued.append(s._open_op())
        return s

    def _open_op(self) -> draft_pb2.DraftSessionRequest:
        return draft_pb2.DraftSessionRequest(open=draft_pb2.OpenDraft(
            protocol_version=PROTOCOL_VERSION, target=self.target, session_id=self.session_id))

    def reopen(self, why: str, drafter: str) -> bool:
        """Move the draft session to another drafter (its draft state was lost with the last one: `why`): its next
        round opens it there and re-sends the whole context. False where the context was not kept (no pool), after
        MAX_MOVES moves, or when drafting has failed for good."""
        if self.context is None or not self.active or self.moves >= MAX_MOVES:
            return False
        self._send_unsent()
        self.queued = [self._open_op(), *(draft_pb2.DraftSessionRequest(append=a) for a in self.context)]
        self.opened, self.next, self.rest = False, None, None
        self.moves += 1
        self.notes.append(f"step {self.steps}: {why}; drafting moved to {drafter}")
        return True

    def _queue_append(self, op: draft_pb2.AppendContext) -> None:
        self.queued.append(draft_pb2.DraftSessionRequest(append=op))
        if self.context is not None:
            self.context.append(op)

    @property
    def active(self) -> bool:
        return self.failure is None

    def fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = f"{why}; continued target-only"

    def append(self, start: int, tokens: list[int], capture: common_pb2.HiddenCapture | None) -> None:
        """Committed rows for the drafter: sent with the session's next round."""
        if not self.active:
            return
        self._send_unsent()
        op = draft_pb2.AppendContext(session_id=self.session_id, start_position=start, tokens=tokens)
        if capture is not None and capture.layer_ids:  # prompt lookup alone takes token ids only
            op.capture.CopyFrom(capture)
        self._queue_append(op)

    def append_rows(self, start: int, tokens: list[int], rows: Any) -> None:
        """Committed rows for the drafter with their captures as the target holds them (`rows`: opaque here, one
        entry per token), encoded by `encode_rows` with those committed after them when the next round is built."""
        assert self.encode_rows is not None
        if not self.active:
            return
        if self.unsent is not None and start != self.unsent.start + len(self.unsent.tokens):
            self._send_unsent()
        if self.unsent is None:
            self.unsent = UnsentRows(start)
        self.unsent.tokens.extend(tokens)
        self.unsent.rows.append(rows)

    def _send_unsent(self) -> None:
        unsent, self.unsent = self.unsent, None
        if unsent is not None:
            assert self.encode_rows is not None
            self._queue_append(draft_pb2.AppendContext(
                session_id=self.session_id, start_position=unsent.start, tokens=unsent.tokens,
                capture=self.encode_rows(unsent.start, unsent.rows)))

    def rollback(self, length: int) -> None:
        """The target session was rolled back to `length` rows: the drafter's context follows (with the next
        round), and a proposal drafted ahead for the old position is dropped."""
        self.next, self.rest = None, None
        if self.active:
            self._send_unsent()
            self.queued.append(draft_pb2.DraftSessionRequest(truncate=draft_pb2.TruncateContext(
                session_id=self.session_id, length=length)))
            if self.context is not None:
                self.context = [a for a in (first_tokens(a, length - a.start_position) for a in self.context)
                                if a is not None]

    def plan(self, load: int) -> int:
        """AR, or the proposer to draft with this step (`load`: the sessions stepping now)."""
        self.steps += 1
        if not self.active:
            return AR
        if self.chooser is not None:
            arm = self.chooser.choose(load)
            if arm != self.last_arm:
                if self.last_arm is not None:
                    self.switches.append(f"step {self.steps}: {self.chooser.reason(load)}")
                self.last_arm = arm
            if arm == AR:
                return AR
        return self.options.proposer or self.info.default_proposer or draft_pb2.PROPOSER_DSPARK

    def takes_turn(self, share: float, phase: float) -> bool:
        """Whether this step drafts when the session may draft on `share` of its steps: a credit that grows by
        `share` a step and drafts when it reaches 1. It starts at `phase` (in [0, 1), the first time), so sessions
        given different phases take their turns at different steps."""
        if share >= 1.0:
            return True
        if self.turn_credit is None:
            self.turn_credit = phase
        self.turn_credit += share
        if self.turn_credit >= 1.0:
            self.turn_credit -= 1.0
            return True
        return False

    def round_ops(self, anchor: int, position: int, proposer: int) -> list[draft_pb2.DraftSessionRequest]:
        """What this session sends in the round: its queued ops, then the proposal request."""
        sampling = self.sampling
        if sampling.HasField("seed"):
            # The drafter's coins must be independent of the target's (both seeded from the request's seed) for
            # rejection sampling to stay exact, and fresh at every step: a per-position seed.
            sampling = common_pb2.SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                                 top_k=sampling.top_k, seed=draft_seed(sampling.seed, position))
        self._send_unsent()
        ops, self.queued = joined_appends(self.queued), []
        self.opened = True
        ops.append(draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(
            session_id=self.session_id, anchor_token=anchor, anchor_position=position,
            kind=self.options.proposal or draft_pb2.PROPOSAL_KIND_CHAIN, budget=self.options.budget,
            kernel=self.options.kernel, proposer=proposer, sampling=sampling)))
        return ops

    def read_round(self, ops: list[draft_pb2.DraftSessionRequest],
                   replies: Sequence[draft_pb2.DraftSessionResponse], anchor: int) -> draft_pb2.Proposal | None:
        """The proposal among this session's replies; any failed op turns drafting off (None)."""
        for op, reply in zip(ops, replies, strict=True):
            if reply.status.code:
                name = op.WhichOneof("op")
                self.fail(f"drafter {name} failed ({CODE_NAMES.get(reply.status.code, reply.status.code)}: "
                          f"{reply.status.message})")
                return None
        proposal = replies[-1].proposal
        if not proposal.tree.tokens or proposal.tree.tokens[0] != anchor:
            self.fail("the drafter returned a tree whose root is not the anchor")
            return None
        return proposal

    def fit(self, proposal: draft_pb2.Proposal, room: int, round_depth: int | None = None) -> FittedTree:
        """The proposal's tree within the context's room; a confident chain cut to the round's plan
        (speculation/round_planner.py)."""
        tree, kept = fit_tree(proposal.tree, room)
        proposers = [proposal.node_proposers[i] if i < len(proposal.node_proposers) else 0 for i in kept]
        predicted, truncated, self.rest = None, False, None
        if round_depth is not None:
            values = chain_confidences(tree, proposal.confidences)
            if values is not None:
                truncated = round_depth < len(values)
                if truncated and not tree.HasField("child_token_ids"):  # greedy: no draft distributions to keep
                    self.rest = ChainRest(round_depth, list(tree.tokens[round_depth + 1:]), values[round_depth:],
                                          proposers[round_depth + 1:])
                tree = cut_to_depth(tree, round_depth)
                predicted = predicted_accepted(values, round_depth)
        return FittedTree(tree, proposers[: len(tree.tokens)], predicted, truncated)

    def chain_ahead(self, accepted: int, next_token: int) -> draft_pb2.Proposal | None:
        """The next step's proposal from the rest of the chain just verified, when it still holds: all of the
        verified draft tokens were accepted and the target's next token is the chain's next one. The rest was then
        drafted on exactly the tokens now committed (only their captures were unseen: the drafter had drafted those
        rows itself), and the step needs no round; the captures go with the next one. Used once."""
        rest, self.rest = self.rest, None
        if rest is None or accepted != rest.depth or len(rest.tokens) < 2 or rest.tokens[0] != next_token:
            return None
        n = len(rest.tokens) - 1
        return draft_pb2.Proposal(
            tree=common_pb2.TokenTree(tokens=rest.tokens, parents=list(range(-1, n))),
            confidences=float32_tensor(rest.confidences[1:]), node_proposers=[0, *rest.proposers[1:]])

    def new_switches(self) -> str:
        """The chooser's switches for this session since the last report."""
        if not self.switches:
            return ""
        new, self.switches = self.switches, []
        return "adaptive: " + "; ".join(new)

    def finish(self) -> draft_pb2.DraftSessionRequest | None:
        """The release to send, if the draft session was opened."""
        if not self.opened:
            return None
        return draft_pb2.DraftSessionRequest(release=draft_pb2.ReleaseDraft(session_id=self.session_id))


def joined_appends(ops: list[draft_pb2.DraftSessionRequest]) -> list[draft_pb2.DraftSessionRequest]:
    """Runs of appends whose rows follow on from each other, joined into one append each: the drafter projects a
    session's rows in one pass however many steps committed them (after a stretch of AR steps, many)."""
    out: list[draft_pb2.DraftSessionRequest] = []
    run: list[draft_pb2.AppendContext] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(draft_pb2.DraftSessionRequest(append=run[0]))
        elif run:
            joined = draft_pb2.AppendContext(session_id=run[0].session_id, start_position=run[0].start_position,
                                             tokens=[t for a in run for t in a.tokens])
            if run[0].HasField("capture"):
                joined.capture.layer_ids.extend(run[0].capture.layer_ids)
                joined.capture.start_position = run[0].capture.start_position
                joined.capture.rows.CopyFrom(concat_rows([a.capture.rows for a in run]))
            out.append(draft_pb2.DraftSessionRequest(append=joined))
        run.clear()

    for op in ops:
        a = op.append if op.WhichOneof("op") == "append" else None
        if a is not None and run and _follows(run[-1], a):
            run.append(a)
            continue
        flush()
        if a is not None:
            run.append(a)
        else:
            out.append(op)
    flush()
    return out


def _follows(last: draft_pb2.AppendContext, a: draft_pb2.AppendContext) -> bool:
    if a.session_id != last.session_id or a.start_position != last.start_position + len(last.tokens):
        return False
    if last.HasField("capture") != a.HasField("capture"):
        return False
    if not a.HasField("capture"):
        return True
    x, y = last.capture, a.capture
    return list(x.layer_ids) == list(y.layer_ids) and x.rows.dtype == y.rows.dtype and \
        list(x.rows.shape[1:]) == list(y.rows.shape[1:]) and x.rows.shape[0] == len(last.tokens) and \
        y.rows.shape[0] == len(a.tokens)


def first_tokens(a: draft_pb2.AppendContext, n: int) -> draft_pb2.AppendContext | None:
    """The append's first `n` rows (None for none, the append itself for all)."""
    if n <= 0:
        return None
    if n >= len(a.tokens):
        return a
    cut = draft_pb2.AppendContext(session_id=a.session_id, start_position=a.start_position, tokens=a.tokens[:n])
    if a.HasField("capture"):
        cut.capture.layer_ids.extend(a.capture.layer_ids)
        cut.capture.start_position = a.capture.start_position
        cut.capture.rows.CopyFrom(first_rows(a.capture.rows, n))
    return cut


def draft_seed(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x5EED) % (1 << 63)


def tree_depth(parents: Sequence[int]) -> int:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


def fit_tree(tree: common_pb2.TokenTree, room: int) -> tuple[common_pb2.TokenTree, list[int]]:
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


def chain_confidences(tree: common_pb2.TokenTree, confidences: common_pb2.Tensor) -> list[float] | None:
    """The per-depth confidences of a chain that carries them (None for a tree or a chain without them)."""
    n = len(tree.tokens) - 1
    values = float32_values(confidences)
    if n < 1 or not values or list(tree.parents) != list(range(-1, n)):
        return None
    return values[:n]


def cut_to_depth(tree: common_pb2.TokenTree, depth: int) -> common_pb2.TokenTree:
    """The first `depth` draft tokens of a chain (with the rows of its tensors)."""
    if depth >= len(tree.tokens) - 1:
        return tree
    cut = common_pb2.TokenTree(tokens=tree.tokens[: depth + 1], parents=tree.parents[: depth + 1])
    for name in ("child_token_ids", "child_logprobs"):
        if tree.HasField(name):
            getattr(cut, name).CopyFrom(first_rows(getattr(tree, name), depth + 1))
    return cut
