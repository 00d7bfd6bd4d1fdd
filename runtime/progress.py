"""Long work shows progress: a line every few seconds while a compile or a build runs."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


class still_working:
    """While the block runs, a line every `every_s` seconds says it is still at it and for how long."""

    def __init__(self, what: str, every_s: float, enabled: bool = True, clock: Callable[[], float] = time.monotonic,
                 say: Callable[[str], None] | None = None) -> None:
        self.what, self.every_s, self.enabled, self.clock = what, every_s, enabled, clock
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._done = threading.Event()

    def __enter__(self) -> still_working:
        if self.enabled:
            self._t0 = self.clock()
            self._thread = threading.Thread(target=self._tick, name="still-working", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(self.every_s):
            self.say(f"[dspark] still {self.what}: {self.clock() - self._t0:.0f} s so far")

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self.enabled:
            self._thread.join()
