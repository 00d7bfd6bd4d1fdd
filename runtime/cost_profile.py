"""Profilers that make the cost tables (dspark_grpc.speculation.cost_table) of a target and a drafter here."""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from dspark_grpc.speculation.cost_table import (
    DEFAULT_SIZES,
    CostKey,
    CostTable,
    lanes_problem,
    load_or_profile,
    spot_check_problem,
)

from .linear import matmul_kind

if TYPE_CHECKING:
    from .transformer import Transformer

log = logging.getLogger("dspark.cost")


def device_name(device: torch.device | str) -> str:
    """The device as a cache key: type and index plus the hardware model (a table from another GPU or CPU
    model must not be reused)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} {torch.cuda.get_device_name(index)}"
    if device.type == "cpu":
        return f"cpu {_cpu_model()}".strip()
    return str(device)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def target_key(model: Transformer, context: int = 128, lanes: int = 1) -> CostKey:
    return CostKey(kind="verify", model=model.config.fingerprint(), dtype=str(model.dtype).removeprefix("torch."),
                   threads=torch.get_num_threads(), device=device_name(model.device), context=context, lanes=lanes,
                   matmul=matmul_kind(model))


def draft_key(model_fingerprint: str, drafter: str, dtype: str, device: torch.device | str, context: int = 128,
              lanes: int = 1, matmul: str = "") -> CostKey:
    """Key of a drafter table: `drafter` names the drafter and its weights (e.g. "dspark:<fingerprint>",
    "ngram"); model_fingerprint is its target's."""
    return CostKey(kind="draft", model=model_fingerprint, drafter=drafter, dtype=dtype, threads=torch.get_num_threads(),
                   device=device_name(device), context=context, lanes=lanes, matmul=matmul)


