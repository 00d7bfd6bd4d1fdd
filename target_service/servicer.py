"""dspark.v1.TargetService: protobuf <-> the step engine (target_service/step_engine.py) and TargetEngine.
Validation and translation only."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.serving.security import principal_of
from dspark_grpc.serving.server import check_enum, log_refusal, run_session_op, session_stream, status_code
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.serving.tensor_codec import proto_dtype, to_proto
from dspark_grpc.speculation.channel import ChannelSecurity
from dspark_grpc.speculation.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
)
from dspark_grpc.speculation.generation import GenerationConfig, RequestError, generate_deltas
from dspark_grpc.target_service.engine import PROTOCOL_VERSION, TargetEngine
from dspark_grpc.target_service.step_engine import StepEngine, check_tree_tensors, committed_fields

log = logging.getLogger("dspark.target")

DEFAULT_MAX_NEW_TOKENS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # each; the stop-string check runs per token over the held-back text
ADMISSION_POLL_S = 0.25  # a Generate waiting for a session looks again this often (its end, idle sessions' eviction)


def check_stop(stop) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS}")
    long = [len(x) for x in stop if len(x) > MAX_STOP_CHARS]
    if long:
        raise InvalidArgument(f"a stop string has {long[0]} characters; at most {MAX_STOP_CHARS} each")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, max_message_bytes: int, drafter_address: str | None = None,
                 default_mode: int = common_pb2.DECODE_MODE_ADAPTIVE, draft_timeout: float = 10.0,
                 executor: ThreadPoolExecutor | None = None, max_sessions: int = 16,
                 drafter_security: ChannelSecurity | None = None, draft_ahead: bool = True) -> None:
        self.steps = StepEngine(drafter_address, default_mode, draft_timeout, drafter_security, draft_ahead)
        self.max_message_bytes = max_message_bytes
        # what a reply may carry in captures or logits, leaving room for its other fields
        self.max_reply_bytes = max_message_bytes - min(1 << 20, max_message_bytes // 8)
        # Callers wait in these threads while their step runs in a batched forward: enough for every session.
        self.executor = executor or ThreadPoolExecutor(max_workers=max(8, max_sessions + 4),
                                                       thread_name_prefix="target")
        self.drafter_address = drafter_address

    @property
    def engine(self) -> TargetEngine | None:
        """The model's engine, once loaded (None before)."""
        return self.steps.engine

    @engine.setter
    def engine(self, engine: TargetEngine | None) -> None:
        self.steps.engine = engine

    def ready_engine(self) -> TargetEngine:
        return self.steps.ready_engine()

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
            default_mode=self.steps.default_mode, verify_costs=self.steps.cost_tables(),
            live_sessions=len(engine.sessions))

    # -- session stream -----------------------------------------------------------------------------

    # -- session stream -----------------------------------------------------------------------------

    async def TargetSession(self, request_iterator, context):
        async for response in session_stream(request_iterator, self.handle, self.executor, self.steps.release_owner,
                                             principal_of(context)):
            yield response

    def handle(self, request: target_pb2.TargetSessionRequest, owner: object) -> target_pb2.TargetSessionResponse:
        return run_session_op(self._dispatch, request, owner, target_pb2.TargetSessionResponse)

    def _dispatch(self, request: target_pb2.TargetSessionRequest, owner: object) -> dict:
        engine = self.ready_engine()
        op = request.WhichOneof("op")
        if op not in (None, "open"):  # a session belongs to the stream that opened it
            engine.sessions.get(getattr(request, op).session_id, owner)
        if op == "open":
            return dict(opened=self.steps.open(request.open, owner))
        if op == "prefill":
            return dict(prefilled=self.steps.prefill(request.prefill, self.max_reply_bytes))
        if op == "step":
            if request.step.tokens_left < 0:
                raise InvalidArgument(f"step.tokens_left must be >= 0 (0 = no bound), got {request.step.tokens_left}")
            return dict(stepped=self.steps.step(request.step.session_id, request.step.tokens_left))
        if op in ("verify", "commit") and self.steps.drafting_of(getattr(request, op).session_id) is not None:
            raise FailedPrecondition(f"this session steps with the target's drafter (OpenSession.step_options): "
                                     f"send Step, not {op}; open a session without step_options to verify trees of "
                                     "your own")
        if op == "verify":
            m = request.verify
            if not m.HasField("tree"):
                raise InvalidArgument("verify.tree is missing")
            draft_ids, draft_logprobs = check_tree_tensors(m.tree)
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
            return dict(rolled_back=self.steps.rollback(request.rollback.session_id, request.rollback.length))
        if op == "release":
            self.steps.release(request.release.session_id)
            return dict(released=target_pb2.SessionReleased())
        raise InvalidArgument("empty request: set one of open, prefill, verify, commit, rollback, release, step")

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
        deltas = generate_deltas(GenerateSteps(self.steps, owner, self.max_reply_bytes, deadline, stop),
                                 request.prompt, config, frozenset(engine.tokenizer.eos_token_ids), stats, options)
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
                if item.finish_reason and self.steps.metrics is not None:
                    self.steps.metrics.observe(stats)
                yield target_pb2.GenerateResponse(
                    text=item.text, token_ids=item.token_ids, finish_reason=item.finish_reason,
                    stats=stats if item.finish_reason else None)
        except _DeadlineExceeded:
            raise DeadlineExceeded("deadline exceeded during generation") from None
        except RequestError as e:
            raise _with_status(status_code(e.code), e.message) from None
        except ServiceError as e:  # a session operation refused (a bad prompt, no session free within the deadline)
            log_refusal(what, e)
            raise
        except Exception as e:  # a bug must not take the call down without a status
            log.exception("generation failed")
            raise _with_status(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}") from None
        finally:
            stop.set()  # cancelled or done: no further step; the one under way ends before the session is freed
            try:
                await asyncio.shield(ended)
            except BaseException:  # noqa: BLE001 - cancelled again while waiting: the thread still frees the session
                pass
            self.steps.release_owner(owner)


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



class GenerateSteps:
    """A Generate's session operations: the step engine's, for the request's principal and within its deadline. A
    Generate whose session cannot open now (every session taken, or its client holding its share) waits for one to
    be freed, until its deadline or its end, as a request queued for a server's capacity does, rather than failing
    at once."""

    def __init__(self, steps: StepEngine, owner: object, max_capture_bytes: int | None = None,
                 deadline: float | None = None, stop: threading.Event | None = None) -> None:
        self.steps, self.owner, self.max_capture_bytes = steps, owner, max_capture_bytes
        self.deadline, self.stop = deadline, stop

    def open(self, m: target_pb2.OpenSession) -> target_pb2.SessionOpened:
        sessions = self.steps.ready_engine().sessions
        while True:
            seen = sessions.freed
            try:
                return self.steps.open(m, self.owner)
            except ResourceExhausted:
                wait = ADMISSION_POLL_S if self.deadline is None else min(ADMISSION_POLL_S,
                                                                          self.deadline - time.monotonic())
                if wait <= 0 or (self.stop is not None and self.stop.is_set()):
                    raise
                sessions.wait_freed(seen, wait)  # (in slices: an idle session is evicted only when someone looks)

    def prefill(self, m: target_pb2.Prefill) -> target_pb2.Prefilled:
        return self.steps.prefill(m, self.max_capture_bytes)

    def step(self, session_id: str, tokens_left: int) -> target_pb2.Stepped:
        return self.steps.step(session_id, tokens_left)

    def release(self, session_id: str) -> None:
        self.steps.release(session_id)
