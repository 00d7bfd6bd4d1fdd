"""Start the services as child processes on free loopback ports (the demo, bench and tests use this).

A launcher owns its children: they are stopped when the `with` block ends (also on SIGTERM/SIGINT of the launcher,
see `stop_on_signals`), and they die with the launcher even if it is killed (Linux: PR_SET_PDEATHSIG). A child
that exits before it serves fails the launch at once, with the last lines it printed.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

_LISTENING = re.compile(r"listening on (\S+:\d+)")
_SERVING = re.compile(r"\bSERVING on ")
_FAILED = re.compile(r"\bfailed to load: ")
_PR_SET_PDEATHSIG = 1


class ServiceExited(RuntimeError):
    """A started service exited (or never listened): its name, exit code and last output lines."""

    def __init__(self, name: str, returncode: int | None, last_lines: list[str], what: str = "exited",
                 listened: bool = True) -> None:
        tail = " | ".join(line.strip() for line in last_lines if line.strip())[-600:]
        super().__init__(f"the {name} service {what}"
                         + (f" with code {returncode}" if returncode is not None else "")
                         + (f": {tail}" if tail else ""))
        self.name, self.returncode, self.last_lines, self.listened = name, returncode, last_lines, listened


# Run in a fresh interpreter that asks for SIGTERM when its launcher dies, then execs the real command (the request
# survives exec). Not a `preexec_fn`: that makes subprocess fork() instead of vfork(), and fork() runs gRPC core's
# atfork handler, which can block for good while the launcher holds channels (seen: a test restarting a killed
# drafter hung in Popen).
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "launcher = int(sys.argv[1])\n"
                    "try:\n"
                    f"    ctypes.CDLL('libc.so.6', use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGTERM)\n"
                    "except OSError:\n"
                    "    pass\n"
                    "if os.getppid() != launcher:\n"
                    "    sys.exit(1)\n"
                    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def child_command(python_args: list[str]) -> list[str]:
    """`python PYTHON_ARGS`, made to get SIGTERM when the calling thread's process dies, however it dies (Linux,
    main thread; elsewhere the plain command)."""
    if not _own_children():
        return [sys.executable, *python_args]
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *python_args]


def _own_children() -> bool:
    # PR_SET_PDEATHSIG fires when the thread that forked the child ends: only the main thread lives as long as the
    # launcher does
    return sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def local_service(module: str, args: list[str], *, name: str, echo: bool = True, start_timeout: float = 120.0,
                  **kwargs) -> Iterator[str]:
    """`_local_service`, started once more if the child was killed by a signal before it listened (seen once: gRPC's
    core aborted at start-up on a busy machine, 'epoll_wait error: Bad file descriptor'); said on stderr."""
    for attempt in (1, 2):
        try:
            starting = _local_service(module, args, name=name, echo=echo, start_timeout=start_timeout, **kwargs)
            address = starting.__enter__()
        except ServiceExited as e:
            if attempt == 2 or e.returncode is None or e.returncode >= 0 or e.listened:
                raise
            print(f"[launcher] the {name} service died at start-up ({e}); starting it once more", file=sys.stderr,
                  flush=True)
            continue
        break
    try:
        yield address
    except BaseException:
        if not starting.__exit__(*sys.exc_info()):
            raise
    else:
        starting.__exit__(None, None, None)


@contextlib.contextmanager
def _local_service(module: str, args: list[str], *, name: str, echo: bool = True, start_timeout: float = 120.0,
                  env: dict[str, str] | None = None, port: int = 0,
                  process: list[subprocess.Popen] | None = None, wait_serving: bool = False,
                  serving_timeout: float = 600.0) -> Iterator[str]:
    """Run `python -m module serve --port PORT ARGS` (0 = a free port); yield its address once it listens (or, with
    `wait_serving`, once it reports SERVING); stop it on exit. A child that exits first raises `ServiceExited`.
    `process`, if given, receives the child process (tests kill it)."""
    cmd = child_command(["-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args])
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if process is not None:
        process[:] = [p for p in process if p.poll() is None]  # a start that died is not the process
        process.append(proc)
    listening, serving, failed = threading.Event(), threading.Event(), threading.Event()
    address: list[str] = []
    last = collections.deque(maxlen=8)

    def pump() -> None:
        for line in proc.stdout:
            last.append(line)
            if not listening.is_set() and (m := _LISTENING.search(line)):
                address.append(m.group(1))
                listening.set()
            if _SERVING.search(line):
                serving.set()
            if _FAILED.search(line):
                failed.set()
                serving.set()
            if echo:
                sys.stderr.write(f"  [{name}] {line}")
        listening.set()
        serving.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        _wait(listening, proc, start_timeout, name, last, "did not start listening", listened=False)
        if not address:
            raise ServiceExited(name, proc.wait(), list(last), listened=False)
        if wait_serving:
            _wait(serving, proc, serving_timeout, name, last, "did not report SERVING")
        if failed.is_set():  # the service said so: do not wait for it to exit
            _stop(proc, grace=5)
            raise ServiceExited(name, proc.returncode, list(last))
        yield address[0]
    finally:
        _stop(proc)


def _wait(event: threading.Event, proc: subprocess.Popen, timeout: float, name: str, last: collections.deque,
          what: str, listened: bool = True) -> None:
    deadline = time.monotonic() + timeout
    while not event.wait(0.2):
        if proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            raise ServiceExited(name, None, list(last), what=f"{what} within {timeout:g} s")
    if proc.poll() is not None:
        time.sleep(0.1)  # let the pump read the last lines
        raise ServiceExited(name, proc.returncode, list(last), listened=listened)


def _stop(proc: subprocess.Popen, grace: float = 30) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def local_target(args: list[str] = (), **kwargs) -> contextlib.AbstractContextManager[str]:
    return local_service("dspark_grpc.target_service.cli", list(args), name="target", **kwargs)


def local_drafter(args: list[str] = (), **kwargs) -> contextlib.AbstractContextManager[str]:
    return local_service("dspark_grpc.draft_service.cli", list(args), name="draft", **kwargs)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While inside: SIGTERM (and SIGHUP) raise KeyboardInterrupt in the main thread like Ctrl-C does, so every
    `with local_service(...)` block unwinds and stops its child."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
