"""Refused work is logged at a bounded rate: one line per kind (what, why, stream) per interval, the repeats counted
into the next line (a fuzzer's millions of bad operations must not become millions of log lines). Fake clock."""

from __future__ import annotations

import logging

from dspark_grpc.serving import refusal_log
from dspark_grpc.serving.refusal_log import RefusalLog


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def make(interval_s: float = 10.0):
    now = [0.0]
    logger = logging.getLogger(f"test.refusals.{id(now)}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    lines = Lines()
    logger.addHandler(lines)
    return RefusalLog(logger, interval_s=interval_s, clock=lambda: now[0]), now, lines.lines


def test_a_flood_of_one_refusal_is_one_line_per_interval_with_its_count():
    log, now, lines = make()
    for i in range(100_000):
        now[0] = i * 1e-4  # 10 s of refusals
        log.refused(("propose", "INVALID_ARGUMENT", 1), "session op propose refused: INVALID_ARGUMENT: bad")
    assert lines == ["session op propose refused: INVALID_ARGUMENT: bad"]
    now[0] = 10.0
    log.refused(("propose", "INVALID_ARGUMENT", 1), "session op propose refused: INVALID_ARGUMENT: bad")
    assert len(lines) == 2 and lines[1].endswith("(and 99999 more like it in the 10 s before)")


def test_kinds_are_apart_and_a_quiet_kind_logs_at_once():
    log, now, lines = make()
    log.refused(("open", "RESOURCE_EXHAUSTED", 1), "a")
    log.refused(("open", "RESOURCE_EXHAUSTED", 2), "b")  # another stream
    log.refused(("open", "INVALID_ARGUMENT", 1), "c")  # another reason
    log.refused(("open", "RESOURCE_EXHAUSTED", 1), "a again")  # within the interval: counted
    assert lines == ["a", "b", "c"]


def test_memory_stays_bounded_under_many_streams(monkeypatch):
    monkeypatch.setattr(refusal_log, "MAX_KINDS", 8)
    log, now, lines = make()
    for stream in range(100):
        log.refused(("append", "NOT_FOUND", stream), f"stream {stream}")
        log.refused(("append", "NOT_FOUND", stream), f"stream {stream} again")
    assert len(log._kinds) <= 8
    assert len([line for line in lines if line.startswith("stream")]) == 100  # each stream's first refusal said
    assert any("1 more refused" in line for line in lines)  # a forgotten kind's count is not lost silently


def test_many_threads_refusing_past_the_kind_limit_lose_nothing(monkeypatch):
    """The session workers share one log: refusals from 8 threads at once, past the kind limit (kinds forgotten while
    others are added), raise nothing and every refusal is either a line or counted in one."""
    import sys
    import threading

    monkeypatch.setattr(refusal_log, "MAX_KINDS", 16)
    log, now, lines = make(interval_s=1.0)
    errors: list[BaseException] = []
    per_thread, threads = 2_000, 8

    def refuse(t: int) -> None:
        try:
            for i in range(per_thread):
                now[0] = i * 0.01
                log.refused(("op", t, i % 40), f"refused {t} {i}")
        except BaseException as e:  # noqa: BLE001 - any error a worker thread would die of
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        workers = [threading.Thread(target=refuse, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    counted = sum(int(line.split(": ")[1].split()[0]) for line in lines if " more refused in the " in line)
    counted += sum(int(line.split("(and ")[1].split()[0]) for line in lines if "(and " in line)
    plain = sum(1 for line in lines if line.startswith("refused "))
    pending = sum(seen[1] for seen in log._kinds.values())
    assert plain + counted + pending == per_thread * threads
