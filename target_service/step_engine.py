"""One speculative step in one place: `StepEngine.step` reads plan -> draft -> verify and commit -> report.

The step engine holds what the target keeps of a session beside the model's TargetSession (its drafting state, the
drafter it drafts on, when its last step ended) and every session operation a generation makes: `open`, `prefill`,
`step`, `rollback`, `release`. The Generate RPC calls them directly from its request's thread; the TargetSession
stream reaches them through the servicer's `_dispatch` (target_service/servicer.py), which only translates.

A step: `_plan` (the arm: AR or a proposer, decided when the step before committed, or now), `_draft` (the proposal:
the rest of the last chain, the drafter round asked for ahead, or one asked for now; target_service/draft_rounds.py),
`TargetEngine.verify` (one batched forward, acceptance, commit), then the report, the samples for the adaptive
chooser, and the next step's round asked for ahead (`_draft_ahead`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence

import torch
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.runtime.drafting.ngram import NgramIndex, anchored_candidates, ngram_tree
from dspark_grpc.runtime.drafting.sampling import SamplingParams
from dspark_grpc.serving.server import check_enum
from dspark_grpc.serving.tensor_codec import from_proto, rows_to_proto
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel
from dspark_grpc.speculation.cost_table import VerifyCosts
from dspark_grpc.speculation.errors import FailedPrecondition, InvalidArgument, Unavailable
from dspark_grpc.speculation.mode_chooser import AR, SPECULATE, ModeChooser
from dspark_grpc.speculation.round_planner import (
    AR_NEIGHBOUR_SLOWDOWN,
    RoundCalibration,
    draft_share,
    plan_depths,
    rows_beside,
)
from dspark_grpc.target_service.draft_rounds import NEXT_ROUND_WAIT_S, DraftRounds, RoundJob, RoundReply
from dspark_grpc.target_service.drafter_link import DrafterLink
from dspark_grpc.target_service.drafter_pool import Drafter, DrafterPool
from dspark_grpc.target_service.engine import Committed, Prompt, TargetEngine
from dspark_grpc.target_service.steps import NextStep, SessionDrafting, chain_confidences, tree_depth

NEIGHBOURS_MEMORY_S = 1.0  # a session counts as stepping beside the others this long after its last step
GOLDEN = (5**0.5 - 1) / 2  # k x GOLDEN mod 1: the sessions' phases of turns, spread evenly whatever their number


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                              seed=msg.seed if msg.HasField("seed") else None)
    except ValueError as e:
        raise InvalidArgument(f"sampling: {e}") from e


def prompt_from_proto(msg: common_pb2.Prompt) -> Prompt:
    """The prompt as TargetEngine.prefill takes it (which checks it: sizes, roles, token ids); token ids stay in
    their protobuf container, so an oversized prompt is refused before they are copied."""
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return msg.text
    if kind == "chat":
        if not msg.chat.messages:
            raise InvalidArgument("prompt.chat has no messages")
        return [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    if kind == "tokens":
        return msg.tokens.ids
    raise InvalidArgument("the prompt is missing: set prompt.text, prompt.chat or prompt.tokens")


def check_step_options(o: target_pb2.StepOptions, prefix: str = "step_options.") -> None:
    check_enum(common_pb2.DecodeMode, o.mode, prefix + "mode")
    check_enum(draft_pb2.ProposalKind, o.proposal, prefix + "proposal")
    check_enum(draft_pb2.KernelChoice, o.kernel, prefix + "kernel")
    check_enum(draft_pb2.Proposer, o.proposer, prefix + "proposer")
    if o.budget < 0:
        raise InvalidArgument(f"{prefix}budget must be >= 0 (0 = the drafter's default), got {o.budget}")


def capture_to_proto(layers: tuple[int, ...], start: int,
                     rows: torch.Tensor | Sequence[torch.Tensor] | None) -> common_pb2.HiddenCapture | None:
    """`rows` [n, L, H] from row `start` on (or the captures of consecutive commits, joined) as the wire carries
    them."""
    if rows is None or not layers:
        return None
    parts = [rows] if isinstance(rows, torch.Tensor) else list(rows)
    assert all(p.dim() == 3 and p.shape[1] == len(layers) for p in parts)
    return common_pb2.HiddenCapture(layer_ids=layers, start_position=start,
                                    rows=rows_to_proto([p.to(torch.bfloat16) for p in parts]))


def committed_fields(s_layers: tuple[int, ...], c: Committed) -> dict:
    return dict(capture=capture_to_proto(s_layers, c.start, c.captures), token_texts=c.token_texts, length=c.length)




def check_tree_tensors(tree: common_pb2.TokenTree) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validates the optional tensors of a tree; returns the child distributions (ids, log-probs) if both are sent."""
    n = len(tree.tokens)
    tensors = {}
    for name in ("child_token_ids", "child_logprobs"):
        if tree.HasField(name):
            t = tensors[name] = from_proto(getattr(tree, name), f"tree.{name}")
            if t.dim() != 2 or t.shape[0] != n:
                raise InvalidArgument(f"tree.{name} has shape {list(t.shape)}; it must be [number of nodes ({n}), k]")
    ids, lps = tensors.get("child_token_ids"), tensors.get("child_logprobs")
    if (ids is None) != (lps is None):
        raise InvalidArgument("send tree.child_token_ids and tree.child_logprobs together")
    if ids is not None and (ids.shape != lps.shape or ids.shape[1] < 1 or ids.is_floating_point()
                            or not lps.is_floating_point()):
        raise InvalidArgument(f"tree.child_token_ids {list(ids.shape)} ({ids.dtype}) and tree.child_logprobs "
                              f"{list(lps.shape)} ({lps.dtype}) must be [nodes, k >= 1] integer ids and float "
                              "log-probs")
    return ids, lps



