"""Step-cost tables for the scheduler: seconds per forward as a function of its size, profiled at start-up.

A `CostTable` maps a size (target: rows verified in one forward; drafter: the proposal budget) to seconds:
the median of a few timed repeats per measured size, forced non-decreasing in size by a running max, linearly
interpolated between measured sizes and extrapolated past the last one. Online, `observe(size, seconds)` keeps a
per-size EMA of measured/profiled (prior 1, clamped) and `predict` multiplies the profile by it, so a table
profiled on an idle machine follows the machine it actually runs on.

Tables are cached on disk (`load_or_profile`) under a hash of their `CostKey`: model fingerprint, drafter,
dtype, threads, device, kind, context and lanes. A second start with the same key loads the table without
profiling; any change of key (e.g. another thread count) profiles again.

Lanes (concurrent sessions in one batched forward) are a key field, so each lane count gets its own 1-D table
(rows per session -> seconds per forward).

Torch-free: the client's planner holds tables; the profilers live in dspark_grpc.runtime.cost_profile.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import tempfile
import threading
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
    alpha: float = 0.2  # EMA weight of a new measured/profiled ratio
    ratio_bounds: tuple[float, float] = (0.25, 4.0)
    # size -> (EMA of measured/profiled, observations); the online correction
    corrections: dict[int, tuple[float, int]] = field(default_factory=dict)
    # how it was made (repeats, warm-up, wall seconds, unix time); informational
    info: dict[str, Any] = field(default_factory=dict, compare=False)
    _curve: tuple[list[int], list[float]] | None = field(default=None, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

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
        self.corrections = {int(k): (float(r), int(n)) for k, (r, n) in self.corrections.items()}

    # -- prediction ---------------------------------------------------------------------------------

    def profiled(self, size: float) -> float:
        """The profile's seconds at `size`, without the online correction."""
        return _interpolate(self.sizes, self.seconds, size)

    def ratio(self, size: float) -> float:
        """The online correction at `size`: the EMA of the nearest observed sizes (interpolated between them),
        1.0 before any observation."""
        with self._lock:
            return self._ratio(size)

    def _ratio(self, size: float) -> float:
        if not self.corrections:
            return 1.0
        observed = sorted(self.corrections)
        return _interpolate(observed, [self.corrections[s][0] for s in observed], size, extrapolate=False)

    def predict(self, size: float) -> float:
        """Seconds for a forward of `size`: the profile times the correction, still non-decreasing in size."""
        with self._lock:
            if not self.corrections:
                return self.profiled(size)
            if self._curve is None:
                points = sorted(set(self.sizes) | set(self.corrections))
                self._curve = points, _running_max([self.profiled(s) * self._ratio(s) for s in points])
            return _interpolate(*self._curve, size)

    def observe(self, size: int, seconds: float) -> None:
        """Fold one measured forward of `size` into the per-size EMA of measured/profiled."""
        size = int(size)
        base = self.profiled(size)
        if size < 1 or not seconds >= 0.0 or base <= 0.0:
            return
        lo, hi = self.ratio_bounds
        r = min(max(seconds / base, lo), hi)
        with self._lock:
            ema, n = self.corrections.get(size, (1.0, 0))
            self.corrections[size] = ((1.0 - self.alpha) * ema + self.alpha * r, n + 1)
            self._curve = None

    def reset_corrections(self) -> None:
        with self._lock:
            self.corrections.clear()
            self._curve = None

    # -- JSON ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "key": dataclasses.asdict(self.key),
            "sizes": list(self.sizes),
            "seconds": list(self.seconds),
            "measured": list(self.measured or self.seconds),
            "alpha": self.alpha,
            "ratio_bounds": list(self.ratio_bounds),
            "corrections": {str(k): [r, n] for k, (r, n) in sorted(dict(self.corrections).items())},
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
            alpha=float(d.get("alpha", 0.2)),
            ratio_bounds=tuple(d.get("ratio_bounds", (0.25, 4.0))),
            corrections={int(k): (v[0], v[1]) for k, v in d.get("corrections", {}).items()},
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


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float, extrapolate: bool = True) -> float:
    """Piecewise-linear through (xs, ys); flat below xs[0]; past xs[-1] the last segment's line (if
    `extrapolate`, else flat). Non-decreasing ys give a non-decreasing result."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0] if x <= xs[0] else ys[-1]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        if not extrapolate:
            return ys[-1]
        i -= 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


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
            a, b = fewer.profiled(size), more.profiled(size)
            if b < a * (1.0 - noise):
                return (f"{more.key.lanes} sessions x {size} rows cost {b * 1e3:.1f} ms but {fewer.key.lanes} "
                        f"x {size} cost {a * 1e3:.1f} ms")
    return None


def spot_check_problem(table: CostTable, measured_seconds: float, factor: float = 1.6) -> str | None:
    """Why `table` does not describe this machine now, or None: its smallest forward is more than `factor` off a
    fresh measurement of that forward."""
    expected = table.profiled(table.sizes[0])
    if expected <= 0 or measured_seconds <= 0:
        return None
    ratio = measured_seconds / expected
    if 1.0 / factor <= ratio <= factor:
        return None
    return (f"a {table.sizes[0]}-row forward of {table.key.lanes} session(s) measures {measured_seconds * 1e3:.1f} "
            f"ms now, the table says {expected * 1e3:.1f} ms")


def default_cache_dir() -> Path:
    """$DSPARK_COST_CACHE, else $XDG_CACHE_HOME/dspark-grpc/cost-tables (~/.cache/...)."""
    if os.environ.get("DSPARK_COST_CACHE"):
        return Path(os.environ["DSPARK_COST_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark-grpc" / "cost-tables"
