"""Unit tests of the small shared pieces: session store, tensor codec, stop strings, generated stubs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.serving.sessions import Owner, SessionStore
from dspark_grpc.serving.tensor_codec import from_proto, rows_to_proto, to_proto
from dspark_grpc.speculation.errors import InvalidArgument, NotFound, ResourceExhausted
from dspark_grpc.speculation.generation import StopStrings

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_session_store_limit_ttl_and_owner():
    clock = Clock()
    store: SessionStore[str] = SessionStore(max_sessions=2, idle_ttl_s=10, clock=clock)
    a = store.create("a", owner="stream1")
    b = store.create("b", owner="stream2")
    with pytest.raises(ResourceExhausted, match="too many live sessions"):
        store.create("c")
    clock.now = 8
    assert store.get(a) == "a"  # touching a keeps it alive
    clock.now = 15  # b idle for 15 s > ttl, a for 7 s
    with pytest.raises(NotFound, match="idle"):
        store.get(b)
    assert store.get(a) == "a"
    d = store.create("d", owner="stream1")
    assert len(store) == 2
    assert sorted(store.release_owner("stream1")) == sorted([a, d])
    assert len(store) == 0
    with pytest.raises(NotFound):
        store.release(a)


def test_session_store_sessions_belong_to_their_owner_and_principals_are_capped():
    store: SessionStore[str] = SessionStore(max_sessions=4, idle_ttl_s=600, max_per_principal=2)
    alice1, alice2, bob = Owner("alice"), Owner("alice"), Owner("bob")  # two streams of alice, one of bob
    a = store.create("a", alice1)
    assert store.get(a, alice1) == "a" and store.get(a) == "a"  # no owner given: the engine's own access
    for other in (alice2, bob):
        with pytest.raises(NotFound, match="never opened on this stream"):
            store.get(a, other)
    store.create("a2", alice2)
    with pytest.raises(ResourceExhausted, match="--max-sessions-per-principal 2"):
        store.create("a3", alice1)
    store.create("b", bob)  # another principal is not held back
    store.release_owner(alice2)
    store.create("a3", alice1)
    assert len(store) == 3


def test_tensor_shapes_are_bounded_even_when_empty():
    with pytest.raises(InvalidArgument, match="too large"):
        from_proto(common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[0, 1 << 40, 1 << 40]))
    with pytest.raises(InvalidArgument, match="too large"):
        from_proto(common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[1] * 9))
    assert from_proto(common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[0, 1 << 20])).shape == (0, 1 << 20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                                   torch.uint8, torch.bool])
def test_tensor_round_trip(dtype):
    t = (torch.randn(3, 5, 2) * 7).to(dtype)
    msg = to_proto(t)
    assert len(msg.data) == t.numel() * t.element_size() and list(msg.shape) == [3, 5, 2]
    assert torch.equal(from_proto(msg), t)
    assert from_proto(to_proto(torch.empty(0, 4, dtype=dtype))).shape == (0, 4)


def test_rows_joined_on_the_wire_equal_the_joined_tensor():
    parts = [torch.randn(n, 3, 4).to(torch.bfloat16) for n in (1, 2, 1)]
    joined = rows_to_proto(parts)
    assert joined == to_proto(torch.cat(parts))
    assert torch.equal(from_proto(joined), torch.cat(parts))


def test_tensor_bytes_are_little_endian_row_major():
    msg = to_proto(torch.tensor([[1, 2], [3, 258]], dtype=torch.int32))
    assert msg.data == b"".join(v.to_bytes(4, "little") for v in (1, 2, 3, 258))


@pytest.mark.parametrize("msg,words", [
    (common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[2, 2], data=b"\0" * 15), "15 bytes"),
    (common_pb2.Tensor(dtype=common_pb2.D_TYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), "unsupported dtype"),
    (common_pb2.Tensor(dtype=common_pb2.D_TYPE_INT32, shape=[-1], data=b""), "negative"),
])
def test_tensor_validation(msg, words):
    with pytest.raises(InvalidArgument, match=words):
        from_proto(msg, "x")


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["</end>", "STOP"])
    out = [s.push(p) for p in ["Hello </", "e", "nd> more"]]
    assert out == [("Hello ", False), ("", False), ("", True)]
    s = StopStrings(["STOP"])
    assert s.push("ST") == ("", False)
    assert s.push("ay") == ("STay", False)
    assert s.push("S") == ("", False) and s.flush() == "S"
    assert StopStrings([]).push("abc") == ("abc", False)
    s = StopStrings(["ab", "b"])
    assert s.push("xab") == ("x", True)  # the earliest stop wins


def test_generated_stubs_are_current():
    from dspark_grpc.protos.generate import stale_files

    assert stale_files() == [], "run `make protos` (python -m dspark_grpc.protos.generate)"


def test_protos_buf_lint():
    npx = shutil.which("npx")
    if npx is None:
        pytest.skip("npx (Node.js) not installed")
    result = subprocess.run([npx, "-y", "@bufbuild/buf@1.75.0", "lint"], cwd=ROOT / "protos",
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0 and ("ENOTFOUND" in result.stderr or "network" in result.stderr.lower()):
        pytest.skip("buf could not be fetched from the npm registry")
    assert result.returncode == 0, result.stdout + result.stderr


def test_client_sdk_does_not_import_torch():
    code = ("import sys, dspark_grpc.client, dspark_grpc.client.cli, dspark_grpc.speculation.generation;"
            "bad = [m for m in ('torch', 'numpy', 'dspark_grpc.runtime', 'dspark_grpc.target_service') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("module", ["dspark_grpc.target_service.cli", "dspark_grpc.draft_service.cli"])
def test_service_cli_sets_the_openmp_settings_before_torch_loads(module):
    # libgomp reads GOMP_SPINCOUNT and OMP_WAIT_POLICY once, when torch loads it: the service's own import must set
    # them first, and values the user exported must win.
    code = (f"import os; import {module}; from dspark_grpc.serving import openmp; "
            "print(os.environ['GOMP_SPINCOUNT'], os.environ['OMP_WAIT_POLICY'], openmp.BEFORE_TORCH)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from dspark_grpc.serving.openmp import SPIN_COUNT

    assert out.stdout.split() == [SPIN_COUNT, "ACTIVE", "True"]


def test_openmp_settings_the_user_exported_win():  # serving/openmp.py, which both service CLIs import first
    code = ("import os; from dspark_grpc.serving import openmp; "
            "print(os.environ['GOMP_SPINCOUNT'], os.environ['OMP_WAIT_POLICY'], openmp.BEFORE_TORCH)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "GOMP_SPINCOUNT": "123",
                                                            "OMP_WAIT_POLICY": "PASSIVE"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["123", "PASSIVE", "True"], out.stderr


def test_draft_service_defaults_to_one_torch_thread():
    from dspark_grpc.draft_service.cli import parser as draft_parser
    from dspark_grpc.target_service.cli import parser as target_parser

    assert draft_parser().parse_args(["serve"]).threads == 1
    assert target_parser().parse_args(["serve"]).threads == 0  # torch's default: the target gets every core


def test_the_draft_service_handles_a_decode_round_on_its_event_loop_and_nothing_else():
    """DraftServicer._inline: a round with at most one proposal and a few new rows, while nothing else runs, on a
    one-thread drafter; a prompt's round, several proposals, other ops, a busy service or an OpenMP team: a thread."""
    from dspark_grpc.draft_service.engine import DraftEngine, DraftLimits
    from dspark_grpc.draft_service.servicer import INLINE_MAX_ROWS, DraftServicer
    from dspark_grpc.protos.dspark.v1 import draft_pb2
    from dspark_grpc.serving.threads import ThreadGovernor

    servicer = DraftServicer(max_message_bytes=1 << 20)
    engine = DraftEngine(None, 64, ("model", "tokenizer"), "prompt lookup", DraftLimits())
    engine.threads = ThreadGovernor(1)
    servicer.engine = engine

    def round_of(proposals: int, rows: int) -> draft_pb2.DraftSessionRequest:
        ops = [draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(session_id="s", tokens=[1] * rows))]
        ops += [draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(session_id="s"))] * proposals
        return draft_pb2.DraftSessionRequest(round=draft_pb2.DraftRound(ops=ops))

    assert servicer._inline(round_of(1, 3)) and servicer._inline(round_of(1, INLINE_MAX_ROWS))
    assert not servicer._inline(round_of(1, INLINE_MAX_ROWS + 1))  # a prompt's rows: projected off the loop
    assert not servicer._inline(round_of(2, 1))
    assert not servicer._inline(draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(session_id="s")))
    servicer._running = 1
    assert not servicer._inline(round_of(1, 3))
    servicer._running = 0
    engine.threads = ThreadGovernor(2, set_threads=lambda n: None)
    assert not servicer._inline(round_of(1, 3))
    engine.close()
