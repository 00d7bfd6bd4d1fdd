"""The cost model: seconds of one forward as a function of its size, profiled at start-up.

A `CostTable` maps a size (target: rows verified per session in one forward; drafter: the proposal budget) to
seconds for one lane count (sessions in one batched forward): the median of a few timed repeats per measured size,
forced non-decreasing in size by a running max, linearly interpolated between measured sizes and extrapolated past
the last one.

Tables are cached on disk (`load_or_profile`) under a hash of their `CostKey`: model fingerprint, drafter,
dtype, threads, device, kind, context and lanes. A second start with the same key loads the table without
profiling; any change of key (e.g. another thread count) profiles again.

`VerifyCosts` reads the target's tables as published (one per lane count) and interpolates in rows and lanes.
What the tables cannot know (a busy machine, the drafter competing for the cores) the adaptive mode measures
(speculation/mode_chooser.py).

Torch-free: the planners hold these; the profilers live in dspark_grpc.serving.cost_profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark_grpc.protos.dspark.v1 import common_pb2

FORMAT_VERSION = 1
DEFAULT_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class CostKey:
    """What a table's numbers depend on. Equal keys share a cache file."""

    kind: str  # "verify" (target forward over N tree rows; N = 1 is a plain AR step) or "draft" (one proposal)
    model: str  # target model fingerprint (architecture shape)
    drafter: str = ""  # drafter name/fingerprint; "" for target tables
    dtype: str = "float32"
    threads: int = 0  # torch intra-op threads
    device: str = "cpu"
    context: int = 0  # committed rows the forwards attend to while profiling
    lanes: int = 1  # concurrent sessions per forward (the target profiles 1, 2, 4, 8; the drafter 1, 2, 4)
    matmul: str = ""  # how the projections run ("onednn-packed", "aten"): a table of one must not price the other

    def digest(self) -> str:
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def file_name(self) -> str:
        return f"{self.kind}-lanes{self.lanes}-{self.digest()[:20]}.json"


