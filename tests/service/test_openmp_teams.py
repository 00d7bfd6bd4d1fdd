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


PROFILE_SCRIPT = textwrap.dedent("""
    import os, threading, torch
    from dspark_grpc.serving.cost_profile import target_cost_tables
    from dspark_grpc.target_service.engine import EngineLimits, TargetEngine
    torch.set_num_threads(2)
    engine = TargetEngine.load({path!r}, limits=EngineLimits(max_length=512), progress=False, precision="fast")
    engine.batcher.call(lambda: torch.ones(1 << 20).mul_(2))  # the worker's own team, made before we look
    sizes = dict(lanes=(1,), sizes=(1,), repeats=1, max_seconds=1.0)

    def new_threads(profile) -> list:  # as the service's load thread does after loading the model
        before, found = set(os.listdir("/proc/self/task")), []

        def load() -> None:
            profile()
            found.extend(set(os.listdir("/proc/self/task")) - before - {{str(threading.get_native_id())}})

        thread = threading.Thread(target=load)
        thread.start()
        thread.join()
        return sorted(found)

    through_engine = new_threads(lambda: engine.profile_costs(None, **sizes))
    tables = len(engine.cost_tables)
    direct = new_threads(lambda: target_cost_tables(engine.model, None, **sizes))
    engine.close()
    print("TABLES", tables, "ENGINE", through_engine, "DIRECT", len(direct))
""")


def test_the_start_up_profile_times_forwards_on_the_worker(smollm2_path):
    """The target's start-up cost tables are timed where the forwards they price run: a profile run on the load
    thread gave that thread a team of its own beside the worker's, and with more OpenMP threads than cores every
    barrier slept (a 1-row step profiled 7x slower than the steps served). The direct call shows what is checked: the
    same profile from the load thread makes a team there."""
    out = subprocess.run([sys.executable, "-c", PROFILE_SCRIPT.format(path=str(smollm2_path))], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tables, engine, direct = out.stdout.strip().splitlines()[-1].split(" ", 5)[1::2]
    assert (tables, engine) == ("1", "[]") and int(direct) > 0


ENDING_THREAD_SCRIPT = textwrap.dedent("""
    import os, time, torch
    from dspark_grpc.serving.server import in_thread_that_ends
    torch.set_num_threads(2)
    before = set(os.listdir("/proc/self/task"))
    value = in_thread_that_ends(lambda: float(torch.ones(1 << 22).mul_(2).sum()))  # a parallel op: a team there
    try:
        in_thread_that_ends(lambda: 1 / 0)
    except ZeroDivisionError:
        raised = True
    # A joined thread's OS thread, and its team's threads after it, leave a moment after join() returns: wait for
    # them, bounded (a thread that stays is what the test catches).
    deadline = time.monotonic() + 60
    while set(os.listdir("/proc/self/task")) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    print("VALUE", value, "RAISED", raised, "LEFT", sorted(set(os.listdir("/proc/self/task")) - before))
""")


def test_a_model_loaded_in_a_thread_that_ends_leaves_no_team_behind():
    """The target loads its model in a thread that ends (serving/server.py `in_thread_that_ends`) before its start-up
    profile times forwards on the worker: the loading thread's OpenMP team goes with it."""
    out = subprocess.run([sys.executable, "-c", ENDING_THREAD_SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"VALUE {float(2 << 22)} RAISED True LEFT []"
