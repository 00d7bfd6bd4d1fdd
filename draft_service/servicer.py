"""dspark.v1.DraftService: protobuf <-> DraftEngine. Validation and translation only."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from dspark_grpc.draft_service.engine import PROTOCOL_VERSION, DraftEngine
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from dspark_grpc.runtime.drafting.sampling import make_generator
from dspark_grpc.serving.security import principal_of
from dspark_grpc.serving.server import check_enum, run_session_op, session_stream
from dspark_grpc.serving.session_socket import SessionSocketServer
from dspark_grpc.serving.tensor_codec import from_proto, to_proto
from dspark_grpc.speculation.errors import InvalidArgument, ServiceError, Unavailable
from dspark_grpc.speculation.wire import KERNEL_NAMES, PROPOSER_NAMES, PROPOSERS

_SLOTS = {"dspark": draft_pb2.SLOT_CONVENTION_DSPARK, "dflash": draft_pb2.SLOT_CONVENTION_DFLASH}
INLINE_MAX_ROWS = 64  # new context rows a round handled on the event loop may bring (see DraftServicer._inline)


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, max_message_bytes: int, executor: ThreadPoolExecutor | None = None,
                 max_sessions: int = 16) -> None:
        self.engine: DraftEngine | None = None  # set once the drafter is loaded
        self.max_message_bytes = max_message_bytes
        # a thread per live session (each may wait for its shared drafter pass) and a few for quick operations
        self.executor = executor or ThreadPoolExecutor(max_workers=max_sessions + 4, thread_name_prefix="draft")
        # the proposals of DraftRounds, each in its own thread so that their drafter passes run as one
        self.round_executor = ThreadPoolExecutor(max_workers=max_sessions, thread_name_prefix="draft-round")
        self._running = 0  # operations under way (`handle` calls)
        self._lock = threading.Lock()
        self.session_socket: SessionSocketServer | None = None  # the DraftSession stream on a Unix socket too

    def ready_engine(self) -> DraftEngine:
        if self.engine is None:
            raise Unavailable("the drafter is still loading; retry when health reports SERVING")
        return self.engine

    async def GetDrafterInfo(self, request, context):
        try:
            engine = self.ready_engine()
        except ServiceError as e:
            await context.abort(e.status, e.message)
        c = engine.config
        info = draft_pb2.GetDrafterInfoResponse(
            name=engine.name, vocab_size=engine.vocab_size, protocol_version=PROTOCOL_VERSION,
            target=common_pb2.Fingerprint(model=engine.target_fingerprint[0], tokenizer=engine.target_fingerprint[1]),
            proposers=[PROPOSERS[p] for p in engine.proposers], default_proposer=PROPOSERS[engine.default_proposer],
            max_sessions=engine.limits.max_sessions, max_tree_budget=engine.limits.max_tree_budget,
            max_message_bytes=self.max_message_bytes, live_sessions=len(engine.sessions),
            session_socket=self.session_socket.address if self.session_socket is not None else "",
            prompt_lookup=draft_pb2.PromptLookupSettings(
                min_ngram=engine.limits.ngram_min, max_ngram=engine.limits.ngram_max,
                chain_tokens=engine.limits.ngram_chain, hybrid_min_match=engine.limits.hybrid_min_match))
        if c is not None:  # a DSpark drafter (prompt lookup alone needs no features)
            info.MergeFrom(draft_pb2.GetDrafterInfoResponse(
                block_size=c.block_size, target_layer_ids=c.target_layer_ids, mask_token_id=c.mask_token_id,
                slot_convention=_SLOTS[c.slot_convention], markov_rank=c.markov_rank,
                has_confidence_head=engine.drafter.confidence is not None))
        return info

    async def DraftSession(self, request_iterator, context):
        async for response in session_stream(request_iterator, self.handle, self.executor, self.release_owner,
                                             principal_of(context), inline=self._inline):
            yield response

    def _inline(self, request: draft_pb2.DraftSessionRequest) -> bool:
        """A decode round (at most one proposal, a few new context rows), while no other operation runs, on a
        drafter on one torch thread: on the event loop (its drafter pass then runs there too; a few milliseconds in
        which other streams wait, never a prompt's projection)."""
        engine = self.engine
        if engine is None or self._running or not engine.one_thread() or request.WhichOneof("op") != "round":
            return False
        ops = [o.WhichOneof("op") for o in request.round.ops]
        rows = sum(len(o.append.tokens) for o, kind in zip(request.round.ops, ops, strict=True) if kind == "append")
        return ops.count("propose") <= 1 and rows <= INLINE_MAX_ROWS

    def release_owner(self, owner: object) -> None:
        if self.engine is not None:
            self.engine.release_owner(owner)

    def handle(self, request: draft_pb2.DraftSessionRequest, owner: object) -> draft_pb2.DraftSessionResponse:
        with self._lock:
            self._running += 1
        try:
            return run_session_op(self._dispatch, request, owner, draft_pb2.DraftSessionResponse)
        finally:
            with self._lock:
                self._running -= 1

    def _dispatch(self, request: draft_pb2.DraftSessionRequest, owner: object) -> dict:
        engine = self.ready_engine()
        op = request.WhichOneof("op")
        if op == "round":
            return dict(round=self._round(engine, request.round, owner))
        if op not in (None, "open"):  # a session belongs to the stream that opened it
            engine.sessions.get(getattr(request, op).session_id, owner)
        if op == "open":
            m = request.open
            target = (m.target.model, m.target.tokenizer) if m.HasField("target") else None
            sid = engine.open_session(target, m.protocol_version, owner, m.session_id)
            layers = engine.config.target_layer_ids if engine.config is not None else ()
            return dict(opened=draft_pb2.DraftOpened(session_id=sid, target_layer_ids=layers))
        if op == "append":
            m = request.append
            capture = None
            if m.HasField("capture") and m.capture.layer_ids:
                if m.capture.start_position != m.start_position:
                    raise InvalidArgument(f"capture.start_position {m.capture.start_position} differs from "
                                          f"start_position {m.start_position}")
                capture = from_proto(m.capture.rows, "append.capture.rows")
            layers = list(m.capture.layer_ids)
            length = engine.append(m.session_id, m.start_position, list(m.tokens), layers, capture)
            return dict(appended=draft_pb2.ContextAppended(length=length))
        if op == "propose":
            m = request.propose
            check_enum(draft_pb2.ProposalKind, m.kind, "propose.kind")
            check_enum(draft_pb2.Proposer, m.proposer, "propose.proposer")
            check_enum(draft_pb2.KernelChoice, m.kernel, "propose.kernel")
            tree = m.kind == draft_pb2.PROPOSAL_KIND_TREE
            generator = make_generator(m.sampling.seed) if m.sampling.HasField("seed") else None
            out = engine.propose(m.session_id, m.anchor_token, m.anchor_position, tree=tree, budget=m.budget,
                                 kernel=KERNEL_NAMES.get(m.kernel, ""), temperature=m.sampling.temperature,
                                 generator=generator, proposer=PROPOSER_NAMES[m.proposer])
            tree_msg = common_pb2.TokenTree(tokens=out.tokens, parents=out.parents)
            if out.draft_ids is not None:  # row k-1 = the distribution node k was drawn from; the last row is unused
                pad_ids = torch.full((1, out.draft_ids.shape[1]), -1, dtype=torch.int32)
                pad_lps = torch.full((1, out.draft_ids.shape[1]), float("-inf"))
                tree_msg.child_token_ids.CopyFrom(to_proto(torch.cat([out.draft_ids.to(torch.int32), pad_ids])))
                tree_msg.child_logprobs.CopyFrom(to_proto(torch.cat([out.draft_logprobs.float(), pad_lps])))
            return dict(proposal=draft_pb2.Proposal(
                tree=tree_msg, confidences=to_proto(out.confidences.float()) if out.confidences is not None else None,
                node_proposers=[PROPOSERS[x] for x in out.sources],
                compute_seconds=out.compute_seconds, batch_sessions=out.batch_sessions))
        if op == "truncate":
            length = engine.truncate(request.truncate.session_id, request.truncate.length)
            return dict(truncated=draft_pb2.ContextTruncated(length=length))
        if op == "release":
            engine.release(request.release.session_id)
            return dict(released=draft_pb2.DraftReleased())
        raise InvalidArgument("empty request: set one of open, append, propose, truncate, release, round")

    def _round(self, engine: DraftEngine, m: draft_pb2.DraftRound, owner: object) -> draft_pb2.DraftRoundResult:
        """Every op but the proposals first, in order; then the proposals, together (one drafter pass)."""
        t0 = time.perf_counter()
        if any(o.WhichOneof("op") == "round" for o in m.ops):
            raise InvalidArgument("a round may not hold another round")
        results: list[draft_pb2.DraftSessionResponse | None] = [None] * len(m.ops)
        proposals = [i for i, o in enumerate(m.ops) if o.WhichOneof("op") == "propose"]
        for i, o in enumerate(m.ops):
            if results[i] is None and i not in proposals:
                results[i] = self.handle(o, owner)
        engine.expect_proposals([m.ops[i].propose.session_id for i in proposals], owner)

        def propose(op: draft_pb2.DraftSessionRequest) -> draft_pb2.DraftSessionResponse:
            try:
                return self.handle(op, owner)
            finally:  # refused before its pass (a bad field): the round's pass must not wait for it
                engine.proposal_done(op.propose.session_id, owner)

        if len(proposals) == 1:  # nothing to share a pass with: no thread hand-off
            results[proposals[0]] = propose(m.ops[proposals[0]])
        else:
            futures = {i: self.round_executor.submit(propose, m.ops[i]) for i in proposals}
            for i, future in futures.items():
                results[i] = future.result()
        return draft_pb2.DraftRoundResult(results=results, handle_seconds=time.perf_counter() - t0)
