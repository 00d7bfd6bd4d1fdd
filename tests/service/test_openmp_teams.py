"""All of the target's torch work runs on its batcher's worker (serving/batching.py): a request thread that runs a
parallel torch op gets an OpenMP team of its own, and with more OpenMP threads than cores libgomp stops spinning
between parallel regions, so every later forward slows down (docs/PERFORMANCE.md). Checked where it happens: the
OS threads that appear while a request thread drives a session (a new team shows up as its worker thread)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from dspark_grpc.target_service.engine import EngineLimits, TargetEngine
    torch.set_num_threads(2)
    engine = TargetEngine.load({path!r}, limits=EngineLimits(max_length=512), progress=False, precision={precision!r})
    engine.batcher.call(lambda: torch.ones(1 << 20).mul_(2))  # the worker's own team, made before we look
    before = set(os.listdir("/proc/self/task"))
    found = []

    def request() -> None:  # as a gRPC request thread would: one session, start to end
        sid = engine.open_session(capture_layers=[1, 2])
        engine.prefill(sid, "Hello there, how are you today?" * 8)
        for _ in range(3):
            token = engine.sessions.get(sid).tokens[-1]
            engine.verify(sid, [token, 5, 6], [-1, 0, 1], commit=True)
        engine.rollback(sid, 20)
        engine.verify(sid, [engine.sessions.get(sid).tokens[-1]], [-1], commit=True)
        found.extend(set(os.listdir("/proc/self/task")) - before - {{str(threading.get_native_id())}})
        engine.release(sid)

    thread = threading.Thread(target=request)
    thread.start()
    thread.join()
    engine.close()
    print("NEW THREADS", sorted(found))
""")


@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_a_request_thread_makes_no_openmp_team(smollm2_path, precision):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(path=str(smollm2_path), precision=precision)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "NEW THREADS []"
