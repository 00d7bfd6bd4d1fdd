"""The profilers that make the cost tables (dspark_grpc.speculation.cost_table) on this machine: the target's verify
forwards (`target_cost_tables`) and the drafter's proposals (`drafter_cost_tables`), each one table per lane count,
cached on disk under its key."""

from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from dspark_grpc.runtime.models.linear import matmul_kind
from dspark_grpc.speculation.cost_table import (
    DEFAULT_SIZES,
    CostKey,
    CostTable,
    lanes_problem,
    load_or_profile,
    spot_check_problem,
)

if TYPE_CHECKING:
    from dspark_grpc.runtime.models.drafter import BlockOutput, Drafter
    from dspark_grpc.runtime.models.transformer import Transformer

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
    time, or e.g. time.process_time (CPU seconds of the process: bench/engine_bench.py on a shared machine)."""
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
    from dspark_grpc.runtime.models.decode import prefill, tree_input

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
        seconds = list(t.seconds) if floor is None else [max(s, floor.predict(size))
                                                          for size, s in zip(t.sizes, t.seconds, strict=True)]
        out.append(CostTable(t.key, t.sizes, seconds, measured=t.measured, info=t.info))
        floor = out[-1]
    return out


def drafter_cost_tables(drafter: Drafter, cache_dir: str | Path | None, name: str, target_model: str,
                        sizes: Sequence[int], proposal: Callable[[BlockOutput, int, int], object],
                        lanes: Sequence[int] = (1, 2, 4), context: int = 128, repeats: int = 3,
                        max_seconds: float = 2.0) -> list[CostTable]:
    """One proposal cost table per lane count, loaded from `cache_dir` when an earlier start saved it (None: always
    profile, save nothing). `name` names the drafter and what else its proposals depend on (key.drafter);
    `target_model` is its target's fingerprint.

    sizes = proposal budgets; `proposal(out, anchor, size)` builds one session's proposal of that size from a
    drafter pass's block output. seconds[i] = one round in which `lanes` sessions share a drafter pass and then each
    builds its proposal of sizes[i]: the pass (timed at each lane count) + lanes x one session's proposal (timed per
    size). Sessions build theirs in their own threads, so the sum is an upper bound where those overlap. Each table
    stays monotone in size, and seconds never fall as lanes grow. Profiling runs `repeats` rounds after a warm-up,
    fewer past `max_seconds`."""
    lanes = sorted(set(lanes))
    dtype = str(drafter.dtype).removeprefix("torch.")
    keys = [draft_key(target_model, name, dtype, drafter.device, context=context, lanes=n, matmul=matmul_kind(drafter))
            for n in lanes]
    measured: dict[int, CostTable] = {}

    def profile(key: CostKey) -> CostTable:  # the first table the cache lacks measures them all
        if not measured:
            pass_s, post_s, info = _time_drafter(drafter, lanes, sizes, proposal, context, repeats, max_seconds)
            floor = [0.0] * len(sizes)
            for k, n in zip(keys, lanes, strict=True):
                floor = [max(f, pass_s[n] + n * post_s[size]) for f, size in zip(floor, sizes, strict=True)]
                measured[n] = CostTable(k, sizes, floor, info=info)
        return measured[key.lanes]

    return [load_or_profile(cache_dir, key, lambda key=key: profile(key)) for key in keys]


def _time_drafter(drafter: Drafter, lanes: list[int], sizes: Sequence[int],
                  proposal: Callable[[BlockOutput, int, int], object], context: int, repeats: int,
                  max_seconds: float) -> tuple[dict[int, float], dict[int, float], dict]:
    """Median seconds of a drafter pass by lanes, and of one session's proposal by size, over `context` random
    context rows per session."""
    gen = torch.Generator().manual_seed(0)
    c = drafter.config
    contexts = []
    for _ in range(max(lanes)):
        ctx = drafter.new_context(max_length=context + c.block_size, initial_capacity=context + c.block_size)
        ctx.append(torch.randn(context, len(c.target_layer_ids), c.target_hidden_size, generator=gen), 0)
        contexts.append(ctx)
    anchor = int(torch.randint(c.vocab_size, (1,), generator=gen))

    def sync() -> None:
        _sync(drafter.device)

    pass_s, pass_info = time_sizes(lambda n: drafter.forward_blocks([(x, anchor) for x in contexts[:n]]), lanes,
                                   repeats, sync=sync, max_seconds=max_seconds / 2)
    out = drafter.forward_block(contexts[0], anchor)
    post_s, post_info = time_sizes(lambda size: proposal(out, anchor, size), sizes, repeats, sync=sync,
                                   max_seconds=max_seconds / 2)
    info = {"pass": pass_info, "proposal": post_info, "pass_seconds": dict(zip(lanes, pass_s, strict=True)),
            "round": "pass(lanes) + lanes x proposal(size)"}
    return dict(zip(lanes, pass_s, strict=True)), dict(zip(sizes, post_s, strict=True)), info
