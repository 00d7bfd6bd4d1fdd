"""dspark.v1.TargetService: protobuf <-> TargetEngine. Validation and translation only."""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from dspark_grpc.client.generation import GenerationConfig, RequestError, generate_deltas
from dspark_grpc.client.planner import PlannerMemory
from dspark_grpc.client.sdk import make_channel, open_speculation
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dspark_grpc.runtime.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from dspark_grpc.runtime.sampling import SamplingParams
from dspark_grpc.runtime.serving import run_session_op, session_stream, status_code
from dspark_grpc.runtime.tensor_codec import from_proto, proto_dtype, to_proto
from dspark_grpc.target_service.engine import PROTOCOL_VERSION, Committed, Prompt, TargetEngine

DEFAULT_MAX_NEW_TOKENS = 128


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    try:
        return SamplingParams(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                              seed=msg.seed if msg.HasField("seed") else None)
    except ValueError as e:
        raise InvalidArgument(f"sampling: {e}") from e


def prompt_from_proto(msg: common_pb2.Prompt) -> Prompt:
    kind = msg.WhichOneof("kind")
    if kind == "text":
        return msg.text
    if kind == "chat":
        if not msg.chat.messages:
            raise InvalidArgument("prompt.chat has no messages")
        return [{"role": m.role, "content": m.content} for m in msg.chat.messages]
    if kind == "tokens":
        return list(msg.tokens.ids)
    raise InvalidArgument("the prompt is missing: set prompt.text, prompt.chat or prompt.tokens")


def capture_to_proto(layers: tuple[int, ...], start: int, rows: torch.Tensor | None) -> common_pb2.HiddenCapture | None:
    if rows is None or not layers:
        return None
    assert rows.dim() == 3 and rows.shape[1] == len(layers)
    return common_pb2.HiddenCapture(layer_ids=layers, start_position=start, rows=to_proto(rows.to(torch.bfloat16)))


