"""A seeded mutation fuzzer over every RPC and every session operation of both services: valid messages built from
the live state (real session ids, pending tokens, lengths), then 0-3 field mutations to hostile values (range edges,
NaN/inf, unknown enum numbers, huge repeated fields, other sessions' ids, switched oneofs), and raw protobuf bytes
corrupted on the wire. The target's sessions are opened with and without step_options and stepped (the target
drafting with its own drafter); the drafter gets DraftRounds: rounds of its stream's ops, rounds naming sessions of
other streams (another client's, the target's own draft sessions, which share the target's session ids) or unknown
ids, rounds inside rounds, huge rounds. Whatever is sent: no INTERNAL, UNKNOWN or UNAVAILABLE (also per op of a
round), no call past its deadline, another stream's session is always NOT_FOUND, a round inside a round is
INVALID_ARGUMENT, both services SERVING afterwards with no session left, and a normal request afterwards identical
to AR.

>= 2,000 messages per run; `pytest --long` sends >= 50,000."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dspark_grpc.serving.tensor_codec import to_proto
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.conftest import (
    HANG_S,
    START_TIMEOUT,
    Ops,
    Service,
    draft_args,
    health,
    live_sessions,
    wait_until,
)

SEED = 20261201
MESSAGES, LONG_MESSAGES = 800, 50_000
DEADLINE_S = 60.0  # a call that takes longer counts as a hang
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
       grpc.StatusCode.DEADLINE_EXCEEDED}
BAD_CODES = {c.value[0] for c in BAD}
MAX_LENGTH = 48  # every session and Generate stays short: cheap forwards
MAX_STREAM_SESSIONS = 5
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]

INT32 = [0, 1, -1, 2, 3, 7, 16, 17, 64, 255, 4096, 65535, 2**31 - 1, -2**31]
INT64 = INT32 + [2**40, 2**63 - 1, -2**63]
UINT32 = [0, 1, 2, 255, 2**32 - 1]
UINT64 = UINT32 + [2**63, 2**64 - 1]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-30, 1e-45, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
ENUMS = [0, 1, 2, 3, 4, -1, 99, 2**31 - 1]


def grpc_name(code: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


class Mutator:
    def __init__(self, rng: random.Random, strings: Callable[[], list[str]]) -> None:
        self.rng, self.strings = rng, strings

    def scalar(self, f: FD):
        r, t = self.rng, f.type
        if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
            return r.choice([*INT32, r.randint(-100, 100)])
        if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
            return r.choice([*INT64, r.randint(-100, 100)])
        if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
            return r.choice([*UINT32, r.randint(0, 100)])
        if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
            return r.choice([*UINT64, r.randint(0, 100)])
        if t in (FD.TYPE_FLOAT, FD.TYPE_DOUBLE):
            return r.choice([*FLOATS, r.uniform(-10, 10)])
        if t == FD.TYPE_BOOL:
            return r.random() < 0.5
        if t == FD.TYPE_ENUM:
            return r.choice(ENUMS)
        if t == FD.TYPE_STRING:
            return r.choice([*self.strings(), "", "x" * r.choice([1, 100, 5000]), "\x00\uffff\U0001f600 é",
                             "".join(chr(r.randint(32, 0xD7FF)) for _ in range(r.randint(1, 50)))])
        if t == FD.TYPE_BYTES:
            return r.randbytes(r.choice([0, 1, 2, 3, 7, 64, 1000]))
        raise AssertionError(f"unhandled field type {t}")

    def mutate(self, msg: Message, depth: int = 0) -> None:
        """One mutation somewhere in `msg` (possibly in a sub-message)."""
        r = self.rng
        if not msg.DESCRIPTOR.fields:
            return
        f = r.choice(msg.DESCRIPTOR.fields)
        if f.is_repeated:
            items = getattr(msg, f.name)
            action = r.choice(["clear", "add", "many", "dup", "inner"])
            if action == "clear":
                del items[:]
            elif f.message_type is not None:
                if action == "inner" and len(items):
                    self.mutate(r.choice(items), depth + 1)
                else:
                    for _ in range(r.choice([1, 3, 50])):
                        sub = items.add()
                        if depth < 4 and r.random() < 0.5:
                            self.mutate(sub, depth + 1)
            elif action == "dup" and len(items):
                items.extend(list(items)[: 2000 - len(items)])
            else:
                for _ in range(r.choice([1, 2, 300, 2000]) if action == "many" else 1):
                    self._try(lambda: items.append(self.scalar(f)))
        elif f.message_type is not None:
            if r.random() < 0.25 or depth >= 4:
                msg.ClearField(f.name)
            else:
                sub = getattr(msg, f.name)
                sub.SetInParent()
                self.mutate(sub, depth + 1)
        else:
            self._try(lambda: setattr(msg, f.name, self.scalar(f)))

    @staticmethod
    def _try(fn: Callable[[], None]) -> None:
        try:
            fn()
        except (ValueError, TypeError, OverflowError):  # the Python protobuf refuses the value: nothing to send
            pass

    def corrupt(self, data: bytes) -> bytes:
        r = self.rng
        b = bytearray(data or b"\x08")
        for _ in range(r.randint(1, 4)):
            kind, i = r.randrange(4), r.randrange(len(b))
            if kind == 0:
                b[i] = r.randrange(256)
            elif kind == 1:
                del b[i:]
                b = b or bytearray(b"\x0a")
            elif kind == 2:
                b[i:i] = r.randbytes(r.randint(1, 8))
            else:
                b[i:i] = bytes([r.choice([0x0A, 0x12, 0x1A, 0x22]), 0xFF, 0xFF, 0xFF, 0x7F])  # huge length
        return bytes(b)


@contextlib.contextmanager
def logged_service(module: str, args: list[str], log: Path) -> Iterator[Service]:
    """A service whose whole output (its log) goes to `log`, so the test can read it afterwards."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args,
           "--no-cost-profile", "--quiet"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or health(address) == health_pb2.HealthCheckResponse.SERVING,
                   START_TIMEOUT, f"{module} SERVING")
        assert proc.poll() is None, log.read_text()[-2000:]
        yield Service(address, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-logs")


@pytest.fixture(scope="module")
def fuzz_drafter(logs: Path) -> Iterator[Service]:
    args = [*draft_args(seed=7), "--max-message-bytes", str(4 << 20)]
    with logged_service("dspark_grpc.draft_service.cli", args, logs / "draft.log") as s:
        yield s


@pytest.fixture(scope="module")
def fuzz_target(fuzz_drafter: Service, logs: Path) -> Iterator[Service]:
    args = ["--drafter", fuzz_drafter.address, "--max-length", str(MAX_LENGTH), "--max-tree-nodes", "16",
            "--max-sessions", "16", "--max-message-bytes", str(4 << 20)]
    with logged_service("dspark_grpc.target_service.cli", args, logs / "target.log") as s:
        yield s


class Campaign:
    """The fuzzer's state: streams, the sessions they hold, what it has learned, and what came back."""

    def __init__(self, target: Service, drafter: Service, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        options = [("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]
        self.t_channel = grpc.insecure_channel(target.address, options=options)
        self.d_channel = grpc.insecure_channel(drafter.address, options=options)
        self.t_stub = target_pb2_grpc.TargetServiceStub(self.t_channel)
        self.d_stub = draft_pb2_grpc.DraftServiceStub(self.d_channel)
        self.t_info = self.t_stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=DEADLINE_S)
        self.d_info = self.d_stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=DEADLINE_S)
        self.layers = list(self.d_info.target_layer_ids)
        self.t_ops = self.d_ops = None
        self.t_sessions: dict[str, dict] = {}  # sid -> {"pending": int | None, "length": int}
        self.d_sessions: dict[str, int] = {}  # sid -> context length
        self.foreign: list[str] = []  # ids of sessions of closed streams
        self.codes: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self.slowest = 0.0
        self.seconds: collections.Counter = collections.Counter()  # by kind of call
        self.round_codes: collections.Counter = collections.Counter()  # of the ops inside DraftRounds
        self.ok: collections.Counter = collections.Counter()  # OK replies by kind of call
        self.drafted_steps = 0  # Steps of the fuzzer's sessions that verified a draft of the target's drafter
        self.step_modes: collections.Counter = collections.Counter()  # what opened sessions step with, and why
        # Another client's streams, each holding one session the fuzzer names but must never reach: a target session
        # that steps with the drafter (so the target's draft session of the same id lives on the drafter, on the
        # target's own stream), and a draft session.
        self.other_t = Ops(self.t_stub.TargetSession, target_pb2.TargetSessionRequest, timeout=DEADLINE_S)
        self.other_t_sid = self.other_t.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
            mode=common_pb2.DECODE_MODE_SPECULATION))).session_id
        self.other_t.ok(prefill=target_pb2.Prefill(session_id=self.other_t_sid, prompt=common_pb2.Prompt(text="Hi")))
        assert self.other_t.ok(step=target_pb2.Step(session_id=self.other_t_sid)).report.draft_depth > 0
        self.other_d = Ops(self.d_stub.DraftSession, draft_pb2.DraftSessionRequest, timeout=DEADLINE_S)
        self.other_d_sid = self.other_d.ok(open=draft_pb2.OpenDraft(target=self.d_info.target)).session_id
        self.mutator = Mutator(self.rng, lambda: [*self.t_sessions, *self.d_sessions, *self.foreign[-4:],
                                                  self.other_t_sid, self.other_d_sid])
        self.reopen()

    def reopen(self) -> None:
        for ops in (self.t_ops, self.d_ops):
            if ops is not None:
                ops.close()
        self.foreign += [*self.t_sessions, *self.d_sessions]
        self.t_sessions, self.d_sessions = {}, {}
        self.t_ops = Ops(self.t_stub.TargetSession, target_pb2.TargetSessionRequest, timeout=DEADLINE_S)
        self.d_ops = Ops(self.d_stub.DraftSession, draft_pb2.DraftSessionRequest, timeout=DEADLINE_S)
        self.speculating_session()

    def speculating_session(self) -> None:
        """A well-formed session that steps with the target's drafter, stepped once, for the fuzzer to work on."""
        opened = self.session_op(self.t_ops, "target open", dict(open=target_pb2.OpenSession(
            step_options=target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION))), mutate=False)
        if opened is None or opened.status.code:
            return
        sid = opened.opened.session_id
        self.t_sessions[sid] = {"pending": None, "length": 0}
        prefilled = self.session_op(self.t_ops, "target prefill", dict(prefill=target_pb2.Prefill(
            session_id=sid, prompt=common_pb2.Prompt(text="The capital of France is"))), mutate=False)
        if prefilled is not None and not prefilled.status.code:
            self.t_sessions[sid] = {"pending": prefilled.prefilled.next_token,
                                    "length": len(prefilled.prefilled.prompt_tokens)}
            self.track_step(sid, self.session_op(self.t_ops, "target step", dict(step=target_pb2.Step(
                session_id=sid)), mutate=False))

    def close(self) -> None:
        for ops in (self.t_ops, self.d_ops, self.other_t, self.other_d):
            ops.close()
        self.t_channel.close()
        self.d_channel.close()

    # -- recording ----------------------------------------------------------------------------------

    def record(self, what: str, code: int, detail: str, seconds: float, request: Message | bytes) -> None:
        self.codes[grpc_name(code)] += 1
        self.slowest = max(self.slowest, seconds)
        self.seconds[what.split(" (")[0]] += seconds
        self.ok[what.split(" (")[0]] += code == 0
        if code in BAD_CODES or seconds > DEADLINE_S:
            self.failures.append(f"{what}: code {code} after {seconds:.1f} s: {detail[:300]}\n  request: "
                                 f"{str(request)[:600]!r}")

    def session_op(self, ops: Ops, what: str, op: dict[str, Message], mutate: bool = True) -> Message | None:
        request = ops.request_type(request_id=ops.next_id + 1, **op)
        if mutate and self.rng.random() < 0.8:
            for _ in range(self.rng.choice([0, 1, 1, 2, 3])):
                self.mutator.mutate(getattr(request, request.WhichOneof("op")) if request.WhichOneof("op") and
                                    self.rng.random() < 0.9 else request)
        ops.next_id += 1
        self.sent = request
        t0 = time.monotonic()
        try:
            response = ops.stream.call(request, timeout=DEADLINE_S)
        except Exception as e:  # noqa: BLE001 - the stream itself failed: recorded as the code it carries
            self.record(what, getattr(e, "code", 2), str(e), time.monotonic() - t0, request)
            self.reopen()
            return None
        self.record(what, response.status.code, response.status.message, time.monotonic() - t0, request)
        self.check_owned(what, request, response)
        return response

    def foreign_ids(self, draft: bool) -> set[str]:
        """Ids of live sessions of other streams, unreachable from the fuzzer's stream (an id the fuzzer's own draft
        stream has opened under, e.g. one of the target's, is its own)."""
        if draft:
            return {self.other_d_sid, self.other_t_sid, *self.t_sessions} - set(self.d_sessions)
        return {self.other_t_sid}

    def check_owned(self, what: str, request: Message, response: Message, own: frozenset | set = frozenset()
                    ) -> None:
        """Another stream's session is NOT_FOUND, whatever else the op holds; a round inside a round is
        INVALID_ARGUMENT, and a round answers each of its ops, in order, with the op's request id."""
        draft = isinstance(request, draft_pb2.DraftSessionRequest)
        name = request.WhichOneof("op")
        if name == "round":
            ops = list(request.round.ops)
            if any(op.WhichOneof("op") == "round" for op in ops):
                if response.status.code != INVALID_ARGUMENT:
                    self.failures.append(f"{what}: a round inside a round got code {response.status.code}: "
                                         f"{response.status.message[:200]}")
                return
            if response.status.code:
                return
            results = list(response.round.results)
            if [r.request_id for r in results] != [op.request_id for op in ops]:
                self.failures.append(f"{what}: {len(results)} results for {len(ops)} ops, or out of order")
                return
            # sessions the round itself opens are the stream's own: for the ops after the open, and for every
            # proposal (the round's proposals run after its other ops)
            opens = [r.opened.session_id if op.WhichOneof("op") == "open" and not r.status.code else None
                     for op, r in zip(ops, results, strict=True)]
            for i, (op, result) in enumerate(zip(ops, results, strict=True)):
                inner = f"{what}: op {op.WhichOneof('op')}"
                self.round_codes[result.status.code] += 1
                if result.status.code in BAD_CODES:
                    self.failures.append(f"{inner}: code {result.status.code}: {result.status.message[:300]}\n  "
                                         f"op: {str(op)[:600]!r}")
                self.check_owned(inner, op, result, own=set(opens if op.WhichOneof("op") == "propose" else opens[:i]))
            return
        if name in (None, "open"):
            return
        sid = getattr(request, name).session_id  # looked up (with the stream as owner) before anything else
        if sid in self.foreign_ids(draft) - own and response.status.code != NOT_FOUND:
            self.failures.append(f"{what}: another stream's session {sid!r} answered with code "
                                 f"{response.status.code} ({response.status.message[:200]})")

    def unary(self, what: str, call: Callable, request) -> None:
        t0 = time.monotonic()
        code, detail = 0, ""
        try:
            result = call(request, timeout=DEADLINE_S)
            if not isinstance(result, (Message, bytes)):
                for _ in result:  # a server stream
                    pass
        except grpc.RpcError as e:
            code, detail = e.code().value[0], e.details() or ""
        self.record(what, code, detail, time.monotonic() - t0, request)

    # -- target session ops ---------------------------------------------------------------------------

    def pick(self, sessions: dict, want: Callable[[object], bool] = lambda s: True) -> str:
        ids = [sid for sid, s in sessions.items() if want(s)] or list(sessions) or ["no-such-session"]
        return self.rng.choice(ids)

    def target_step(self) -> None:
        r, s = self.rng, self.t_sessions
        if len(s) > MAX_STREAM_SESSIONS:
            sid = next(iter(s))
            self.session_op(self.t_ops, "target release", dict(release=target_pb2.Release(session_id=sid)),
                            mutate=False)  # as sent: the fuzzer's record of its sessions stays true
            s.pop(sid, None)
            return
        kind = r.choice(["open", "open", "prefill", "prefill", "verify", "verify", "step", "step", "step", "commit",
                         "rollback", "release"])
        if kind == "open" or not s:
            layers = r.choice([[], self.layers])
            fp = self.t_info.fingerprint if r.random() < 0.7 else common_pb2.Fingerprint()
            op = dict(open=target_pb2.OpenSession(capture_layer_ids=layers, drafter_target=fp,
                                                  max_length=r.choice([0, 0, 24])))
            if r.random() < 0.7:  # steps with the target's drafter (it feeds the drafter itself: no layers asked)
                op["open"].step_options.CopyFrom(target_pb2.StepOptions(
                    mode=r.choice([0, 1, 2, 2, 2, 3]), proposal=r.choice([0, 1, 2]), budget=r.choice([0, 0, 2, 4, 16]),
                    kernel=r.choice([0, 2]), proposer=r.choice([0, 1, 2, 3])))
                if r.random() < 0.85:
                    op["open"].ClearField("capture_layer_ids")
                    op["open"].ClearField("drafter_target")
        elif kind == "step":
            op = dict(step=target_pb2.Step(session_id=self.pick(s, lambda x: x["pending"] is not None)))
        elif kind == "prefill":
            prompts = [common_pb2.Prompt(text=r.choice(["Hi", "The capital of France is", "def f(x):"])),
                       common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[
                           common_pb2.ChatMessage(role="user", content="What is 2 + 2?")])),
                       common_pb2.Prompt(tokens=common_pb2.TokenIds(ids=[r.randrange(49152) for _ in range(5)]))]
            sampling = r.choice([common_pb2.SamplingParams(),
                                 common_pb2.SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=r.randrange(99))])
            op = dict(prefill=target_pb2.Prefill(session_id=self.pick(s, lambda x: x["pending"] is None),
                                                 prompt=r.choice(prompts), sampling=sampling))
        elif kind == "verify":
            sid = self.pick(s, lambda x: x["pending"] is not None)
            pending = s.get(sid, {}).get("pending") or 0
            n = r.randint(0, 6)
            parents = [-1] + [r.randrange(i) if r.random() < 0.3 else i - 1 for i in range(1, n + 1)]
            tree = common_pb2.TokenTree(tokens=[pending] + [r.randrange(49152) for _ in range(n)], parents=parents)
            if r.random() < 0.3 and n:  # a sampled chain's child distributions
                k = r.choice([1, 4])
                tree.parents[:] = list(range(-1, n))
                ids = torch.randint(0, 49152, (n + 1, k), generator=self.gen, dtype=torch.int32)
                lps = torch.randn(n + 1, k, generator=self.gen).log_softmax(-1)
                tree.child_token_ids.CopyFrom(to_proto(ids))
                tree.child_logprobs.CopyFrom(to_proto(lps))
            op = dict(verify=target_pb2.Verify(session_id=sid, tree=tree, commit=r.random() < 0.7,
                                               return_logits=r.choice([0, 1, 1, 2])))
        elif kind == "commit":
            op = dict(commit=target_pb2.Commit(session_id=self.pick(s), path=[0, 1][: r.randint(1, 2)],
                                               next_token=r.randrange(49152)))
        elif kind == "rollback":
            sid = self.pick(s, lambda x: x["length"] > 1)
            op = dict(rollback=target_pb2.Rollback(session_id=sid, length=r.randint(1, max(1, s.get(sid, {}).get(
                "length", 1)))))
        else:
            op = dict(release=target_pb2.Release(session_id=self.pick(s)))
        response = self.session_op(self.t_ops, f"target {kind}", op)
        if response is None or response.status.code:
            return
        result = response.WhichOneof("result")
        body = getattr(response, result)
        sid = getattr(next(iter(op.values())), "session_id", "")
        if result == "opened":
            s[body.session_id] = {"pending": None, "length": 0}
            self.step_modes[(common_pb2.DecodeMode.Name(body.step_mode), body.fallback_reason[:60])] += 1
        elif result == "prefilled" and sid in s:
            s[sid] = {"pending": body.next_token, "length": len(body.prompt_tokens)}
        elif result == "verified" and sid in s and body.committed:
            s[sid] = {"pending": body.next_token, "length": body.length}
        elif result == "committed" and sid in s:
            s[sid] = {"pending": op["commit"].next_token, "length": body.length}
        elif result == "rolled_back" and sid in s:
            s[sid] = {"pending": body.pending_token, "length": body.length}
        elif result == "stepped":
            self.track_step(sid, response)
        elif result == "released":
            s.pop(sid, None)

    def track_step(self, sid: str, response: target_pb2.TargetSessionResponse | None) -> None:
        if response is None or response.status.code or sid not in self.t_sessions:
            return
        body = response.stepped
        self.t_sessions[sid] = {"pending": body.next_token, "length": body.length}
        self.drafted_steps += body.report.draft_depth > 0
        if body.report.fallback_reason:
            self.step_modes[("step", body.report.fallback_reason[:60])] += 1

    # -- draft session ops ----------------------------------------------------------------------------

    def draft_step(self) -> None:
        r, s = self.rng, self.d_sessions
        if len(s) > MAX_STREAM_SESSIONS:
            sid = next(iter(s))
            self.session_op(self.d_ops, "draft release", dict(release=draft_pb2.ReleaseDraft(session_id=sid)),
                            mutate=False)
            s.pop(sid, None)
            return
        kind = r.choice(["open", "append", "append", "propose", "propose", "propose", "truncate", "release", "round",
                         "round"])
        if kind == "round" and s:
            op = dict(round=self.draft_round())
        else:
            op = self.draft_op("open" if not s else kind, dict(s))
            kind = next(iter(op))
        response = self.session_op(self.d_ops, f"draft {kind}", op)
        if response is None or response.status.code:
            return
        # what was sent (mutated: another op, or a round, may have taken the op's place) and what came back
        if self.sent.WhichOneof("op") == "round":
            for sent, result in zip(self.sent.round.ops, response.round.results, strict=False):
                if sent.WhichOneof("op"):
                    self.track_draft(getattr(sent, sent.WhichOneof("op")), result)
        elif self.sent.WhichOneof("op"):
            self.track_draft(getattr(self.sent, self.sent.WhichOneof("op")), response)

    def track_draft(self, op: Message, response: draft_pb2.DraftSessionResponse) -> None:
        s = self.d_sessions
        if response.status.code:
            return
        result = response.WhichOneof("result")
        body = getattr(response, result)
        sid = getattr(op, "session_id", "")
        if result == "opened":
            s[body.session_id] = 0
        elif result in ("appended", "truncated") and sid in s:
            s[sid] = body.length
        elif result == "released":
            s.pop(sid, None)

    def draft_op(self, kind: str, lengths: dict[str, int]) -> dict[str, Message]:
        """One valid op of the fuzzer's draft stream; `lengths` (a session's context as the op will find it) is
        updated by appends and truncates."""
        r, s = self.rng, lengths
        if kind == "open":
            return dict(open=draft_pb2.OpenDraft(target=self.d_info.target, protocol_version=r.choice([0, 1])))
        if kind == "append":
            sid = self.pick(s)
            start, n = s.get(sid, 0), r.randint(1, 6)
            rows = torch.randn(n, len(self.layers), self.t_info.hidden_size, generator=self.gen)
            if r.random() < 0.15:  # hostile values in a well-formed tensor
                rows[r.randrange(n)].view(-1)[r.randrange(rows[0].numel())] = r.choice([math.nan, math.inf, 3e38])
            rows = rows.to(torch.bfloat16)
            capture = common_pb2.HiddenCapture(layer_ids=self.layers, start_position=start, rows=to_proto(rows))
            s[sid] = start + n
            return dict(append=draft_pb2.AppendContext(session_id=sid, start_position=start, capture=capture,
                                                       tokens=[r.randrange(49152) for _ in range(n)]))
        if kind == "propose":
            sid = self.pick(s, lambda length: length > 0)
            sampling = r.choice([common_pb2.SamplingParams(), common_pb2.SamplingParams(temperature=0.8, seed=3)])
            return dict(propose=draft_pb2.Propose(session_id=sid, anchor_token=r.randrange(49152),
                                                  anchor_position=s.get(sid, 0), kind=r.choice([0, 1, 2]),
                                                  budget=r.choice([0, 1, 4, 8]), proposer=r.choice([0, 1, 2, 3]),
                                                  kernel=r.choice([0, 2]), sampling=sampling))
        if kind == "truncate":
            sid = self.pick(s)
            s[sid] = r.randint(0, s.get(sid, 0))
            return dict(truncate=draft_pb2.TruncateContext(session_id=sid, length=s[sid]))
        return dict(release=draft_pb2.ReleaseDraft(session_id=self.pick(s)))

    def draft_round(self) -> draft_pb2.DraftRound:
        """What a target sends its drafter: ops of this stream's sessions (proposals drafted together), some naming
        another stream's session or an unknown id; or a round inside a round; or a huge round."""
        r = self.rng
        strangers = lambda: [*self.foreign_ids(True), *self.foreign[-4:], "no-such-session"]  # noqa: E731
        variant = r.choices(["ops", "nested", "huge", "oversized"], weights=[16, 2, 2, 1])[0]
        ops: list[draft_pb2.DraftSessionRequest] = []
        lengths = dict(self.d_sessions)
        kinds = ["open", "append", "append", "propose", "propose", "propose", "truncate", "release"]
        if variant in ("ops", "nested"):
            for _ in range(r.randint(1, 6)):
                op = self.draft_op(r.choice(kinds), lengths)
                body = next(iter(op.values()))
                if "session_id" in body.DESCRIPTOR.fields_by_name and r.random() < 0.25:
                    body.session_id = r.choice(strangers())
                ops.append(draft_pb2.DraftSessionRequest(**op))
            if variant == "nested":
                inner = draft_pb2.DraftRound(ops=ops[: r.randint(0, len(ops))])
                if r.random() < 0.3:  # deeper still
                    inner = draft_pb2.DraftRound(ops=[draft_pb2.DraftSessionRequest(round=inner)])
                ops.insert(r.randrange(len(ops) + 1), draft_pb2.DraftSessionRequest(round=inner))
        elif variant == "huge":  # thousands of cheap ops on other streams' or unknown sessions, a few on its own
            ids = strangers()
            for _ in range(r.choice([500, 2000])):
                sid = r.choice(ids)
                ops.append(r.choice([
                    draft_pb2.DraftSessionRequest(release=draft_pb2.ReleaseDraft(session_id=sid)),
                    draft_pb2.DraftSessionRequest(truncate=draft_pb2.TruncateContext(session_id=sid)),
                    draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(session_id=sid, anchor_token=1)),
                    draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(session_id=sid, tokens=[1, 2])),
                    draft_pb2.DraftSessionRequest(open=draft_pb2.OpenDraft(target=self.d_info.target,
                                                                           session_id=sid)),
                    draft_pb2.DraftSessionRequest()]))
            for _ in range(r.randint(0, 8)):
                ops.insert(r.randrange(len(ops) + 1), draft_pb2.DraftSessionRequest(
                    **self.draft_op(r.choice(kinds), lengths)))
        else:  # more bytes than the drafter takes in one message (--max-message-bytes 4 MiB)
            for _ in range(2):
                ops.append(draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(
                    session_id=self.pick(lengths), tokens=[49151] * (1 << 20))))
        for i, op in enumerate(ops):
            op.request_id = i + 1
        return draft_pb2.DraftRound(ops=ops)

    # -- unary RPCs, Generate, raw bytes ----------------------------------------------------------------

    def generate_step(self) -> None:
        r = self.rng
        request = target_pb2.GenerateRequest(
            prompt=common_pb2.Prompt(text=r.choice(["Hi", "Once upon a time"])), max_new_tokens=r.randint(1, 2),
            mode=r.choice([0, 1, 2, 3]), proposal=r.choice([0, 1, 2]), stop=r.choice([[], ["."]]),
            sampling=r.choice([common_pb2.SamplingParams(), common_pb2.SamplingParams(temperature=0.7, seed=5)]))
        if r.random() < 0.8:
            for _ in range(r.randint(1, 3)):
                self.mutator.mutate(request)
        if request.max_new_tokens > 3 or not request.HasField("max_new_tokens"):
            request.max_new_tokens = 3  # keep each call cheap; any other value still goes as mutated
        self.unary("Generate", self.t_stub.Generate, request)

    def info_step(self) -> None:
        r = self.rng
        which = r.randrange(4)
        if which == 0:
            self.unary("GetModelInfo", self.t_stub.GetModelInfo, target_pb2.GetModelInfoRequest())
        elif which == 1:
            self.unary("GetDrafterInfo", self.d_stub.GetDrafterInfo, draft_pb2.GetDrafterInfoRequest())
        else:
            channel = r.choice([self.t_channel, self.d_channel])
            request = health_pb2.HealthCheckRequest(service=r.choice(["", "dspark.v1.TargetService", "nope"]))
            self.unary("Health.Check", health_pb2_grpc.HealthStub(channel).Check, request)

    def raw_step(self) -> None:
        """Valid messages' bytes, corrupted, to every RPC (session streams: a fresh stream each)."""
        r = self.rng
        target = [("/dspark.v1.TargetService/GetModelInfo", "unary_unary", target_pb2.GetModelInfoRequest()),
                  ("/dspark.v1.TargetService/Generate", "unary_stream", target_pb2.GenerateRequest(
                      prompt=common_pb2.Prompt(text="Hi"), max_new_tokens=1)),
                  ("/dspark.v1.TargetService/TargetSession", "stream_stream", target_pb2.TargetSessionRequest(
                      request_id=1, open=target_pb2.OpenSession())),
                  ("/dspark.v1.TargetService/TargetSession", "stream_stream", target_pb2.TargetSessionRequest(
                      request_id=1, open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
                          mode=common_pb2.DECODE_MODE_SPECULATION, proposal=draft_pb2.PROPOSAL_KIND_TREE,
                          budget=4)))),
                  ("/dspark.v1.TargetService/TargetSession", "stream_stream", target_pb2.TargetSessionRequest(
                      request_id=1, step=target_pb2.Step(session_id=self.other_t_sid)))]
        draft = [("/dspark.v1.DraftService/GetDrafterInfo", "unary_unary", draft_pb2.GetDrafterInfoRequest()),
                 ("/dspark.v1.DraftService/DraftSession", "stream_stream", draft_pb2.DraftSessionRequest(
                     request_id=1, open=draft_pb2.OpenDraft(target=self.d_info.target))),
                 ("/dspark.v1.DraftService/DraftSession", "stream_stream", draft_pb2.DraftSessionRequest(
                     request_id=1, round=draft_pb2.DraftRound(ops=[
                         draft_pb2.DraftSessionRequest(request_id=2, open=draft_pb2.OpenDraft(
                             target=self.d_info.target, session_id="raw")),
                         draft_pb2.DraftSessionRequest(request_id=3, append=draft_pb2.AppendContext(
                             session_id="raw", tokens=[1, 2, 3])),
                         draft_pb2.DraftSessionRequest(request_id=4, propose=draft_pb2.Propose(
                             session_id="raw", anchor_token=1, anchor_position=3))])))]
        channel, (method, shape, msg) = r.choice([(self.t_channel, x) for x in target] +
                                                 [(self.d_channel, x) for x in draft])
        data = self.mutator.corrupt(msg.SerializeToString())
        call = getattr(channel, shape)(method)
        self.unary(f"raw {method}", (lambda d, timeout: call(iter([d]), timeout=timeout)) if shape == "stream_stream"
                   else call, data)

    def step(self, i: int) -> None:
        if i and i % 250 == 0:
            self.reopen()  # streams that end release their sessions
        x = self.rng.random()
        if x < 0.44:
            self.target_step()
        elif x < 0.82:
            self.draft_step()
        elif x < 0.86:
            self.generate_step()
        elif x < 0.91:
            self.info_step()
        else:
            self.raw_step()


