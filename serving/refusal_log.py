"""Refused work is logged, but not once per refusal: a hostile or broken client can send millions of bad operations.
The first refusal of a kind (what was refused, why, on which stream) in an interval is one line; the rest of that
interval are counted and reported with the next line of that kind. Thread-safe: the services' session workers
refuse from several threads at once."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

MAX_KINDS = 4096  # kinds remembered at once; older quiet ones are forgotten first


class RefusalLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._kinds: dict[Hashable, list] = {}  # kind -> [start of its interval, refusals not logged since]
        self._lock = threading.Lock()

    def refused(self, kind: Hashable, line: str) -> None:
        with self._lock:
            self._refused(kind, line)

    def _refused(self, kind: Hashable, line: str) -> None:
        now = self.clock()
        seen = self._kinds.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return
        if seen is not None and seen[1]:
            line += f" (and {seen[1]} more like it in the {now - seen[0]:.0f} s before)"
        self.logger.info("%s", line)
        self._kinds.pop(kind, None)
        self._kinds[kind] = [now, 0]
        if len(self._kinds) > MAX_KINDS:
            self._forget(now)

    def _forget(self, now: float) -> None:
        for kind in [k for k, (start, suppressed) in self._kinds.items() if now - start >= self.interval_s]:
            start, suppressed = self._kinds.pop(kind)
            if suppressed:
                self.logger.info("%s: %d more refused in the %.0f s before", kind, suppressed, now - start)
        while len(self._kinds) > MAX_KINDS:  # all recent: the oldest interval goes, its count said
            kind = next(iter(self._kinds))
            start, suppressed = self._kinds.pop(kind)
            if suppressed:
                self.logger.info("%s: %d more refused in the %.0f s before", kind, suppressed, now - start)