def committed_fields(s_layers: tuple[int, ...], c: Committed) -> dict:
    return dict(capture=capture_to_proto(s_layers, c.start, c.captures), token_texts=c.token_texts, length=c.length)


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, max_message_bytes: int, drafter_address: str | None = None,
                 default_mode: int = common_pb2.DECODE_MODE_ADAPTIVE, draft_timeout: float = 10.0,
                 executor: ThreadPoolExecutor | None = None, max_sessions: int = 16) -> None:
        self.engine: TargetEngine | None = None  # set once the model is loaded
        self.max_message_bytes = max_message_bytes
        # Callers wait in these threads while their step runs in a batched forward: enough for every session.
        self.executor = executor or ThreadPoolExecutor(max_workers=max(8, max_sessions + 4),
                                                       thread_name_prefix="target")
        self.drafter_address = drafter_address
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(make_channel(drafter_address)) if drafter_address else None
        self.default_mode = default_mode
        self.draft_timeout = draft_timeout
        self.metrics = None  # a SpecDecodeMetrics when the service exports Prometheus metrics
        self.planner_memory = PlannerMemory()  # the adaptive planner's estimates, across Generate requests

    def ready_engine(self) -> TargetEngine:
        if self.engine is None:
            raise Unavailable("the target model is still loading; retry when health reports SERVING")
        return self.engine

    # -- unary ------------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context):
        try:
            engine = self.ready_engine()
        except ServiceError as e:
            await context.abort(grpc.StatusCode[e.code_name], e.message)
        cfg = engine.model.config
        return target_pb2.GetModelInfoResponse(
            model_name=engine.name, architecture=cfg.architecture, num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, max_context_length=engine.max_length,
            compute_dtype=proto_dtype(engine.model.dtype), device=str(engine.model.device),
            fingerprint=common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1]),
            protocol_version=PROTOCOL_VERSION, eos_token_ids=sorted(engine.tokenizer.eos_token_ids),
            max_sessions=engine.limits.max_sessions, max_tree_nodes=engine.limits.max_tree_nodes,
            max_message_bytes=self.max_message_bytes, speculation_available=self.drafter_address is not None,
            default_mode=self.default_mode, verify_costs=[t.to_proto() for t in engine.cost_tables],
            live_sessions=len(engine.sessions))

    # -- session stream -----------------------------------------------------------------------------

    async def TargetSession(self, request_iterator, context):
        async for response in session_stream(request_iterator, self.handle, self.executor, self._release_owner):
            yield response

    def _release_owner(self, owner: object) -> None:
        if self.engine is not None:
            self.engine.release_owner(owner)

    def handle(self, request: target_pb2.TargetSessionRequest, owner: object) -> target_pb2.TargetSessionResponse:
        return run_session_op(self._dispatch, request, owner, target_pb2.TargetSessionResponse)

    def _dispatch(self, request: target_pb2.TargetSessionRequest, owner: object) -> dict:
        engine = self.ready_engine()
        op = request.WhichOneof("op")
        if op == "open":
            m = request.open
            drafter = (m.drafter_target.model, m.drafter_target.tokenizer) if m.HasField("drafter_target") else None
            sid = engine.open_session(list(m.capture_layer_ids), drafter, m.protocol_version, m.max_length, owner)
            return dict(opened=target_pb2.SessionOpened(
                session_id=sid, max_length=engine.sessions.get(sid).max_length,
                fingerprint=common_pb2.Fingerprint(model=engine.fingerprint[0], tokenizer=engine.fingerprint[1])))
        if op == "prefill":
            m = request.prefill
            out = engine.prefill(m.session_id, prompt_from_proto(m.prompt), sampling_from_proto(m.sampling))
            layers = engine.sessions.get(m.session_id).capture_layers
            return dict(prefilled=target_pb2.Prefilled(
                prompt_tokens=out.prompt_tokens, next_token=out.next_token, text=out.text,
                capture=capture_to_proto(layers, 0, out.captures)))
        if op == "verify":
            m = request.verify
            if not m.HasField("tree"):
                raise InvalidArgument("verify.tree is missing")
            draft_ids, draft_logprobs = _check_tree_tensors(m.tree)
            want_logits = m.return_logits == target_pb2.LOGITS_RETURN_ALL
            t0 = time.perf_counter()
            out = engine.verify(m.session_id, list(m.tree.tokens), list(m.tree.parents), m.commit, want_logits,
                                draft_ids, draft_logprobs)
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
            return dict(rolled_back=target_pb2.RolledBack(length=length, pending_token=pending))
        if op == "release":
            engine.release(request.release.session_id)
            return dict(released=target_pb2.SessionReleased())
        raise InvalidArgument("empty request: set one of open, prefill, verify, commit, rollback, release")

    # -- single-call generation ---------------------------------------------------------------------

    async def Generate(self, request, context):
        try:
            engine = self.ready_engine()
            sampling_from_proto(request.sampling)  # validate before any work
            prompt_from_proto(request.prompt)
            if request.HasField("max_new_tokens") and request.max_new_tokens < 1:
                raise InvalidArgument(f"max_new_tokens must be >= 1 (leave it unset for {DEFAULT_MAX_NEW_TOKENS}), "
                                      f"got {request.max_new_tokens}")
            if request.mode == common_pb2.DECODE_MODE_SPECULATION and self.drafter_address is None:
                raise FailedPrecondition("mode SPECULATION needs a drafter; start the target with --drafter ADDRESS "
                                         "or ask for mode AR")
        except ServiceError as e:
            await context.abort(grpc.StatusCode[e.code_name], e.message)
        max_new_tokens = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
        config = GenerationConfig(max_new_tokens=max_new_tokens,
                                  sampling=request.sampling, stop=list(request.stop), ignore_eos=request.ignore_eos)
        stats = common_pb2.GenerationStats()
        owner = object()
        loop = asyncio.get_running_loop()
        speculation = None
        mode = request.mode or self.default_mode
        if mode != common_pb2.DECODE_MODE_AR:
            if self.draft_stub is None:
                stats.fallback_reason = "no drafter configured (start the target with --drafter ADDRESS)"
            else:
                kind = request.proposal or draft_pb2.PROPOSAL_KIND_CHAIN
                speculation = await loop.run_in_executor(self.executor, functools.partial(
                    open_speculation, self.draft_stub, kind, request.budget, request.kernel, context.time_remaining(),
                    self.draft_timeout, stats, request.proposer, adaptive=mode == common_pb2.DECODE_MODE_ADAPTIVE,
                    verify_costs=[t.to_proto() for t in engine.cost_tables], memory=self.planner_memory))
        deltas = generate_deltas(_InProcessTarget(self, owner), request.prompt, config,
                                 frozenset(engine.tokenizer.eos_token_ids), stats, speculation)
        step = None
        try:
            while True:
                remaining = context.time_remaining()
                if remaining is not None and remaining <= 0:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded during generation")
                step = loop.run_in_executor(self.executor, next, deltas, None)
                delta = await step
                step = None
                if delta is None:
                    return
                if delta.finish_reason and self.metrics is not None:
                    self.metrics.observe(stats)
                yield target_pb2.GenerateResponse(
                    text=delta.text, token_ids=delta.token_ids, finish_reason=delta.finish_reason,
                    stats=stats if delta.finish_reason else None)
        except RequestError as e:
            await context.abort(status_code(e.code), e.message)
        finally:
            if step is not None:  # cancelled mid-step: let the step finish before closing the loop
                try:
                    await asyncio.shield(step)
                except BaseException:  # noqa: BLE001
                    pass
            await loop.run_in_executor(self.executor, deltas.close)
            if speculation is not None:
                speculation.drafter.close()
            engine.release_owner(owner)


def _check_tree_tensors(tree: common_pb2.TokenTree) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Validates the optional tensors of a tree; returns the child distributions (ids, log-probs) if both are sent."""
    n = len(tree.tokens)
    tensors = {}
    for name in ("node_logprobs", "child_token_ids", "child_logprobs"):
        if tree.HasField(name):
            t = tensors[name] = from_proto(getattr(tree, name), f"tree.{name}")
            if t.dim() == 0 or t.shape[0] != n:
                raise InvalidArgument(f"tree.{name} has shape {list(t.shape)}; its first dimension must be the "
                                      f"number of nodes ({n})")
    ids, lps = tensors.get("child_token_ids"), tensors.get("child_logprobs")
    if (ids is None) != (lps is None):
        raise InvalidArgument("send tree.child_token_ids and tree.child_logprobs together")
    if ids is not None and (ids.shape != lps.shape or ids.dim() != 2 or ids.is_floating_point()):
        raise InvalidArgument(f"tree.child_token_ids {list(ids.shape)} ({ids.dtype}) and tree.child_logprobs "
                              f"{list(lps.shape)} must be [nodes, k] integer ids and log-probs")
    return ids, lps


class _InProcessTarget:
    def __init__(self, servicer: TargetServicer, owner: object) -> None:
        self.servicer, self.owner = servicer, owner

    def call(self, request: target_pb2.TargetSessionRequest) -> target_pb2.TargetSessionResponse:
        return self.servicer.handle(request, self.owner)