def test_fuzz_every_rpc_and_session_op(fuzz_target: Service, fuzz_drafter: Service, logs: Path,
                                       request: pytest.FixtureRequest):
    n = LONG_MESSAGES if request.config.getoption("--long", default=False) else MESSAGES
    n = int(os.environ.get("DSPARK_FUZZ_MESSAGES", n))
    campaign = Campaign(fuzz_target, fuzz_drafter, int(os.environ.get("DSPARK_FUZZ_SEED", SEED)))
    t0 = time.monotonic()
    try:
        for i in range(n):
            campaign.step(i)
    finally:
        campaign.close()
    seconds = time.monotonic() - t0
    print(f"\nfuzz: {n} messages in {seconds:.0f} s (slowest call {campaign.slowest:.2f} s): "
          f"{dict(campaign.codes.most_common())}; seconds by call: "
          f"{ {k: round(v, 1) for k, v in campaign.seconds.most_common(6)} }")
    assert sum(campaign.codes.values()) >= n
    assert not campaign.failures, f"{len(campaign.failures)} bad replies:\n" + "\n".join(campaign.failures[:20])
    assert campaign.codes["OK"] > n // 10 and campaign.codes["INVALID_ARGUMENT"] > n // 10  # it went both ways
    print(f"steps: {campaign.ok['target step']} OK, {campaign.drafted_steps} of them verified a draft; rounds: "
          f"{campaign.ok['draft round']} OK, their ops: "
          f"{ {grpc_name(c): k for c, k in campaign.round_codes.most_common()} }; sessions opened and steps' "
          f"fallbacks: {campaign.step_modes.most_common(8)}")
    # the new paths were reached: Steps that drafted, rounds whose ops ran and met other streams' sessions
    assert campaign.drafted_steps > 0 and campaign.ok["draft round"] > 0
    assert campaign.round_codes[0] > 0 and campaign.round_codes[NOT_FOUND] > 0
    # a refused request is one log line, never a traceback; refusals of one stream and reason share a line per
    # interval (serving/refusal_log.py), so the logs grow far slower than the refusals
    lines = 0
    for name in ("target.log", "draft.log"):
        text = (logs / name).read_text()
        lines += text.count(" refused: ")
        print(f"{name}: {text.count(' refused: ')} one-line refusals, {text.count('Traceback')} tracebacks")
        assert "Traceback" not in text, text[text.index("Traceback") - 500:][:3000]
    refused = sum(k for code, k in campaign.codes.items() if code != "OK") + sum(
        k for code, k in campaign.round_codes.items() if code != 0)
    print(f"{refused} refused requests and ops, {lines} log lines for them")
    assert 3 * lines < refused

    for address in (fuzz_target.address, fuzz_drafter.address):
        assert health(address) == health_pb2.HealthCheckResponse.SERVING
    wait_until(lambda: live_sessions(fuzz_target.address, fuzz_drafter.address) == (0, 0), HANG_S,
               "every fuzzed session released once its stream ended")

    # a normal request afterwards: speculation through the fuzzed drafter gives AR's tokens
    with grpc.insecure_channel(fuzz_target.address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        outputs = {}
        for mode in (common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION):
            request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="The capital of France is"),
                                                 max_new_tokens=24, mode=mode, ignore_eos=True)
            replies = list(stub.Generate(request, timeout=120))
            outputs[mode] = [t for reply in replies for t in reply.token_ids]
            stats = replies[-1].stats
        assert len(outputs[common_pb2.DECODE_MODE_AR]) == 24
        assert outputs[common_pb2.DECODE_MODE_SPECULATION] == outputs[common_pb2.DECODE_MODE_AR]
        assert stats.fallback_reason == "", stats  # it did speculate


def test_a_dspark_drafter_append_past_its_context_is_resource_exhausted(fuzz_drafter: Service):
    with grpc.insecure_channel(fuzz_drafter.address, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        info = stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=DEADLINE_S)
        ops = Ops(stub.DraftSession, draft_pb2.DraftSessionRequest, timeout=DEADLINE_S)
        sid = ops.ok(open=draft_pb2.OpenDraft(target=info.target)).session_id
        response = ops(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=[1] * (1 << 20)))
        assert response.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], response.status.message
        assert "holds at most" in response.status.message
        ops.close()
