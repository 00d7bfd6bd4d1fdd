"""Start the services as child processes on free loopback ports (the demo, bench and tests use this)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator

_LISTENING = re.compile(r"listening on (\S+:\d+)")


@contextlib.contextmanager
def local_service(module: str, args: list[str], *, name: str, echo: bool = True, start_timeout: float = 120.0,
                  env: dict[str, str] | None = None, port: int = 0,
                  process: list[subprocess.Popen] | None = None) -> Iterator[str]:
    """Run `python -m module serve --port PORT ARGS` (0 = a free port); yield its address once it listens; stop it
    on exit. `process`, if given, receives the child process (tests kill it)."""
    cmd = [sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if process is not None:
        process.append(proc)
    found = threading.Event()
    address: list[str] = []

    def pump() -> None:
        for line in proc.stdout:
            if not found.is_set() and (m := _LISTENING.search(line)):
                address.append(m.group(1))
                found.set()
            if echo:
                sys.stderr.write(f"  [{name}] {line}")
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not found.wait(start_timeout) or not address:
            raise RuntimeError(f"{name} did not start: `{' '.join(cmd)}` exited with {proc.poll()}")
        yield address[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def local_target(args: list[str] = (), **kwargs) -> contextlib.AbstractContextManager[str]:
    return local_service("dspark_grpc.target_service.cli", list(args), name="target", **kwargs)


def local_drafter(args: list[str] = (), **kwargs) -> contextlib.AbstractContextManager[str]:
    return local_service("dspark_grpc.draft_service.cli", list(args), name="draft", **kwargs)
