"""A worker's forwards on all of its threads or on one, whichever is faster now.

A compiled step runs ~180 short parallel regions, each ending at a barrier of the OpenMP team. When another
process takes one of the cores, a thread of the team is descheduled and every barrier waits for it: a 1-row step
of the default target on 2 threads was ~11x slower with one core busy, and on one thread about as fast as on an idle
core (docs/PERFORMANCE.md). Which count wins depends on what else runs on the machine, so the worker measures: it
runs on `threads`, and now and then probes the other count in pairs of forwards: per row bucket, a forward on the
probed count, then the next forward of that bucket on the current count (as a bench interleaves what it compares: a
drift of the machine, or a few slow forwards before the probe, hits both sides alike; pairing by bucket, not by
turn, keeps a regular mix of row counts from putting each bucket on one side); the probe takes over when the median
of `probe_forwards` pairs says it is `margin` faster. A probe that loses doubles the time to the next one (up to
`max_interval_s`); on all threads, a slowdown of the forwards (`slowdown` x their level after the last decision: the
machine became busy) probes one thread at once.

Only for a model whose outputs do not depend on its thread count (`same_outputs_on_one_thread`): lossless
speculation compares a verify with AR steps that may have run on the other count. Drafts need no such check (a
draft is only a guess).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def row_bucket(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


class ThreadGovernor:
    def __init__(self, threads: int, set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.perf_counter, probe_forwards: int = 4,
                 min_interval_s: float = 2.0, max_interval_s: float = 60.0, margin: float = 0.1,
                 slowdown: float = 1.5, alpha: float = 0.2) -> None:
        assert threads >= 1 and probe_forwards >= 1 and 0 < margin < 1 and slowdown > 1
        self.threads, self.set_threads, self.clock = threads, set_threads, clock
        self.probe_forwards, self.margin, self.slowdown, self.alpha = probe_forwards, margin, slowdown, alpha
        self.min_interval_s, self.max_interval_s = min_interval_s, max_interval_s
        self.enabled = threads > 1
        self.current = threads  # the count forwards run on
        self.switches = 0  # decisions that changed the count
        self.probes = 0
        self._level: dict[tuple[int, int], float] = {}  # (count, row bucket) -> EMA of seconds per forward
        self._baseline: dict[int, float] = {}  # row bucket -> the current count's level after the last decision
        self._since_decision: dict[int, int] = {}  # row bucket -> forwards since the last decision
        self._interval = min_interval_s
        self._next_probe = clock() + min_interval_s
        self._probe: int | None = None  # the count being probed
        self._probe_ratios: list[float] = []  # probe / current seconds of paired forwards
        self._probe_seen = 0
        self._running = threads  # the count forwards run on now
        self._unpaired: dict[int, float] = {}  # row bucket -> seconds of a probe's forward on the probed count

    def run(self, forward: Callable[[], T], rows: int) -> T:
        """`forward()` on the thread count chosen now (call it on the worker thread that runs every forward)."""
        if not self.enabled:
            return forward()
        if self._probe is None and self.clock() >= self._next_probe:
            self._start_probe()
        bucket = row_bucket(rows)
        if self._probe is not None:  # the bucket's pair: its probed forward first, then its current one
            self._switch(self.current if bucket in self._unpaired else self._probe)
        t0 = self.clock()
        out = forward()
        self._observe(bucket, self.clock() - t0)
        return out

    def _start_probe(self) -> None:
        self._probe = 1 if self.current != 1 else self.threads
        self._probe_ratios, self._probe_seen, self._unpaired = [], 0, {}
        self.probes += 1

    def _switch(self, count: int) -> None:
        if count != self._running:
            self._running = count
            self.set_threads(count)

    def _observe(self, bucket: int, seconds: float) -> None:
        if self._probe is not None:
            self._probe_seen += 1
            if self._running == self._probe:
                self._unpaired[bucket] = seconds
            elif bucket in self._unpaired:
                self._probe_ratios.append(self._unpaired.pop(bucket) / seconds)
            self._ema((self._running, bucket), seconds)
            if len(self._probe_ratios) >= self.probe_forwards or self._probe_seen >= 8 * self.probe_forwards:
                self._decide()
            return
        self._ema((self.current, bucket), seconds)
        seen = self._since_decision[bucket] = self._since_decision.get(bucket, 0) + 1
        level = self._level[self.current, bucket]
        if seen == 4:
            self._baseline[bucket] = level
        elif seen > 4 and self.current == self.threads and level > self.slowdown * self._baseline[bucket]:
            self._next_probe = self.clock()

    def _decide(self) -> None:
        won = bool(self._probe_ratios) and statistics.median(self._probe_ratios) < 1 - self.margin
        if won:
            self.current, self.switches = self._probe, self.switches + 1
            self._interval = self.min_interval_s
        else:
            self._interval = min(2 * self._interval, self.max_interval_s)
        self._switch(self.current)
        self._probe = None
        self._baseline.clear()
        self._since_decision.clear()
        self._next_probe = self.clock() + self._interval

    def _ema(self, key: tuple[int, int], seconds: float) -> None:
        old = self._level.get(key)
        self._level[key] = seconds if old is None else old + self.alpha * (seconds - old)


@torch.no_grad()
def same_outputs_on_one_thread(model, threads: int, context: int = 40) -> bool:
    """Whether a prompt chunk, a 1-row step and a 4-row verify give bitwise the same logits on one thread as on
    `threads` (a throwaway cache; run it on the thread that runs the model's forwards)."""
    from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree

    prompt = torch.randint(model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    outputs, before = [], torch.get_num_threads()
    try:
        for count in (threads, 1):
            torch.set_num_threads(count)
            cache = model.new_cache(initial_capacity=context + 8)
            first, _ = prefill(model, cache, prompt)
            step, _ = verify_tree(model, cache, [int(first.argmax())], [-1])
            commit_path(cache, [0])
            tree, _ = verify_tree(model, cache, [int(step[0].argmax()), 5, 6, 7], [-1, 0, 1, 0])
            outputs.append([first, step, tree])
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(a, b) for a, b in zip(*outputs, strict=True))