@dataclasses.dataclass
class StepDraft:
    """What a step verifies: its tree (one node for an AR step), each node's proposer, the accepted length the
    round's plan predicted and the depth it planned, and a sampled chain's draft distributions."""

    tree: common_pb2.TokenTree
    proposers: list[int]
    predicted: float | None = None
    reply_depth: int | None = None
    draft_ids: torch.Tensor | None = None
    draft_logprobs: torch.Tensor | None = None

    @staticmethod
    def ar(pending: int) -> StepDraft:
        return StepDraft(common_pb2.TokenTree(tokens=[pending], parents=[-1]), [0])


@dataclasses.dataclass
class ServedSession:
    """What the servicer keeps of a session beside the engine's TargetSession: when its last step (or its prefill)
    ended, for the mode chooser; and, when it steps with a drafter, its drafting state and the drafter it drafts on
    (that drafter's rounds; another one of the pool after a failure)."""

    step_ended: tuple[float, int | None, int] | None = None  # (when, the arm it ran, the engine's prefill epoch then)
    drafting: SessionDrafting | None = None
    rounds: DraftRounds | None = None
    lookup: NgramIndex | None = None  # its committed tokens, for the drafter's prompt lookup done here (`_lookup`)


class StepEngine:
    """The target's sessions as they step: with the target's drafter (a pool of them, `drafter_address`) or without.
    `engine` is set once the model is loaded."""

    def __init__(self, drafter_address: str | None = None, default_mode: int = common_pb2.DECODE_MODE_ADAPTIVE,
                 draft_timeout: float = 10.0, drafter_security: ChannelSecurity | None = None,
                 draft_ahead: bool = True) -> None:
        self.engine: TargetEngine | None = None

        def start_drafter(address: str, server_name: str | None) -> Drafter:
            security = drafter_security
            if server_name and security is not None and security.tls and not security.server_name:
                security = dataclasses.replace(security, server_name=server_name)  # one IP of a dns name
            link = DrafterLink(make_channel(address, security), address, draft_timeout).start()
            # (without drafting ahead a session's next round comes after its client's round trip: not waited for)
            return Drafter(link, DraftRounds(link, link.draft_timeout, self._round_drafted, self._plan_round,
                                             NEXT_ROUND_WAIT_S if draft_ahead else 0.0))

        # one drafter, or a pool ("host:port,host:port" or "dns:///NAME:PORT"): each session drafts on one of them
        self.drafters = DrafterPool(drafter_address, start_drafter) if drafter_address else None
        self.served: dict[str, ServedSession] = {}  # what the step engine keeps of a session, by id
        self.round_calibration = RoundCalibration()
        # speculating sessions beside AR ones keep the forwards they share within this x their cost (None: no bound)
        self.ar_neighbour_slowdown: float | None = AR_NEIGHBOUR_SLOWDOWN
        self._turn_phases = itertools.count()  # see `_arm`
        self._costs: tuple[list, list[common_pb2.CostTable], VerifyCosts] | None = None  # see cost_tables
        # draft ahead: a session's next proposal is asked for as soon as its step commits
        self.draft_ahead = draft_ahead
        self.default_mode = default_mode
        self.metrics = None  # a SpecDecodeMetrics when the service exports Prometheus metrics
        # adaptive mode: speculate or AR, per load (its cost table set at load); it learns from every session's
        # steps, whatever its mode: an AR session's step is a sample of AR as much as an adaptive one's
        self.chooser = ModeChooser()

    def ready_engine(self) -> TargetEngine:
        if self.engine is None:
            raise Unavailable("the target model is still loading; retry when health reports SERVING")
        return self.engine

    def drafting_of(self, session_id: str) -> SessionDrafting | None:
        served = self.served.get(session_id)
        return served.drafting if served is not None else None

    # -- session operations -------------------------------------------------------------------------

    def open(self, m: target_pb2.OpenSession, owner: object) -> target_pb2.SessionOpened:
        engine = self.ready_engine()
        for gone in [sid for sid in list(self.served) if sid not in engine.sessions]:  # evicted while idle
            self._stop_drafting(gone)
        layers = list(m.capture_layer_ids)
        drafter = (m.drafter_target.model, m.drafter_target.tokenizer) if m.HasField("drafter_target") else None
        options = target_pb2.StepOptions()
        options.CopyFrom(m.step_options)
        check_step_options(options)
        if options.budget > engine.limits.max_tree_nodes:
            raise InvalidArgument(f"step_options.budget {options.budget} is over this target's limit of "
                                  f"{engine.limits.max_tree_nodes} draft nodes (--max-tree-nodes)")
        mode = options.mode = (options.mode or self.default_mode) if m.HasField("step_options") \
            else common_pb2.DECODE_MODE_AR
        info, why = None, ""
        if mode != common_pb2.DECODE_MODE_AR:
            if self.drafters is None:
                if mode == common_pb2.DECODE_MODE_SPECULATION:
                    raise FailedPrecondition("step mode SPECULATION needs a drafter; start the target with --drafter "
                                             "ADDRESS or ask for mode AR")
                why = "no drafter configured (start the target with --drafter ADDRESS)"
            elif (info := self.drafters.info()) is None:
                why = self.drafters.down_reason() + "; target-only"
            elif layers or drafter:
                raise InvalidArgument("step_options with a drafter of the target's: leave capture_layer_ids and "
                                      "drafter_target unset (the target feeds its own drafter)")
            else:
                layers = list(info.target_layer_ids)
                drafter = (info.target.model, info.target.tokenizer)
        try:
            sid = engine.open_session(layers, drafter, m.protocol_version, m.max_length, owner)
        except FailedPrecondition as e:
            if info is None:
                raise
            why = f"the target refused the drafter ({e.message}); target-only"
            info = None
            sid = engine.open_session([], None, m.protocol_version, m.max_length, owner)
        picked = self.drafters.pick(sid) if info is not None else None
        if info is not None and picked is None:  # its drafter went away between the two looks
            info, why = None, self.drafters.down_reason() + "; target-only"
        if info is not None:
            info = picked.link.info or info
            fingerprint = common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1])
            self._cost_tables(engine)  # builds the tables the chooser prices with, once
            drafting = SessionDrafting.start(sid, options, info, fingerprint, self.chooser, picked.rounds.generation,
                                             self.drafters.several)
            lookup = NgramIndex(info.prompt_lookup.max_ngram) if info.prompt_lookup.min_ngram > 0 else None
            self.served[sid] = ServedSession(drafting=drafting, rounds=picked.rounds, lookup=lookup)
            drafting.encode_rows = functools.partial(capture_to_proto, engine.sessions.get(sid).capture_layers)
        return target_pb2.SessionOpened(
            session_id=sid, max_length=engine.sessions.get(sid).max_length,
            fingerprint=common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1]),
            step_mode=mode if info is not None else common_pb2.DECODE_MODE_AR, fallback_reason=why)

    def prefill(self, m: target_pb2.Prefill, max_capture_bytes: int | None = None) -> target_pb2.Prefilled:
        """The prompt's forward; its captures go to the session's drafter (with the first round) if it has one, else
        to the caller."""
        engine = self.ready_engine()
        out = engine.prefill(m.session_id, prompt_from_proto(m.prompt), sampling_from_proto(m.sampling),
                             max_capture_bytes=max_capture_bytes)
        capture = capture_to_proto(engine.sessions.get(m.session_id).capture_layers, 0, out.captures)
        served = self.served.setdefault(m.session_id, ServedSession())
        served.step_ended = (time.perf_counter(), None, engine.prefill_state()[0])
        if served.lookup is not None:
            served.lookup.extend(out.prompt_tokens)
        drafting = served.drafting
        if drafting is not None:
            drafting.sampling.CopyFrom(m.sampling)
            drafting.append(0, list(out.prompt_tokens), capture)
            capture = None
        return target_pb2.Prefilled(prompt_tokens=out.prompt_tokens, next_token=out.next_token, text=out.text,
                                    capture=capture)

    def rollback(self, session_id: str, length: int) -> target_pb2.RolledBack:
        length, pending = self.ready_engine().rollback(session_id, length)
        if (drafting := self.drafting_of(session_id)) is not None:
            drafting.rollback(length)
            if (lookup := self.served[session_id].lookup) is not None:
                lookup.truncate(min(length, len(lookup)))
        return target_pb2.RolledBack(length=length, pending_token=pending)

    def release(self, session_id: str) -> None:
        self.ready_engine().release(session_id)
        self._stop_drafting(session_id)

    def release_owner(self, owner: object) -> None:
        """Every session of `owner` (its stream or its Generate ended)."""
        if self.engine is not None:
            for sid in self.engine.release_owner(owner):
                self._stop_drafting(sid)

    def cost_tables(self) -> list[common_pb2.CostTable]:
        """The start-up cost tables as the wire carries them (GetModelInfo)."""
        return self._cost_tables(self.ready_engine())[0]

    def step(self, sid: str, tokens_left: int = 0) -> target_pb2.Stepped:
        """One step: the drafter's proposal from a round (unless AR), one verify, the commit; the committed rows'
        captures are queued for the drafter's next round. `tokens_left` (0: no bound) bounds the tokens this step
        and the ones after it can emit."""
        engine = self.ready_engine()
        served = self.served.get(sid)
        drafting = served.drafting if served is not None else None
        if drafting is not None:
            drafting.in_step = True
        try:
            return self._run_step(engine, sid, tokens_left, drafting)
        finally:  # no round asked for: the next one must not wait for this session
            if drafting is not None:
                drafting.in_step = False
            rounds = served.rounds if served is not None else None
            if rounds is not None and (drafting is None or drafting.next is None or drafting.next.reply is None):
                rounds.unexpect(sid)

    def _run_step(self, engine: TargetEngine, sid: str, tokens_left: int,
                  drafting: SessionDrafting | None) -> target_pb2.Stepped:
        """plan -> draft -> verify and commit -> report (and the next step's draft, ahead)."""
        pending, length, max_length = engine.step_state(sid)
        room = max_length - length if not tokens_left else min(max_length - length, tokens_left)
        report = target_pb2.StepReport()
        failed_before = drafting is not None and not drafting.active
        planned = self._plan(engine, drafting, room) if drafting is not None else None
        arm = planned.arm if planned is not None else AR
        try:
            draft = self._draft(sid, drafting, planned, pending, length, room, report) if arm != AR and \
                drafting.active else StepDraft.ar(pending)
            t1 = time.perf_counter()
            out = engine.verify(sid, list(draft.tree.tokens), list(draft.tree.parents), True, False, draft.draft_ids,
                                draft.draft_logprobs)
        finally:
            engine.unexpect_step(sid)
        t2 = time.perf_counter()
        report.verify_seconds = t2 - t1
        committed = out.committed
        assert committed is not None
        path_tokens = [draft.tree.tokens[n] for n in out.path]
        report.draft_depth = tree_depth(draft.tree.parents)
        report.tree_nodes = len(draft.tree.tokens)
        report.accepted_proposers.extend(draft.proposers[n] if n < len(draft.proposers) else 0 for n in out.path[1:])
        report.batch_sessions, report.batch_rows = out.batch.jobs, out.batch.rows
        load = self.chooser.load(len(engine.sessions), t2)
        speculated = arm != AR and (report.draft_seconds > 0 or report.draft_depth > 0)
        self._observe_arm(engine, sid, SPECULATE if speculated else AR, t2, len(out.path), len(draft.tree.tokens),
                          report.draft_seconds)
        if arm != AR:
            self.round_calibration.observe_draft_rows(report.draft_depth)
        if drafting is not None:
            if (lookup := self.served[sid].lookup) is not None:
                lookup.extend(path_tokens)
            if committed.captures is not None and engine.sessions.get(sid).capture_layers:
                drafting.append_rows(committed.start, path_tokens, committed.captures)  # encoded with the next round
            else:
                drafting.append(committed.start, path_tokens, None)
            report.planned_ar = arm == AR and drafting.active and (drafting.chooser is not None or planned.waits_turn)
            if draft.predicted is not None and draft.reply_depth is not None:
                self.round_calibration.observe(draft.predicted, len(out.path) - 1)
            more = committed.length + 1 < max_length and (not tokens_left or len(out.path) + 1 < tokens_left)
            from_chain = drafting.chain_ahead(len(out.path) - 1, out.next_token)  # (the rest is for this step only)
            if self.draft_ahead and drafting.active and more:
                next_room = max_length - committed.length if not tokens_left else \
                    min(max_length - committed.length, tokens_left - len(out.path))
                drafting.next = self._draft_ahead(drafting, out.next_token, committed.length, load, from_chain,
                                                  next_room)
            report.fallback_reason = self._fallback_reasons(drafting, failed_before)
            if self.metrics is not None:
                self.metrics.observe_step(report, planned is not None and (
                    planned.reply is not None or planned.from_chain is not None or planned.from_lookup is not None))
        return target_pb2.Stepped(tokens=path_tokens, next_token=out.next_token, token_texts=committed.token_texts,
                                  length=committed.length, report=report)

    def _plan(self, engine: TargetEngine, drafting: SessionDrafting, room: int) -> NextStep:
        """The step planned (and maybe drafted) when the one before committed, else planned now; with room < 2
        nothing can be drafted: AR (and nothing was drafted ahead for it)."""
        planned, drafting.next = drafting.next, None
        if planned is None:
            planned = self._arm(drafting, self.chooser.load(len(engine.sessions), time.perf_counter())) \
                if room >= 2 else NextStep(AR)
        return planned

    def _arm(self, drafting: SessionDrafting, load: int) -> NextStep:
        """The session's plan (AR or a proposer); beside sessions that step AR, a speculating session drafts only on
        its turns (speculation/round_planner.py)."""
        arm = drafting.plan(load)
        if arm == AR or self.engine is None or not self.engine.cost_tables:
            return NextStep(arm)
        ar, speculating = self._neighbourhood()
        if not ar:
            return NextStep(arm)
        calibration = self.round_calibration
        share = draft_share(ar + speculating, speculating, self._cost_tables(self.engine)[1].seconds,
                            calibration.draft_rows, calibration.round_seconds, self.ar_neighbour_slowdown)
        phase = 0.0
        if drafting.turn_credit is None and share < 1.0:
            phase = next(self._turn_phases) * GOLDEN % 1.0
            drafting.notes.append(f"step {drafting.steps}: drafting on {share:.0%} of its steps while {ar} AR "
                                  f"session(s) share the target's forwards (drafts may make those cost at most "
                                  f"{self.ar_neighbour_slowdown}x)")
        return NextStep(arm) if drafting.takes_turn(share, phase) else NextStep(AR, waits_turn=True)

    def _neighbourhood(self) -> tuple[int, int]:
        """(sessions that step AR, sessions that speculate) among those that stepped in the last
        NEIGHBOURS_MEMORY_S. AR: the request's mode, or no drafter (none configured, or it failed). An adaptive
        session in AR is neither: the adaptive mode weighs its own arms (speculation/mode_chooser.py). Without a
        bound (`ar_neighbour_slowdown` None) no AR session is counted: none is protected."""
        if self.ar_neighbour_slowdown is None:
            return 0, 1
        since, ar, speculating = time.perf_counter() - NEIGHBOURS_MEMORY_S, 0, 0
        for served in list(self.served.values()):
            if served.step_ended is None or served.step_ended[0] < since:
                continue
            d = served.drafting
            if d is None or not d.active:
                ar += 1
            elif d.chooser is None or d.last_arm != AR:
                speculating += 1
        return ar, max(speculating, 1)

    def _draft(self, sid: str, drafting: SessionDrafting, planned: NextStep, pending: int, length: int, room: int,
               report: target_pb2.StepReport) -> StepDraft:
        """This step's proposal, fitted to its room: the rest of the last chain, the round drafted ahead, or a round
        asked for now. A round that fails or a malformed proposal leaves the step AR (the drafter's fault costs
        speed only)."""
        t0 = time.perf_counter()
        if planned.from_chain is None and planned.reply is None:
            planned.from_lookup = self._lookup(sid, drafting, planned.arm, pending, room)
        if planned.from_lookup is not None:  # the drafter's prompt lookup, done here: no round
            report.draft_ready = report.draft_from_lookup = True
            proposal = planned.from_lookup
            self.served[sid].rounds.wait_for_round(NEXT_ROUND_WAIT_S)
            reply_depth = None
        elif planned.from_chain is not None:  # the rest of the last chain: no round
            report.draft_ready = report.draft_from_chain = True
            proposal = planned.from_chain
            # other sessions' round under way: verify with them, not alone beside their drafter pass
            self.served[sid].rounds.wait_for_round(NEXT_ROUND_WAIT_S)
            reply_depth = self._chain_depths([proposal])[0]
        else:
            waits = planned.reply is None or not planned.reply.done()
            if waits and self._neighbourhood()[0]:
                self.ready_engine().step_away(sid)  # AR sessions' forwards do not wait for this round
            if planned.reply is not None:  # drafted ahead
                report.draft_ready = planned.reply.done()
                ops, reply = planned.ops, self.served[sid].rounds.result(planned.reply)
            else:
                ops = drafting.round_ops(pending, length, planned.arm)
                reply = self.served[sid].rounds.submit(RoundJob(drafting, ops))
            proposal = drafting.read_round(ops, reply.replies, pending) if reply.replies is not None else None
            if reply.replies is None:
                self._drafter_failed(drafting, reply.error)
            reply_depth = reply.depth
            report.draft_seconds = time.perf_counter() - t0
            if reply.replies is not None:
                self.round_calibration.observe_round(report.draft_seconds)
            if proposal is not None:
                report.round_seconds, report.round_drafter_seconds = reply.seconds, reply.drafter_seconds
                report.draft_compute_seconds = proposal.compute_seconds
        if proposal is None:
            return StepDraft.ar(pending)
        fitted = drafting.fit(proposal, room, reply_depth)
        try:
            draft_ids, draft_logprobs = check_tree_tensors(fitted.tree)
        except InvalidArgument as e:  # the drafter's fault, not the client's: this step goes AR
            drafting.fail(f"the drafter's proposal is malformed ({e.message})")
            return StepDraft.ar(pending)
        report.draft_batch_sessions = proposal.batch_sessions
        report.truncated = fitted.truncated
        return StepDraft(fitted.tree, fitted.proposers, fitted.predicted_accepted, reply_depth, draft_ids,
                         draft_logprobs)

    def _observe_arm(self, engine: TargetEngine, sid: str, arm: int, ended: float, committed: int, rows: int,
                     draft_seconds: float) -> None:
        """The step's sample for the mode chooser. A session's first step in another arm is a switch, not a sample;
        a step that waited for another session's prompt measures the prompt, not the arm (both arms wait for them
        alike). A sample goes to the sessions live now, not to the chooser's `load` (the most in the last second,
        which decides): the tail of a run, fewer sessions and faster steps, would otherwise raise the rate of
        whichever arm ran it at the load before, and fool the next comparison there."""
        served = self.served.get(sid)
        if served is None or served.step_ended is None:  # released meanwhile, or never prefilled
            return
        started, arm_before, epoch_before = served.step_ended
        epoch, running = engine.prefill_state()
        served.step_ended = (ended, arm, epoch)
        if arm_before in (None, arm) and epoch == epoch_before and not running:
            self.chooser.observe(arm, len(engine.sessions), committed, ended - started, committed - 1, rows,
                                 draft_seconds)

    @staticmethod
    def _fallback_reasons(drafting: SessionDrafting, failed_before: bool) -> str:
        reasons = [drafting.failure] if drafting.failure and not failed_before else []
        reasons.extend(drafting.notes)
        drafting.notes.clear()
        if switches := drafting.new_switches():
            reasons.append(switches)
        return "; ".join(reasons)

    def _drafter_failed(self, drafting: SessionDrafting, why: str) -> None:
        """The session's round did not come back (its drafter went away, stalled, or lost the stream): it re-opens on
        another drafter of the pool with its context, or continues target-only. This step is AR either way."""
        sid = drafting.session_id
        served = self.served[sid]
        last = served.rounds
        other = self.drafters.pick(sid, besides=last) if self.drafters is not None else None
        if other is not None and drafting.reopen(why, other.address):
            last.unexpect(sid)
            served.rounds = other.rounds
        else:
            drafting.fail(why)

    def _draft_ahead(self, drafting: SessionDrafting, anchor: int, position: int, load: int,
                     from_chain: draft_pb2.Proposal | None, room: int) -> NextStep:
        """Plan the session's next step now and, if it drafts, take `from_chain` (the rest of the chain just
        verified, where it still holds: no round) or ask for its proposal at once: the drafter works while the
        reply travels to the client and its next Step comes back."""
        planned = self._arm(drafting, load)
        if planned.arm == AR:
            return planned
        arm = planned.arm
        if from_chain is not None:
            return NextStep(arm, from_chain=from_chain)
        if (from_lookup := self._lookup(drafting.session_id, drafting, arm, anchor, room)) is not None:
            return NextStep(arm, from_lookup=from_lookup)
        ops = drafting.round_ops(anchor, position, arm)
        rounds = self.served[drafting.session_id].rounds
        return NextStep(arm, ops, rounds.submit_ahead(RoundJob(drafting, ops, verify_follows=False)))


    def _lookup(self, sid: str, drafting: SessionDrafting, arm: int, anchor: int, room: int
                ) -> draft_pb2.Proposal | None:
        """The drafter's prompt-lookup chain for this step, found here in the session's committed tokens with the
        drafter's own settings (GetDrafterInfoResponse.prompt_lookup: the same candidates its proposer finds), when
        that is what the drafter would answer: the ngram proposer's chain, or the hybrid's from its minimum match on
        (below it the hybrid drafts the DSpark chain). None otherwise: the step asks the drafter."""
        lookup, settings = self.served[sid].lookup, drafting.info.prompt_lookup
        kind = drafting.options.proposal or draft_pb2.PROPOSAL_KIND_CHAIN
        if lookup is None or room < 2 or kind != draft_pb2.PROPOSAL_KIND_CHAIN or \
                arm not in (draft_pb2.PROPOSER_NGRAM, draft_pb2.PROPOSER_HYBRID):
            return None
        budget = drafting.options.budget or settings.chain_tokens
        if budget < 1 or budget > drafting.info.max_tree_budget:  # the drafter's refusal is its to give
            return None
        candidates = anchored_candidates(lookup, anchor, settings.min_ngram, budget)
        least = settings.hybrid_min_match if arm == draft_pb2.PROPOSER_HYBRID else settings.min_ngram
        if not candidates or candidates[0].match_length < least:
            return None
        tree = ngram_tree(anchor, candidates[:1], budget)
        return draft_pb2.Proposal(tree=common_pb2.TokenTree(tokens=tree.tokens, parents=tree.parents),
                                  node_proposers=[0, *[draft_pb2.PROPOSER_NGRAM] * (len(tree.tokens) - 1)])

    # -- rounds --------------------------------------------------------------------------------------

    def _stop_drafting(self, session_id: str) -> None:
        served = self.served.pop(session_id, None)
        if served is None or served.drafting is None or served.rounds is None:
            return
        drafting, rounds = served.drafting, served.rounds
        rounds.unexpect(session_id)
        if (op := drafting.finish()) is not None:
            rounds.release(drafting, op, after=drafting.next.reply if drafting.next is not None else None)

    def _cost_tables(self, engine: TargetEngine) -> tuple[list[common_pb2.CostTable], VerifyCosts]:
        """The engine's start-up cost tables as the wire carries them and as the planners read them (built once per
        list of tables, not per round)."""
        if self._costs is None or self._costs[0] is not engine.cost_tables:
            tables = [t.to_proto() for t in engine.cost_tables]
            self._costs = (engine.cost_tables, tables, VerifyCosts(tables))
            self.chooser.costs = self._costs[2] if tables else None
        return self._costs[1], self._costs[2]

    def _plan_round(self, jobs: list[RoundJob], replies: list[RoundReply]) -> None:
        """Cut the round's confident chains together (speculation/round_planner.py), from the start-up cost tables."""
        drafted = [(reply, reply.replies[-1].proposal) for job, reply in zip(jobs, replies, strict=True)
                   if reply.replies is not None and job.ops and job.ops[-1].WhichOneof("op") == "propose"
                   and not reply.replies[-1].status.code]
        for (reply, _), depth in zip(drafted, self._chain_depths([p for _, p in drafted]), strict=True):
            reply.depth = depth

    def _chain_depths(self, proposals: list[draft_pb2.Proposal]) -> list[int | None]:
        """How much of each confident chain to verify when they verify in one forward (None: not a chain with
        confidences); a session that drafted verifies at least one token."""
        chains = [chain_confidences(p.tree, p.confidences) for p in proposals]
        values = [v for v in chains if v is not None]
        if not values or self.engine is None or not self.engine.cost_tables:
            return [None] * len(proposals)
        seconds = self._cost_tables(self.engine)[1].seconds
        ar, speculating = self._neighbourhood()
        lanes = max(ar + speculating, len(values))  # beside AR sessions: the draft rows capped, none required
        depths = iter(plan_depths(values, [0 if ar else 1] * len(values), self.round_calibration.value, seconds,
                                  self.round_calibration.round_seconds, besides=lanes - len(values) if ar else 0,
                                  max_draft_rows=rows_beside(lanes, seconds, self.ar_neighbour_slowdown) if ar
                                  else None))
        return [None if v is None else next(depths) for v in chains]

    def _round_drafted(self, session_ids: list[str]) -> None:
        if self.engine is not None:
            self.engine.expect_steps(session_ids)