@dataclass
class CostTable:
    key: CostKey
    sizes: list[int]  # strictly increasing, >= 1
    seconds: list[float]  # non-decreasing (enforced); seconds[i] is the cost of a forward of sizes[i]
    measured: list[float] | None = None  # the raw medians before the running max (None: same as seconds)
    # how it was made (repeats, warm-up, wall seconds, unix time); informational
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        self.sizes = [int(s) for s in self.sizes]
        seconds = [float(s) for s in self.seconds]
        if not self.sizes or len(self.sizes) != len(seconds):
            raise ValueError(f"a cost table needs as many sizes as costs (>= 1), got {len(self.sizes)} and "
                             f"{len(seconds)}")
        if self.sizes[0] < 1 or any(a >= b for a, b in zip(self.sizes, self.sizes[1:], strict=False)):
            raise ValueError(f"sizes must be >= 1 and strictly increasing, got {self.sizes}")
        if any(not s >= 0.0 for s in seconds):  # also rejects NaN
            raise ValueError(f"costs must be >= 0 seconds, got {seconds}")
        if self.measured is None:
            self.measured = list(seconds)
        self.seconds = _running_max(seconds)

    def predict(self, size: float) -> float:
        """Seconds for a forward of `size`."""
        return _interpolate(self.sizes, self.seconds, size)

    # -- JSON ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "key": dataclasses.asdict(self.key),
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "measured": list(self.measured or self.seconds),
            "info": dict(self.info),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostTable:
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"cost table format {d.get('format')!r}, this code reads {FORMAT_VERSION}")
        return cls(
            key=CostKey(**d["key"]),
            sizes=d["sizes"],
            seconds=d["seconds"],
            measured=d.get("measured"),
            info=dict(d.get("info", {})),
        )

    def save(self, path: str | Path) -> None:
        """Write atomically (a temp file renamed over `path`), so a concurrent reader never sees half a table."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_proto(self) -> common_pb2.CostTable:
        return common_pb2.CostTable(lanes=self.key.lanes, sizes=self.sizes, seconds=self.seconds)

    def describe(self) -> str:
        return "  ".join(f"{s}:{t * 1e3:.2f}ms" for s, t in zip(self.sizes, self.seconds, strict=True))


def _running_max(values: Sequence[float]) -> list[float]:
    out, top = [], float("-inf")
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys); flat below xs[0]; past xs[-1] the last segment's line (flat for a single
    point). Non-decreasing ys give a non-decreasing result."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# -- the target's tables as published, and the online correction -------------------------------------------


class VerifyCosts:
    """The target's cost tables (GetModelInfoResponse.verify_costs): seconds of one forward of `lanes` sessions
    with `rows` rows each, interpolated in rows and lanes."""

    def __init__(self, tables: Sequence[common_pb2.CostTable]) -> None:
        self.tables = sorted(((t.lanes, list(t.sizes), list(t.seconds)) for t in tables if t.sizes), key=lambda x: x[0])

    def __bool__(self) -> bool:
        return bool(self.tables)

    def seconds(self, lanes: float, rows: float) -> float:
        assert self.tables, "no cost tables"
        lanes_known = [lanes_ for lanes_, _, _ in self.tables]
        per_lane = [_interpolate(sizes, secs, max(rows, 1.0)) for _, sizes, secs in self.tables]
        return _interpolate(lanes_known, per_lane, max(lanes, 1.0))


# -- cache ------------------------------------------------------------------------------------------


def load_or_profile(path_dir: str | Path | None, key: CostKey, profile_fn: Callable[[], CostTable],
                    refresh: bool = False) -> CostTable:
    """The table for `key`: read from `path_dir` if an earlier start saved it, else `profile_fn()` (saved
    there for the next start). path_dir None: always profile, save nothing. An unreadable or stale file
    (another format, another key), or any file when `refresh`, is profiled again and overwritten."""
    path = Path(path_dir) / key.file_name() if path_dir is not None else None
    if path is not None and path.exists() and not refresh:
        try:
            table = CostTable.load(path)
            if table.key == key:
                return table
        except (OSError, ValueError, KeyError, TypeError):
            pass
    table = profile_fn()
    if table.key != key:
        raise ValueError(f"the profiler made a table for {table.key}, not for {key}")
    if path is not None:
        table.save(path)
    return table


def lanes_problem(tables: Sequence[CostTable], noise: float = 0.1) -> str | None:
    """Why per-lane tables of one target contradict each other, or None: a forward of more sessions must not be
    cheaper than one of fewer with the same rows each (beyond `noise`), as in a table profiled while the machine
    was busy for the first lane counts and idle for the last."""
    ordered = sorted(tables, key=lambda t: t.key.lanes)
    for fewer, more in zip(ordered, ordered[1:], strict=False):
        for size in fewer.sizes:
            a, b = fewer.predict(size), more.predict(size)
            if b < a * (1.0 - noise):
                return (f"{more.key.lanes} sessions x {size} rows cost {b * 1e3:.1f} ms but {fewer.key.lanes} "
                        f"x {size} cost {a * 1e3:.1f} ms")
    return None


def spot_check_problem(table: CostTable, measured_seconds: float, factor: float = 1.6) -> str | None:
    """Why `table` does not describe this machine now, or None: its smallest forward is more than `factor` off a
    fresh measurement of that forward."""
    expected = table.predict(table.sizes[0])
    if expected <= 0 or measured_seconds <= 0:
        return None
    ratio = measured_seconds / expected
    if 1.0 / factor <= ratio <= factor:
        return None
    return (f"a {table.sizes[0]}-row forward of {table.key.lanes} session(s) measures {measured_seconds * 1e3:.1f} "
            f"ms now, the table says {expected * 1e3:.1f} ms")


def default_cache_dir(name: str = "cost-tables", env: str = "DSPARK_COST_CACHE") -> Path:
    """$`env`, else $XDG_CACHE_HOME/dspark-grpc/`name` (~/.cache/...): the cost tables by default; the target's
    compiled steps with ("compiled", "DSPARK_COMPILE_CACHE")."""
    if os.environ.get(env):
        return Path(os.environ[env])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark-grpc" / name