def time_sizes(run: Callable[[int], object], sizes: Sequence[int], repeats: int,
               sync: Callable[[], None] = lambda: None, warmup: int = 1,
               max_seconds: float | None = None,
               clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], dict[str, Any]]:
    """Median seconds of `run(size)` per size, and what was done. Sizes are interleaved round by round (a slow
    drift of the machine then spreads over every size instead of biasing the last ones); `warmup` untimed
    rounds first. Past `max_seconds` no new round starts (at least one timed round always runs). `clock`: wall
    time, or e.g. time.process_time (CPU seconds of the process: runtime/engine_bench.py on a shared machine)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    times: dict[int, list[float]] = {s: [] for s in sizes}
    t_start = time.perf_counter()
    rounds = 0
    for round_ in range(warmup + repeats):
        if rounds and max_seconds is not None and time.perf_counter() - t_start > max_seconds:
            break
        for s in sizes:
            sync()
            t0 = clock()
            run(s)
            sync()
            if round_ >= warmup:
                times[s].append(clock() - t0)
        rounds += round_ >= warmup
    info = {"repeats": rounds, "warmup": warmup, "wall_seconds": round(time.perf_counter() - t_start, 3),
            "created": round(time.time())}
    return [statistics.median(times[s]) for s in sizes], info


def _check_sizes(sizes: Sequence[int]) -> list[int]:
    out = sorted({int(s) for s in sizes})
    if not out or out[0] < 1:
        raise ValueError(f"sizes must be >= 1, got {list(sizes)}")
    return out


def profile_target(model: Transformer, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5, context: int = 128,
                   seed: int = 0, max_seconds: float | None = None, lanes: int = 1,
                   clock: Callable[[], float] = time.perf_counter) -> CostTable:
    """Time one batched forward in which `lanes` sessions each verify a chain of `size` rows on top of `context`
    committed rows (random tokens, fresh caches): the median of `repeats` per size after one warm-up round.
    Size 1 (a plain AR step: one root, no draft) is always measured. Rows verified are what the forward's cost
    depends on, so a tree of N nodes costs about what a chain of N does; the commit after it is a few row
    copies and not timed."""
    from .decode import prefill, tree_input

    if lanes < 1:
        raise ValueError(f"lanes must be >= 1, got {lanes}")
    sizes = _check_sizes([1, *sizes])
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(lanes):
        prompt = torch.randint(vocab, (max(context, 1),), generator=gen).tolist()
        rows = len(prompt) + sizes[-1]
        cache = model.new_cache(max_length=rows, initial_capacity=rows)
        if context:
            prefill(model, cache, prompt)
        caches.append(cache)
    drafts = torch.randint(vocab, (sizes[-1],), generator=gen).tolist()

    def run(size: int) -> None:
        outs = model.forward_batch([tree_input(c, drafts[:size], list(range(-1, size - 1))) for c in caches])
        for out in outs:
            out.logits.argmax(-1).tolist()  # what the engine does next; also waits for the device
        for c in caches:
            c.discard()

    seconds, info = time_sizes(run, sizes, repeats, sync=lambda: _sync(model.device), max_seconds=max_seconds,
                               clock=clock)
    return CostTable(target_key(model, context, lanes), sizes, seconds, info=info)


def target_cost_tables(model: Transformer, cache_dir: str | Path | None, lanes: Sequence[int] = (1, 2, 4, 8),
                       sizes: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 3, max_seconds: float = 4.0,
                       progress: Callable[[str], None] | None = None,
                       spot_check: Callable[[], float] | None = None) -> list[CostTable]:
    """One table per lane count, each loaded from `cache_dir` when an earlier start profiled it.

    Cached tables are checked first: tables that are not monotone in sessions, or whose 1-session 1-row forward is
    far from `spot_check()` (seconds of that forward measured now; default: a quick timing of the model), are
    profiled again and overwritten, with one line through `progress` saying why. Fresh tables that are still not
    monotone in sessions are made so (a running max over lane counts), also said in one line."""
    say = progress or log.warning  # a table's problem is said even when progress is not
    keys = [target_key(model, lanes=n) for n in lanes]
    fresh: set[int] = set()

    def profile(n: int) -> CostTable:
        fresh.add(n)
        if progress:
            progress(f"profiling target forwards: {n} session(s) x {list(sizes)} rows")
        return profile_target(model, sizes, repeats=repeats, lanes=n, max_seconds=max_seconds)

    tables = [load_or_profile(cache_dir, key, lambda n=key.lanes: profile(n)) for key in keys]
    if len(fresh) < len(tables):  # some came from the cache: do they still describe this machine?
        if spot_check is None:
            def spot_check() -> float:
                return profile_target(model, [1], repeats=5, lanes=1, max_seconds=2.0).seconds[0]
        problem = lanes_problem(tables) or spot_check_problem(tables[0], spot_check())
        if problem:
            say(f"the cached cost tables in {cache_dir} look wrong ({problem}): profiling again")
            fresh.clear()
            tables = [load_or_profile(cache_dir, key, lambda n=key.lanes: profile(n), refresh=True) for key in keys]
    problem = lanes_problem(tables)
    if problem:
        say(f"the cost tables are not monotone in sessions ({problem}; was the machine busy?): using the running "
            "max over session counts")
        tables = _monotone_in_lanes(tables)
        for t in tables:
            if cache_dir is not None:
                t.save(Path(cache_dir) / t.key.file_name())
    return tables


def _monotone_in_lanes(tables: list[CostTable]) -> list[CostTable]:
    out, floor = [], None
    for t in sorted(tables, key=lambda t: t.key.lanes):
        seconds = list(t.seconds) if floor is None else [max(s, floor.profiled(size))
                                                          for size, s in zip(t.sizes, t.seconds, strict=True)]
        out.append(CostTable(t.key, t.sizes, seconds, measured=t.measured, info=t.info))
        floor = out[-1]
    return out


def profile_drafter(propose: Callable[[int], object], key: CostKey, sizes: Sequence[int] = DEFAULT_SIZES,
                    repeats: int = 5, sync: Callable[[], None] = lambda: None,
                    max_seconds: float | None = None) -> CostTable:
    """Time `propose(budget)` (one proposal of that budget/block size, any proposer, returning once its result
    is on the host) per size: the median of `repeats` after one warm-up round. The caller sets the session
    up (context rows appended) and says in `key` what was timed."""
    if key.kind != "draft":
        raise ValueError(f"a drafter table needs a key of kind 'draft', got {key.kind!r}")
    sizes = _check_sizes(sizes)
    seconds, info = time_sizes(propose, sizes, repeats, sync=sync, max_seconds=max_seconds)
    return CostTable(key, sizes, seconds, info=info)
