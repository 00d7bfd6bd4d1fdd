"""Continuous batching of model steps submitted from many threads.

Callers block in `submit(job)`; one worker thread runs whatever is queued when the model becomes free as one
batch (`run_batch(jobs) -> results`, in order), up to `max_rows` rows. A lone job runs at once, so a single
session pays only a thread hand-off; under load, sessions that step at the same time share one pass over the
weights. A batch that raises is re-run one job at a time, so one bad job fails alone.

All torch work of a service should run on this one worker: `submit(job, then=...)` runs a job's own
post-processing (acceptance, building a draft) right after its batch, and `call(fn)` runs any other computation
between batches. A second thread that runs parallel torch ops gets an OpenMP team of its own, and with more
OpenMP threads than cores libgomp stops spinning between parallel regions: every forward then costs ~25 % more
on 2 cores (measured: 1-row SmolLM2 forward 33 -> 43 ms; docs/PERFORMANCE.md).

Sessions come back at slightly different times after a batch (each accepts, commits and answers its client
first). Taking only the first to return would split them into alternating half batches, so the worker waits up
to `gather` x the last batch's seconds for every session (`session(job)`) seen in the last two batches to queue
its next job. A session that went away costs that wait at most twice. Without `session` it never waits. A session
known to be busy elsewhere until its next job (`away`: waiting for its drafter) is not waited for.

A caller that knows which sessions are about to submit (the sessions of one speculative round, each submitting from
its own thread) says so with `expect`: the next batch then waits for all of them (up to a bound), so the round runs
as one forward whatever the threads' timing.

`inline()` True: a job submitted while the batcher is idle (nothing queued or running, no other session expected or
seen in the last two batches) runs on the submitting thread, as a batch of one. Waking the worker and being woken
back are two thread switches, each a few hundred microseconds on a small VM whose idle vCPU must be woken too.
Only for work that may run on any thread (torch work on one thread: a second OpenMP team is the cost above).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

J = TypeVar("J")
R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class BatchInfo:
    """The forward a job ran in: how many jobs, rows and seconds it had."""

    jobs: int
    rows: int
    seconds: float


@dataclass
class _Ticket(Generic[J, R]):
    job: J
    rows: int
    done: threading.Event
    session: Hashable
    then: Callable[[R], Any] | None = None  # the job's post-processing, on the worker, after its batch
    call: Callable[[], Any] | None = None  # not a job: a computation to run alone on the worker
    future: Future | None = None  # submit_future's: completed with the result instead of a waiting caller
    result: Any = None
    error: BaseException | None = None
    info: BatchInfo | None = None


class StepBatcher(Generic[J, R]):
    def __init__(self, run_batch: Callable[[list[J]], Sequence[R]], rows: Callable[[J], int] = lambda job: 1,
                 max_rows: int = 512, name: str = "step-batcher",
                 on_batch: Callable[[BatchInfo], None] | None = None, gather: float = 0.25,
                 session: Callable[[J], Hashable] | None = None,
                 clock: Callable[[], float] = time.perf_counter, inline: Callable[[], bool] | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.run_batch, self.rows, self.max_rows, self.on_batch = run_batch, rows, max_rows, on_batch
        self.gather, self.session, self.clock = gather, session, clock
        self._last_seconds = 0.0
        self._last_end = float("-inf")  # when the last batch ended (clock)
        self._recent: list[set] = [set(), set()]  # sessions of the last two batches
        self._expected: dict[Hashable, float] = {}  # session -> until when the next batch waits for it (`expect`)
        self._away: set[Hashable] = set()  # sessions not gathered for until they queue again (`away`)
        self._queue: list[_Ticket[J, R]] = []
        self._busy = False  # a batch is running (on the worker or inline)
        self.inline, self.inlined = inline, 0  # (how many jobs ran inline)
        self._cv = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name=name, daemon=True)
        self._worker.start()

    def submit(self, job: J, then: Callable[[R], T] | None = None) -> tuple[R | T, BatchInfo]:
        """Run `job` in the next batch; blocks until it ran. Re-raises the job's own error. `then(result)`, if
        given, runs on the worker right after the batch and its return value replaces the result."""
        ticket: _Ticket[J, R] = _Ticket(job, max(1, int(self.rows(job))), threading.Event(),
                                        self.session(job) if self.session is not None else None, then)
        if not self._run_inline(ticket):
            self._wait(ticket)
        elif ticket.error is not None:
            raise ticket.error
        assert ticket.info is not None
        return ticket.result, ticket.info

    def submit_future(self, job: J) -> Future:
        """Queue `job` for the next batch without waiting: the future gets its result (or error) when it ran."""
        future: Future = Future()
        ticket: _Ticket[J, R] = _Ticket(job, max(1, int(self.rows(job))), threading.Event(),
                                        self.session(job) if self.session is not None else None, future=future)
        self._queue_ticket(ticket)
        return future

    def expect(self, sessions: Iterable[Hashable], within_s: float) -> None:
        """The next batch waits, for up to `within_s`, until each of `sessions` has queued a job (or is
        `unexpect`ed: a caller whose step failed before it submitted)."""
        with self._cv:
            until = self.clock() + within_s
            for session in sessions:
                self._expected[session] = until
            self._cv.notify()

    @property
    def last_seconds(self) -> float:
        """Seconds the last batch took (0 before the first)."""
        return self._last_seconds

    def queued(self) -> int:
        """Jobs and calls waiting for the worker."""
        with self._cv:
            return len(self._queue)

    def away(self, session: Hashable) -> None:
        """`session` is busy elsewhere (e.g. waiting for its drafter) until it queues its next job: batches do not
        gather-wait for it meanwhile."""
        with self._cv:
            self._away.add(session)
            self._cv.notify()

    def unexpect(self, session: Hashable) -> None:
        with self._cv:
            if self._expected.pop(session, None) is not None:
                self._cv.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the worker between batches (not batched); blocks until it ran; re-raises its error."""
        ticket: _Ticket[J, R] = _Ticket(None, 0, threading.Event(), None, call=fn)  # type: ignore[arg-type]
        self._wait(ticket)
        return ticket.result

    def wait_for_return(self, within_s: float) -> bool:
        """For a long computation on the worker (between two of its slices): wait up to `within_s` for a session of
        the last batch, if it ended less than a batch's time ago, to queue its next job. True when a job is queued
        (the computation should let it run first)."""
        def job_queued() -> bool:
            return any(t.call is None for t in self._queue)

        with self._cv:
            if not job_queued() and self._recent[1] and self.clock() - self._last_end <= self._last_seconds:
                self._cv.wait_for(lambda: job_queued() or self._closed, within_s)
            return job_queued()

    def claim(self, session: Hashable) -> bool:
        """Take the batcher for one job of `session` that its caller runs itself, now or as it completes (e.g. a
        request sent whose reply comes back on another thread): True when the batcher is idle (nothing queued or
        running, no other session expected or seen in the last two batches), which it then stays, as if running
        a batch, until `unclaim`."""
        with self._cv:
            now = self.clock()
            others = {s for s, until in self._expected.items() if until > now} | self._recent[0] | self._recent[1]
            if self._closed or self._busy or self._queue or others - {session}:
                return False
            self._busy = True
            self._expected.pop(session, None)
            return True

    def unclaim(self, session: Hashable, seconds: float | None = None) -> None:
        """The claimed job is done: it counts as a batch of one `session` that took `seconds` (None: `_run` counted
        it already)."""
        with self._cv:
            if seconds is not None:
                self._last_seconds, self._last_end = seconds, self.clock()
                if self.session is not None:
                    self._recent = [self._recent[1], {session}]
            self._busy = False
            self._cv.notify_all()

    def _run_inline(self, ticket: _Ticket[J, R]) -> bool:
        """Run the ticket's job on this thread if the batcher is idle (see `inline`); whether it ran."""
        if self.inline is None or not self.inline() or not self.claim(ticket.session):
            return False
        try:
            self._finish([ticket])
            self.inlined += 1
        finally:
            self.unclaim(ticket.session)
        return True

    def _wait(self, ticket: _Ticket[J, R]) -> None:
        self._queue_ticket(ticket)
        ticket.done.wait()
        if ticket.error is not None:
            raise ticket.error

    def _queue_ticket(self, ticket: _Ticket[J, R]) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the step batcher is closed")
            self._queue.append(ticket)
            self._expected.pop(ticket.session, None)
            self._away.discard(ticket.session)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._worker.join(timeout=5)

    def _take(self) -> list[_Ticket[J, R]] | None:
        with self._cv:
            while (not self._queue or self._busy) and not self._closed:
                self._cv.wait()
            if not self._queue:
                return None
            self._busy = True
            if self._queue[0].call is not None:
                return [self._queue.pop(0)]
            recent = self._recent[0] | self._recent[1]
            gather_until = self.clock() + self.gather * self._last_seconds
            while not self._closed:
                now = self.clock()
                self._expected = {s: until for s, until in self._expected.items() if until > now}
                waits = list(self._expected.values())
                if now < gather_until and not recent - self._away <= {t.session for t in self._queue}:
                    waits.append(gather_until)
                if not waits:
                    break
                self._cv.wait(max(waits) - now)
            batch = [self._queue.pop(0)]
            rows = batch[0].rows
            while self._queue and self._queue[0].call is None and rows + self._queue[0].rows <= self.max_rows:
                rows += self._queue[0].rows
                batch.append(self._queue.pop(0))
            return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                if batch[0].call is not None:
                    self._run_call(batch[0])
                else:
                    self._finish(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _finish(self, batch: list[_Ticket[J, R]]) -> None:
        """Run a batch, its jobs' `then`, and hand each result over."""
        self._run(batch)
        if len(batch) > 1 and any(t.error is not None for t in batch):
            for t in batch:  # isolate the failing job(s)
                t.error = None
                self._run([t])
        for t in batch:
            if t.then is not None and t.error is None:
                try:
                    t.result = t.then(t.result)
                except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
                    t.error = e
            t.done.set()
            if t.future is not None:
                if t.error is not None:
                    t.future.set_exception(t.error)
                else:
                    t.future.set_result(t.result)

    @staticmethod
    def _run_call(ticket: _Ticket[J, R]) -> None:
        try:
            ticket.result = ticket.call()  # type: ignore[misc]
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread
            ticket.error = e
        ticket.done.set()

    def _run(self, batch: list[_Ticket[J, R]]) -> None:
        t0 = self.clock()
        try:
            results = self.run_batch([t.job for t in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} jobs")
        except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
            for t in batch:
                t.error = e
            return
        self._last_end = self.clock()
        info = BatchInfo(len(batch), sum(t.rows for t in batch), self._last_end - t0)
        self._last_seconds = info.seconds
        if self.session is not None:
            self._recent = [self._recent[1], {t.session for t in batch}]
        for t, r in zip(batch, results, strict=True):
            t.result, t.info = r, info
        if self.on_batch is not None:
            try:
                self.on_batch(info)
            except Exception:  # noqa: BLE001 - telemetry must not fail a step
                pass
