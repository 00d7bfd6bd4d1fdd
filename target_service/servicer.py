"""dspark.v1.TargetService: protobuf <-> TargetEngine. Validation and translation only."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.runtime.drafting.sampling import SamplingParams
from dspark_grpc.serving.security import principal_of
from dspark_grpc.serving.server import check_enum, log_refusal, run_session_op, session_stream, status_code
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.serving.tensor_codec import from_proto, proto_dtype, rows_to_proto, to_proto
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel
from dspark_grpc.speculation.cost_table import VerifyCosts
from dspark_grpc.speculation.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from dspark_grpc.speculation.generation import GenerationConfig, RequestError, generate_deltas
from dspark_grpc.speculation.mode_chooser import AR, SPECULATE, ModeChooser
from dspark_grpc.speculation.round_planner import RoundCalibration, plan_depths
from dspark_grpc.speculation.steps import NextStep, SessionDrafting, chain_confidences, tree_depth
from dspark_grpc.target_service.draft_rounds import NEXT_ROUND_WAIT_S, DraftRounds, RoundJob, RoundReply
from dspark_grpc.target_service.drafter_link import DrafterLink
from dspark_grpc.target_service.drafter_pool import Drafter, DrafterPool
from dspark_grpc.target_service.engine import PROTOCOL_VERSION, Committed, Prompt, TargetEngine

DEFAULT_MAX_NEW_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # each; the stop-string check runs per token over the held-back text
ADMISSION_POLL_S = 0.25  # a Generate waiting for a session looks again this often (its end, idle sessions' eviction)


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


def check_stop(stop) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    long = [len(x) for x in stop if len(x) > MAX_STOP_CHARS]
    if long:
        raise InvalidArgument(f"a stop string has {long[0]} characters; at most {MAX_STOP_CHARS} each")


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


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, max_message_bytes: int, drafter_address: str | None = None,
                 default_mode: int = common_pb2.DECODE_MODE_ADAPTIVE, draft_timeout: float = 10.0,
                 executor: ThreadPoolExecutor | None = None, max_sessions: int = 16,
                 drafter_security: ChannelSecurity | None = None, draft_ahead: bool = True) -> None:
        self.engine: TargetEngine | None = None  # set once the model is loaded
        self.max_message_bytes = max_message_bytes
        # what a reply may carry in captures or logits, leaving room for its other fields
        self.max_reply_bytes = max_message_bytes - min(1 << 20, max_message_bytes // 8)
        # Callers wait in these threads while their step runs in a batched forward: enough for every session.
        self.executor = executor or ThreadPoolExecutor(max_workers=max(8, max_sessions + 4),
                                                       thread_name_prefix="target")
        self.drafter_address = drafter_address

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
        self.served: dict[str, ServedSession] = {}  # what the servicer keeps of a session, by id
        self.round_calibration = RoundCalibration()
        self._costs: tuple[list, list[common_pb2.CostTable], VerifyCosts] | None = None  # see _cost_tables
        # draft ahead: a session's next proposal is asked for as soon as its step commits
        self.draft_ahead = draft_ahead
        self.default_mode = default_mode
        self.metrics = None  # a SpecDecodeMetrics when the service exports Prometheus metrics
        # adaptive mode: speculate or AR, per load (its cost table set at load); it learns from every session's
        # steps, whatever its mode: an AR session's step is a sample of AR as much as an adaptive one's
        self.chooser = ModeChooser()

    def _drafting(self, session_id: str) -> SessionDrafting | None:
        served = self.served.get(session_id)
        return served.drafting if served is not None else None

    def ready_engine(self) -> TargetEngine:
        if self.engine is None:
            raise Unavailable("the target model is still loading; retry when health reports SERVING")
        return self.engine

    # -- unary ------------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        try:
            engine = self.ready_engine()
        except ServiceError as e:
            await context.abort(e.status, e.message)
        cfg = engine.model.config
        return target_pb2.GetModelInfoResponse(
            model_name=engine.name, architecture=cfg.architecture, num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, max_context_length=engine.max_length,
            compute_dtype=proto_dtype(engine.model.dtype), device=str(engine.model.device),
            fingerprint=common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1]),
            protocol_version=PROTOCOL_VERSION, eos_token_ids=sorted(engine.tokenizer.eos_token_ids),
            max_sessions=engine.limits.max_sessions, max_tree_nodes=engine.limits.max_tree_nodes,
            max_message_bytes=self.max_message_bytes, speculation_available=self.drafter_address is not None,
            default_mode=self.default_mode, verify_costs=self._cost_tables(engine)[0],
            live_sessions=len(engine.sessions))

    # -- session stream -----------------------------------------------------------------------------

    async def TargetSession(self, request_iterator, context):
        async for response in session_stream(request_iterator, self.handle, self.executor, self._release_owner,
                                             principal_of(context)):
            yield response

    def _release_owner(self, owner: object) -> None:
        if self.engine is not None:
            for sid in self.engine.release_owner(owner):
                self._stop_drafting(sid)

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
        depths = iter(plan_depths(values, [1] * len(values), self.round_calibration.value,
                                  self._cost_tables(self.engine)[1].seconds, self.round_calibration.round_seconds))
        return [None if v is None else next(depths) for v in chains]

    def _round_drafted(self, session_ids: list[str]) -> None:
        if self.engine is not None:
            self.engine.expect_steps(session_ids)

    def handle(self, request: target_pb2.TargetSessionRequest, owner: object) -> target_pb2.TargetSessionResponse:
        return run_session_op(self._dispatch, request, owner, target_pb2.TargetSessionResponse)

    def _dispatch(self, request: target_pb2.TargetSessionRequest, owner: object) -> dict:
        engine = self.ready_engine()
        op = request.WhichOneof("op")
        if op not in (None, "open"):  # a session belongs to the stream that opened it
            engine.sessions.get(getattr(request, op).session_id, owner)
        if op == "open":
            return dict(opened=self._open(engine, request.open, owner))
        if op == "prefill":
            m = request.prefill
            out = engine.prefill(m.session_id, prompt_from_proto(m.prompt), sampling_from_proto(m.sampling),
                                 max_capture_bytes=self.max_reply_bytes)
            capture = capture_to_proto(engine.sessions.get(m.session_id).capture_layers, 0, out.captures)
            served = self.served.setdefault(m.session_id, ServedSession())
            served.step_ended = (time.perf_counter(), None, engine.prefill_state()[0])
            drafting = served.drafting
            if drafting is not None:  # the captures go to the drafter (with the first round), not to the client
                drafting.sampling.CopyFrom(m.sampling)
                drafting.append(0, list(out.prompt_tokens), capture)
                capture = None
            return dict(prefilled=target_pb2.Prefilled(
                prompt_tokens=out.prompt_tokens, next_token=out.next_token, text=out.text, capture=capture))
        if op == "step":
            if request.step.tokens_left < 0:
                raise InvalidArgument(f"step.tokens_left must be >= 0 (0 = no bound), got {request.step.tokens_left}")
            return dict(stepped=self._step(engine, request.step.session_id, request.step.tokens_left))
        if op in ("verify", "commit") and self._drafting(getattr(request, op).session_id) is not None:
            raise FailedPrecondition(f"this session steps with the target's drafter (OpenSession.step_options): "
                                     f"send Step, not {op}; open a session without step_options to verify trees of "
                                     "your own")
        if op == "verify":
            m = request.verify
            if not m.HasField("tree"):
                raise InvalidArgument("verify.tree is missing")
            draft_ids, draft_logprobs = _check_tree_tensors(m.tree)
            check_enum(target_pb2.LogitsReturn, m.return_logits, "verify.return_logits")
            want_logits = m.return_logits == target_pb2.LOGITS_RETURN_ALL
            logit_bytes = len(m.tree.tokens) * engine.model.config.vocab_size * 4
            if want_logits and logit_bytes > self.max_reply_bytes:
                raise ResourceExhausted(f"the logits of {len(m.tree.tokens)} nodes are {logit_bytes} bytes, over this "
                                        f"service's reply limit of {self.max_reply_bytes} (--max-message-bytes "
                                        f"{self.max_message_bytes}); verify fewer nodes or without logits")
            t0 = time.perf_counter()
            out = engine.verify(m.session_id, list(m.tree.tokens), list(m.tree.parents), m.commit, want_logits,
                                draft_ids, draft_logprobs, max_capture_bytes=self.max_reply_bytes)
            fields = dict(accepted_path=out.path, next_token=out.next_token, committed=out.committed is not None,
                          compute_seconds=time.perf_counter() - t0, batch_sessions=out.batch.jobs,
                          batch_rows=out.batch.rows,
                          logits=to_proto(out.logits) if out.logits is not None else None)
            if out.committed is not None:
                fields.update(committed_fields(engine.sessions.get(m.session_id).capture_layers, out.committed))
            return dict(verified=target_pb2.Verified(**fields))
        if op == "commit":
            m = request.commit
            out = engine.commit(m.session_id, list(m.path), m.next_token)
            layers = engine.sessions.get(m.session_id).capture_layers
            return dict(committed=target_pb2.Committed(**committed_fields(layers, out)))
        if op == "rollback":
            length, pending = engine.rollback(request.rollback.session_id, request.rollback.length)
            if (drafting := self._drafting(request.rollback.session_id)) is not None:
                drafting.rollback(length)
            return dict(rolled_back=target_pb2.RolledBack(length=length, pending_token=pending))
        if op == "release":
            engine.release(request.release.session_id)
            self._stop_drafting(request.release.session_id)
            return dict(released=target_pb2.SessionReleased())
        raise InvalidArgument("empty request: set one of open, prefill, verify, commit, rollback, release, step")

    def _open(self, engine: TargetEngine, m: target_pb2.OpenSession, owner: object) -> target_pb2.SessionOpened:
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
            self.served[sid] = ServedSession(drafting=drafting, rounds=picked.rounds)
            drafting.encode_rows = functools.partial(capture_to_proto, engine.sessions.get(sid).capture_layers)
        return target_pb2.SessionOpened(
            session_id=sid, max_length=engine.sessions.get(sid).max_length,
            fingerprint=common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1]),
            step_mode=mode if info is not None else common_pb2.DECODE_MODE_AR, fallback_reason=why)

    def _step(self, engine: TargetEngine, sid: str, tokens_left: int = 0) -> target_pb2.Stepped:
        """One step: the drafter's proposal from a round (unless AR), one verify, the commit; the committed rows'
        captures are queued for the drafter's next round. `tokens_left` (0: no bound) bounds the tokens this step
        and the ones after it can emit."""
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
        if drafting is not None:
            if committed.captures is not None and engine.sessions.get(sid).capture_layers:
                drafting.append_rows(committed.start, path_tokens, committed.captures)  # encoded with the next round
            else:
                drafting.append(committed.start, path_tokens, None)
            report.planned_ar = arm == AR and drafting.chooser is not None and drafting.active
            if draft.predicted is not None and draft.reply_depth is not None:
                self.round_calibration.observe(draft.predicted, len(out.path) - 1)
            more = committed.length + 1 < max_length and (not tokens_left or len(out.path) + 1 < tokens_left)
            from_chain = drafting.chain_ahead(len(out.path) - 1, out.next_token)  # (the rest is for this step only)
            if self.draft_ahead and drafting.active and more:
                drafting.next = self._draft_ahead(drafting, out.next_token, committed.length, load, from_chain)
            report.fallback_reason = self._fallback_reasons(drafting, failed_before)
            if self.metrics is not None:
                self.metrics.observe_step(report, planned is not None and (planned.reply is not None
                                                                           or planned.from_chain is not None))
        return target_pb2.Stepped(tokens=path_tokens, next_token=out.next_token, token_texts=committed.token_texts,
                                  length=committed.length, report=report)

    def _plan(self, engine: TargetEngine, drafting: SessionDrafting, room: int) -> NextStep:
        """The step planned (and maybe drafted) when the one before committed, else planned now; with room < 2
        nothing can be drafted: AR (and nothing was drafted ahead for it)."""
        planned, drafting.next = drafting.next, None
        if planned is None:
            planned = NextStep(drafting.plan(self.chooser.load(len(engine.sessions), time.perf_counter()))
                               if room >= 2 else AR)
        return planned

    def _draft(self, sid: str, drafting: SessionDrafting, planned: NextStep, pending: int, length: int, room: int,
               report: target_pb2.StepReport) -> StepDraft:
        """This step's proposal, fitted to its room: the rest of the last chain, the round drafted ahead, or a round
        asked for now. A round that fails or a malformed proposal leaves the step AR (the drafter's fault costs
        speed only)."""
        t0 = time.perf_counter()
        if planned.from_chain is not None:  # the rest of the last chain: no round
            report.draft_ready = report.draft_from_chain = True
            proposal = planned.from_chain
            # other sessions' round under way: verify with them, not alone beside their drafter pass
            self.served[sid].rounds.wait_for_round(NEXT_ROUND_WAIT_S)
            reply_depth = self._chain_depths([proposal])[0]
        else:
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
            draft_ids, draft_logprobs = _check_tree_tensors(fitted.tree)
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
        reasons.extend(drafting.moved)
        drafting.moved.clear()
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
                     from_chain: draft_pb2.Proposal | None) -> NextStep:
        """Plan the session's next step now and, if it drafts, take `from_chain` (the rest of the chain just
        verified, where it still holds: no round) or ask for its proposal at once: the drafter works while the
        reply travels to the client and its next Step comes back."""
        arm = drafting.plan(load)
        if arm == AR:
            return NextStep(AR)
        if from_chain is not None:
            return NextStep(arm, from_chain=from_chain)
        ops = drafting.round_ops(anchor, position, arm)
        rounds = self.served[drafting.session_id].rounds
        return NextStep(arm, ops, rounds.submit_ahead(RoundJob(drafting, ops, verify_follows=False)))

    # -- single-call generation ---------------------------------------------------------------------

    async def Generate(self, request, context):
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        replies = self.generation_stream(request, principal_of(context), deadline)
        try:
            async for reply in replies:
                yield reply
        except ServiceError as e:
            await context.abort(e.status, e.message)
        finally:
            await replies.aclose()

    async def generation_stream(self, request: target_pb2.GenerateRequest, principal: str, deadline: float | None,
                                what: str = "Generate"):
        """The Generate RPC's replies, for the gRPC handler and the HTTP front alike (one decoding path): a bad
        request raises ServiceError before the first reply, a failure later (the session's ops, the deadline, given
        as time.monotonic()) raises ServiceError with its status. Closing the generator early (a cancelled call)
        stops the steps and frees the session. `what` names the caller in the log line of a refused request."""
        options = target_pb2.StepOptions(mode=request.mode, proposal=request.proposal, budget=request.budget,
                                         kernel=request.kernel, proposer=request.proposer)
        try:  # the fields Generate adds; the rest are checked where the session's open and prefill take them
            engine = self.ready_engine()
            check_stop(request.stop)
            if request.HasField("max_new_tokens") and request.max_new_tokens < 1:
                raise InvalidArgument(f"max_new_tokens must be >= 1 (leave it unset for {DEFAULT_MAX_NEW_TOKENS}), "
                                      f"got {request.max_new_tokens}")
        except ServiceError as e:
            log_refusal(what, e)
            raise
        max_new_tokens = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
        config = GenerationConfig(max_new_tokens=max_new_tokens,
                                  sampling=request.sampling, stop=list(request.stop), ignore_eos=request.ignore_eos)
        stats = common_pb2.GenerationStats()
        owner = Owner(principal)
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        deltas = generate_deltas(_InProcessTarget(self, owner, deadline, stop), request.prompt, config,
                                 frozenset(engine.tokenizer.eos_token_ids), stats, options)
        produced: asyncio.Queue = asyncio.Queue()
        # One thread runs the steps back to back: the next step starts while this loop sends the last one's tokens.
        ended = loop.create_future()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(produced.put_nowait, item)
                if item is None:
                    loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(None))
            except RuntimeError:  # the loop is closed (the server stopped): nobody reads any more
                pass

        threading.Thread(target=_run_steps, args=(deltas, deadline, stop, put), name="generate", daemon=True).start()
        try:
            while (item := await produced.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason and self.metrics is not None:
                    self.metrics.observe(stats)
                yield target_pb2.GenerateResponse(
                    text=item.text, token_ids=item.token_ids, finish_reason=item.finish_reason,
                    stats=stats if item.finish_reason else None)
        except _DeadlineExceeded:
            raise DeadlineExceeded("deadline exceeded during generation") from None
        except RequestError as e:
            raise _with_status(status_code(e.code), e.message) from None
        finally:
            stop.set()  # cancelled or done: no further step; the one under way ends before the session is freed
            try:
                await asyncio.shield(ended)
            except BaseException:  # noqa: BLE001 - cancelled again while waiting: the thread still frees the session
                pass
            self._release_owner(owner)


def _with_status(status: grpc.StatusCode, message: str) -> ServiceError:
    """A ServiceError with any status (a session op's, passed on as it came)."""
    error = ServiceError(message)
    error.status = status
    return error


class _DeadlineExceeded(Exception):
    pass


def _run_steps(deltas, deadline: float | None, stop: threading.Event, put) -> None:
    """Runs the generation to its end (or until `stop`, or past `deadline`), handing each delta to `put`, then None.
    An error is handed over as the last item."""
    try:
        for delta in deltas:
            put(delta)
            if delta.finish_reason or stop.is_set():
                break
            if deadline is not None and time.monotonic() >= deadline:
                put(_DeadlineExceeded())
                break
    except BaseException as e:  # noqa: BLE001 - re-raised by the RPC's loop
        put(e)
    finally:
        deltas.close()
        put(None)


def _check_tree_tensors(tree: common_pb2.TokenTree) -> tuple[torch.Tensor | None, torch.Tensor | None]:
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


class _InProcessTarget:
    """The target of a Generate's steps: its servicer's own session ops. A Generate whose session cannot open now
    (every session taken, or its client holding its share) waits for one to be freed, until its deadline or its
    end, as a request queued for a server's capacity does, rather than failing at once."""

    def __init__(self, servicer: TargetServicer, owner: object, deadline: float | None = None,
                 stop: threading.Event | None = None) -> None:
        self.servicer, self.owner, self.deadline, self.stop = servicer, owner, deadline, stop

    def call(self, request: target_pb2.TargetSessionRequest) -> target_pb2.TargetSessionResponse:
        while True:
            sessions = self.servicer.ready_engine().sessions if self.servicer.engine is not None else None
            seen = sessions.freed if sessions is not None else 0
            response = self.servicer.handle(request, self.owner)
            if sessions is None or request.WhichOneof("op") != "open" or \
                    response.status.code != grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                return response
            wait = ADMISSION_POLL_S if self.deadline is None else min(ADMISSION_POLL_S,
                                                                      self.deadline - time.monotonic())
            if wait <= 0 or (self.stop is not None and self.stop.is_set()):
                return response
            sessions.wait_freed(seen, wait)  # (in slices: an idle session is evicted only when someone looks)
