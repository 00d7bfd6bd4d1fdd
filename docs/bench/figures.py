"""`make figures`: the docs' benchmark suite, run on this machine, written as data, plots and tables.

From the repository root:

    .venv/bin/python docs/bench/figures.py           # the full suite into docs/figures/, then PERFORMANCE.md's
                                                      # current figures (make figures)
    .venv/bin/python docs/bench/figures.py --quick   # every section, small, into runs/figures-quick/ only
                                                      # (make figures QUICK=1)

Sections, in order: held-out chat and HumanEval at concurrency 1 (every mode and proposer, llama.cpp's AR on the same
GGUF where llama-cpp-python is installed), concurrency 1/4/16, the drafter round's phases (from the two concurrency-1
runs), the exact precision, a forward's cost by rows (the engine bench) and start-up (fresh caches, then warm). Each
writes, under the output folder: SECTION.json (the figure: host, commit, the shipped drafter's checksum, date, each
command with its data file, the table), SECTION.md (the table) and SECTION.png (the plot); a bench section also keeps
`dspark bench`'s own JSON (SECTION.bench.json), the engine bench its output (rows.engine_bench.txt). README.md there
collects the tables. Only a full, complete run into docs/figures/ rewrites docs/PERFORMANCE.md's current figures (the
blocks between its `<!-- figures:NAME begin/end -->` markers). The services' cost tables are kept in
.cache/figures/cost-tables; the compile cache is the services' own ($DSPARK_COMPILE_CACHE).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "docs" / "figures"
QUICK_OUT = ROOT / "runs" / "figures-quick"
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
CACHE = ROOT / ".cache" / "figures"
HELDOUT = "docs/prompts/heldout.jsonl"
HUMANEVAL = "humaneval"
AR = "ar"
C1_MODES = ("ar", "speculation", "speculation/proposer=dspark", "speculation/proposer=ngram", "adaptive")
MODES = ("ar", "speculation", "adaptive")
MODE_LABELS = {
    "ar": "AR",
    "speculation": "speculation, hybrid chain (the default proposer)",
    "speculation/proposer=dspark": "speculation, DSpark chain",
    "speculation/proposer=ngram": "speculation, prompt-lookup chain",
    "adaptive": "adaptive (the SDK's default mode)",
}
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx")
SECTIONS = ("heldout", "humaneval", "round", "concurrency", "exact", "rows", "startup")
TITLES = {
    "heldout": "Held-out chat, concurrency 1",
    "humaneval": "HumanEval, concurrency 1",
    "round": "The drafter round's phases",
    "concurrency": "Concurrency 1, 4 and 16",
    "exact": "The exact precision: AR and speculation",
    "rows": "A forward's cost by rows",
    "startup": "Start-up",
}
# the start-up section's caches
FRESH, WARM, SUITE_CACHES = "fresh (empty caches)", "warm (a restart keeping them)", "warm (the suite's caches)"
_SERVING = re.compile(r"\bSERVING on ")
_FAILED = re.compile(r"\bfailed to load: ")


@dataclass(frozen=True)
class Sizes:
    """How big each section runs: the full suite's defaults; `QUICK` the same code path, small."""

    heldout_prompts: int = 20
    humaneval_prompts: int = 40
    new_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 16)
    concurrency_prompts: int = 20
    repeat: int = 2
    exact_prompts: int = 20
    exact_tokens: int = 64
    rows: tuple[int, ...] = (1, 2, 4, 8, 16)
    rounds: int = 3
    repeats: int = 5
    fresh_starts: bool = True  # start-up with empty caches: the target's first start compiles its step for minutes


FULL = Sizes()
QUICK = replace(FULL, heldout_prompts=3, humaneval_prompts=3, new_tokens=16, concurrency=(1, 4),
                concurrency_prompts=4, repeat=1, exact_prompts=2, exact_tokens=16, rows=(1, 4), rounds=1, repeats=2,
                fresh_starts=False)


class SectionFailed(RuntimeError):
    pass


@dataclass
class Suite:
    """One run of the suite: where it writes, how big, what it was run on, and its clock."""

    out: Path
    sizes: Sizes
    quick: bool
    provenance: dict
    started: float
    llama_cpp: bool

    def say(self, line: str) -> None:
        print(f"[figures +{clock(time.perf_counter() - self.started)}] {line}", flush=True)

    def log(self, section: str) -> Path:
        """Where a section's commands' full output goes: beside a scratch run's figures, but not among the docs'."""
        logs = CACHE / "logs" if self.out == FIGURES.resolve() else self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        return logs / f"{section}.log"


def clock(seconds: float) -> str:
    """62.5 -> '01:02'; 3725 -> '1:02:05'."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def duration(seconds: float) -> str:
    """62.5 -> '1 min 2 s'."""
    return f"{int(seconds) // 60} min {int(seconds) % 60} s"


def sentences(parts: list[str]) -> str:
    """Notes joined as sentences: each ends with a full stop."""
    return " ".join(part if part.endswith((".", ")")) else part + "." for part in parts if part)


# --- provenance: host, commit, drafter, date -------------------------------------------------------------------------

def cpu_host(cpuinfo: str) -> dict:
    """The CPU's model name and whether it has each of CPU_FLAGS (amx: any amx_* flag), from /proc/cpuinfo's text."""
    lines = cpuinfo.splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    have = {flag: flag in flags for flag in CPU_FLAGS}
    have["amx"] = any(f.startswith("amx") for f in flags)
    return {"cpu_model": model, "cpu_flags": have, "amx_flags": sorted(f for f in flags if f.startswith("amx"))}


def host_info() -> dict:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    versions = {}
    for package in ("torch", "llama_cpp_python"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {**cpu_host(cpuinfo), "cpu_count": os.cpu_count(), "python": sys.version.split()[0],
            "platform": sys.platform, "versions": versions}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def drafter_checksum(directory: Path) -> dict:
    """The drafter in `directory`: its name, path (relative to the repository) and the sha256 of its two files."""
    return {"name": directory.name, "path": str(directory.relative_to(ROOT)),
            "sha256": {name: sha256(directory / name) for name in ("model.safetensors", "config.json")}}


def shipped_drafter() -> Path:
    """The drafter the draft service embeds (what `dspark bench` drafts with unless told otherwise)."""
    from dspark_grpc.draft_service.engine import EMBEDDED_DRAFTER  # torch: only here

    return Path(EMBEDDED_DRAFTER).resolve()


def provenance(quick: bool) -> dict:
    from dspark_grpc.bench.machine import git_commit

    return {"host": host_info(), "commit": git_commit() or "unknown", "drafter": drafter_checksum(shipped_drafter()),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": quick,
            "suite_command": "make figures" + (" QUICK=1" if quick else "")}


def host_line(p: dict) -> str:
    host = p["host"]
    flags = ", ".join(f"{flag} {'yes' if host['cpu_flags'].get(flag) else 'no'}" for flag in CPU_FLAGS)
    cpus = f", {host['cpu_count']} CPUs" if host.get("cpu_count") else ""
    return f"{host['cpu_model']}{cpus} ({flags})"


def provenance_line(p: dict) -> str:
    """Host, commit, drafter checksum and date, as one line of Markdown."""
    d = p["drafter"]
    sums = ", ".join(f"{name} `{digest[:16]}`" for name, digest in d["sha256"].items())
    quick = " **Quick run (`make figures QUICK=1`): small sizes, not the docs' figures.**" if p.get("quick") else ""
    return (f"Host: {host_line(p)}. Commit `{p['commit']}`. Drafter `{d['path']}`, sha256 {sums}. "
            f"Date: {p['date']}.{quick}")


def caption(p: dict) -> str:
    """The plots' title: the host on one line, the commit and the drafter's checksum on the next."""
    host = p["host"]
    flags = " ".join(flag for flag in CPU_FLAGS if host["cpu_flags"].get(flag)) or "no AVX2"
    return (f"{host['cpu_model']}, {host.get('cpu_count')} CPUs ({flags})\ncommit {p['commit']} | drafter "
            f"{p['drafter']['name']} sha256 {p['drafter']['sha256']['model.safetensors'][:12]} | {p['date']}"
            + (" | QUICK RUN" if p.get("quick") else ""))


# --- running the commands --------------------------------------------------------------------------------------------

def rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def program(name: str) -> str:
    """A program of this venv, as the command shows it (.venv/bin/NAME from the repository root)."""
    return rel(Path(sys.executable).parent / name)


def shown(argv: list[str], env: dict[str, str]) -> str:
    """The command line as run from the repository root, its environment variables first."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


def run_logged(suite: Suite, argv: list[str], env: dict[str, str], log: Path,
               echo: Callable[[str], bool]) -> tuple[int, float]:
    """Run `argv` from the repository root with `env` added; all its output into `log`, the lines `echo` picks on
    the console. Returns the exit code and the seconds it ran."""
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {shown(argv, env)}\n")
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            f.write(line)
            if echo(line):
                suite.say("  " + line.rstrip())
        rc = proc.wait()
    return rc, time.perf_counter() - t0


def bench(suite: Suite, section: str, args: list[str]) -> tuple[dict, dict]:
    """`dspark bench ARGS --json SECTION.bench.json --plot SECTION.png`: the run's record (command, data, plot) and
    the bench's result."""
    data, plot = suite.out / f"{section}.bench.json", suite.out / f"{section}.png"
    data.unlink(missing_ok=True)
    env = {"DSPARK_COST_CACHE": rel(CACHE / "cost-tables")}
    argv = [program("dspark"), "bench", *args, "--json", rel(data), "--plot", rel(plot)]
    log = suite.log(section)
    rc, seconds = run_logged(suite, argv, env, log, _bench_progress)
    if not data.exists():  # exit 1 with the data written: outputs differ from AR, which the table shows
        raise SectionFailed(f"dspark bench exited with {rc} without writing {rel(data)} (log: {rel(log)})")
    return {"command": shown(argv, env), "data": data.name, "plot": plot.name, "seconds": round(seconds, 1)}, \
        json.loads(data.read_text())


def _bench_progress(line: str) -> bool:
    """The bench's own lines, the services' progress through a long compile, and errors."""
    return line.startswith("[bench]") or " still " in line or "Error" in line or "Traceback" in line


def bench_args(section: str, sizes: Sizes, llama_cpp: bool) -> list[str]:
    """`dspark bench`'s arguments for a bench section at these sizes."""
    llama = ["--baseline", "llama-cpp"] if llama_cpp else []
    if section == "heldout":
        return ["--prompts", HELDOUT, "--limit", str(sizes.heldout_prompts), "--max-new-tokens",
                str(sizes.new_tokens), "--modes", ",".join(C1_MODES), *llama]
    if section == "humaneval":
        return ["--prompts", HUMANEVAL, "--limit", str(sizes.humaneval_prompts), "--max-new-tokens",
                str(sizes.new_tokens), "--modes", ",".join(C1_MODES), *llama]
    if section == "concurrency":
        return ["--prompts", HELDOUT, "--limit", str(sizes.concurrency_prompts), "--max-new-tokens",
                str(sizes.new_tokens), "--modes", ",".join(MODES), "--concurrency",
                ",".join(map(str, sizes.concurrency)), "--repeat", str(sizes.repeat)]
    if section == "exact":
        return ["--prompts", HELDOUT, "--limit", str(sizes.exact_prompts), "--max-new-tokens", str(sizes.exact_tokens),
                "--modes", ",".join(MODES), "--target-arg=--precision", "--target-arg=exact"]
    raise ValueError(section)


# --- tables ----------------------------------------------------------------------------------------------------------

def mode_label(mode: str) -> str:
    return MODE_LABELS.get(mode, mode)


def ratio(value: float, against: float | None) -> str:
    return f"{value / against:.2f}x" if against else "-"


def same_as_ar(lossless: bool | None) -> str:
    return {True: "yes", False: "**NO**"}.get(lossless, "-")


def c1_table(result: dict) -> dict:
    """One row per mode at concurrency 1 (tok/s, x our AR, x llama.cpp's AR where it ran, tokens per target
    forward, whether every output equals AR's), then llama.cpp's AR."""
    c = str(result["config"]["concurrency"][0])
    results, lossless = result["results"], result.get("lossless", {})
    ar = results.get(AR, {}).get(c, {}).get("tokens_per_s")
    base = result.get("baselines", {}).get("llama-cpp")
    columns = ["mode", "tok/s", "x our AR"] + (["x llama.cpp AR"] if base else []) + \
        ["tokens per target forward", "output = AR's"]
    rows = []
    for mode, by_c in results.items():
        e = by_c[c]
        rows.append([mode_label(mode), f"{e['tokens_per_s']:.1f}", ratio(e["tokens_per_s"], ar)]
                    + ([ratio(e["tokens_per_s"], base["tokens_per_s"])] if base else [])
                    + [f"{e['acceptance_length']:.2f}", same_as_ar(lossless.get(mode))])
    if base:
        runs = " / ".join(f"{r:.1f}" for r in base.get("runs_tokens_per_s", []))
        same = f"{base['same_as_ar']} of {len(base['outputs'])} prompts" if "same_as_ar" in base else "-"
        rows.append([f"llama.cpp AR, same GGUF (runs before / after: {runs})", f"{base['tokens_per_s']:.1f}",
                     ratio(base["tokens_per_s"], ar), "1.00x", "1.00", same])
    return {"columns": columns, "rows": rows}


def concurrency_table(result: dict) -> dict:
    """One row per concurrency: AR's tok/s, each other mode's tok/s and x AR, tokens per target forward."""
    results = result["results"]
    others = [m for m in results if m != AR]
    columns = ["C", "AR tok/s"] + [f"{mode_label(m)}: tok/s (x AR)" for m in others] + \
        [f"tokens per target forward ({' / '.join(others)})", "sessions per forward (" + " / ".join(results) + ")"]
    rows = []
    for c in result["config"]["concurrency"]:
        ar = results[AR][str(c)]["tokens_per_s"] if AR in results else None
        cells = [str(c), f"{ar:.1f}" if ar else "-"]
        for m in others:
            tps = results[m][str(c)]["tokens_per_s"]
            cells.append(f"{tps:.1f} ({ratio(tps, ar)})")
        cells.append(" / ".join(f"{results[m][str(c)]['acceptance_length']:.2f}" for m in others))
        cells.append(" / ".join(f"{results[m][str(c)].get('forward_sessions', 0.0):.1f}" for m in results))
        rows.append(cells)
    return {"columns": columns, "rows": rows}


def ar_step_ms(entry: dict) -> float:
    """An AR step as the client saw it: decode time (request time less prefill) per target forward, ms."""
    return 1e3 * (entry["wall_s"] - entry["prefill_s"]) / entry["steps"] if entry["steps"] else 0.0


def round_phases(entry: dict, ar: dict) -> dict:
    """A speculative mode's drafter costs per speculative step (ms), and the verify per step (all steps), against
    AR's step (`ar_step_ms`) of the same run."""
    spec = entry["speculative_steps"]
    per_spec = {key: 1e3 * entry[key] / spec if spec else 0.0
                for key in ("draft_s", "draft_round_s", "draft_service_s", "draft_compute_s")}
    return {**per_spec, "verify_s": 1e3 * entry["verify_s"] / entry["steps"] if entry["steps"] else 0.0,
            "ar_step_ms": ar_step_ms(ar), "speculative_share": spec / entry["steps"] if entry["steps"] else 0.0,
            "rounds_per_speculative_step": entry["draft_rounds"] / spec if spec else 0.0,
            "acceptance_length": entry["acceptance_length"]}


ROUND_KEYS = (("draft_s", "wait for the drafter"), ("draft_round_s", "drafter round"),
              ("draft_service_s", "of it in the draft service"), ("draft_compute_s", "of that the proposals"),
              ("verify_s", "verify, per step"))


def round_table(runs: dict[str, dict]) -> dict:
    """`runs`: prompt set -> its concurrency-1 bench result. A row per prompt set and speculative mode: tokens per
    forward, the share of speculative steps, rounds per speculative step, then each phase in ms per speculative step
    (verify: per step) with its fraction of that run's AR step."""
    columns = ["prompts", "mode", "tokens per target forward", "speculative steps", "rounds per speculative step"] + \
        [f"{label}, ms (x AR step)" for _, label in ROUND_KEYS]
    rows = []
    for prompts, result in runs.items():
        results = result["results"]
        ar = results[AR]["1"]
        step, verify = ar_step_ms(ar), 1e3 * ar["verify_s"] / ar["steps"]
        rows.append([prompts, f"AR (step {step:.2f} ms)", f"{ar['acceptance_length']:.2f}", "0 %", "-", "-", "-", "-",
                     "-", f"{verify:.2f} ({verify / step:.2f})"])
        for mode, by_c in results.items():
            e = by_c["1"]
            if mode == AR or not e["speculative_steps"]:
                continue
            p = round_phases(e, ar)
            rows.append([prompts, mode_label(mode), f"{p['acceptance_length']:.2f}",
                         f"{100 * p['speculative_share']:.0f} %", f"{p['rounds_per_speculative_step']:.2f}"]
                        + [f"{p[key]:.2f} ({p[key] / p['ar_step_ms']:.2f})" for key, _ in ROUND_KEYS])
    return {"columns": columns, "rows": rows}


def parse_engine_bench(text: str) -> dict:
    """The engine bench's printout: its header line, the invariance check and ms per forward by variant, clock and
    rows (the first Markdown table)."""
    header = next((line for line in text.splitlines() if "ms per forward" in line), "")
    invariance = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                       if line.startswith("compiled step, verify rows vs AR steps:")), None)
    lines = [line for line in text.splitlines() if line.startswith("|")]
    start = next((i for i, line in enumerate(lines) if line.startswith("| variant | clock |")), None)
    if start is None:
        raise ValueError("the engine bench printed no '| variant | clock |' table")
    rows = [int(cell.split()[0]) for cell in _cells(lines[start])[2:]]
    variants = []
    for line in lines[start + 2:]:
        cells = _cells(line)
        if len(cells) != len(rows) + 2:
            break
        variants.append({"variant": cells[0], "clock": cells[1],
                         "ms": {str(r): float(v) for r, v in zip(rows, cells[2:], strict=True)}})
    return {"header": header, "invariance": invariance, "rows": rows, "variants": variants}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def rows_table(parsed: dict) -> dict:
    """ms per forward by rows (wall clock), each with its ratio to the same variant's 1-row forward."""
    rows = parsed["rows"]
    table = []
    for v in parsed["variants"]:
        if v["clock"] != "wall":
            continue
        one = v["ms"].get("1")
        table.append([v["variant"]] + [f"{v['ms'][str(r)]:.1f} ({ratio(v['ms'][str(r)], one)})" for r in rows])
    return {"columns": ["variant (wall ms per forward, x its 1-row forward)"]
                       + [f"{r} row{'s' if r > 1 else ''}" for r in rows], "rows": table}


def startup_table(runs: list[dict]) -> dict:
    """Seconds from launching each service to its SERVING line, fresh caches and warm."""
    return {"columns": ["service", "caches", "seconds to SERVING"],
            "rows": [[r["service"], r["caches"], f"{r['seconds']:.1f}" if r.get("seconds") is not None
                      else r.get("note", "-")] for r in runs]}


def markdown_table(table: dict) -> str:
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
    return "\n".join(lines)


# --- plots -----------------------------------------------------------------------------------------------------------

def _figure(p: dict, size: tuple[float, float]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    fig.suptitle(caption(p), fontsize=9)
    return fig


def plot_round(p: dict, phases: dict[str, dict[str, dict]], path: Path) -> None:
    """Per prompt set, per speculative mode: a speculative step's verify and wait, and the round's parts (proposals,
    the rest of the draft service's work, transport and hand-offs), in ms, with the AR step as a dashed line."""
    fig = _figure(p, (13, 2.2 + 1.1 * max(len(m) for m in phases.values())))
    axes = fig.subplots(1, len(phases), squeeze=False)[0]
    for n, (ax, (prompts, by_mode)) in enumerate(zip(axes, phases.items(), strict=True)):
        names = list(by_mode)[::-1]
        for i, mode in enumerate(names):
            ph, first = by_mode[mode], n == 0 and i == 0
            step = [("step: verify (per step)", ph["verify_s"], "C0"),
                    ("step: wait for the drafter", ph["draft_s"], "C1")]
            parts = [("round: proposals", ph["draft_compute_s"], "C2"),
                     ("round: rest of the draft service", ph["draft_service_s"] - ph["draft_compute_s"], "C4"),
                     ("round: transport and hand-offs", ph["draft_round_s"] - ph["draft_service_s"], "C7")]
            for y, bars in ((i + 0.19, step), (i - 0.19, parts)):
                left = 0.0
                for label, width, color in bars:
                    ax.barh(y, width, left=left, height=0.36, color=color, label=label if first else None)
                    left += width
                ax.annotate(f" {left:.1f} ms", (left, y), va="center", fontsize=7)
        ar = next(iter(by_mode.values()))["ar_step_ms"]
        ax.axvline(ar, color="black", linestyle="--", linewidth=1, label="this run's AR step" if n == 0 else None)
        ax.annotate(f" AR step {ar:.1f} ms", (ar, len(names) - 0.5), fontsize=7, va="bottom")
        ax.set_yticks(range(len(names)), [mode_label(m).replace(" (", "\n(") for m in names], fontsize=8)
        ax.set(xlabel="ms per speculative step",
               title=f"{prompts} prompts")
        ax.margins(x=0.18)
        ax.set_ylim(-0.6, len(names) - 0.1)
    fig.legend(fontsize=8, loc="outside lower center", ncol=6)
    fig.savefig(path, dpi=110)


def plot_rows(p: dict, parsed: dict, path: Path) -> None:
    """ms per forward against rows (wall clock), one line per variant, each point labelled x its 1-row forward."""
    fig = _figure(p, (9, 5))
    ax = fig.subplots()
    rows, top = parsed["rows"], 0.0
    for i, v in enumerate(x for x in parsed["variants"] if x["clock"] == "wall"):
        ms = [v["ms"][str(r)] for r in rows]
        top = max(top, *ms)
        ax.plot(rows, ms, marker="o", color=f"C{i}", label=v["variant"])
        for r, y in zip(rows, ms, strict=True):
            ax.annotate(f"{y / ms[0]:.2f}x", (r, y), xytext=(4, -10 if i % 2 else 4), textcoords="offset points",
                        fontsize=7, color=f"C{i}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows, [str(r) for r in rows])
    ax.minorticks_off()
    ax.set_ylim(0, 1.12 * top)
    ax.set_xlim(rows[0] / 1.3, rows[-1] * 1.4)  # room for the last points' labels
    ax.set(xlabel="rows in the forward (one session, a chain verify)", ylabel="ms per forward (wall, median)",
           title=parsed["header"][:110])
    ax.title.set_fontsize(8)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)


def plot_startup(p: dict, runs: list[dict], path: Path) -> None:
    fig = _figure(p, (9, 3.6))
    ax = fig.subplots()
    measured = [r for r in runs if r.get("seconds") is not None][::-1]
    names = [f"{r['service']}, {r['caches']}" for r in measured]
    bars = ax.barh(range(len(measured)), [r["seconds"] for r in measured],
                   color=["C1" if r["caches"].startswith("fresh") else "C0" for r in measured])
    for bar, r in zip(bars, measured, strict=True):
        ax.annotate(f" {r['seconds']:.1f} s", (r["seconds"], bar.get_y() + bar.get_height() / 2), va="center",
                    fontsize=8)
    ax.set_yticks(range(len(measured)), names, fontsize=8)
    fresh = any(r["caches"] == FRESH for r in measured)
    ax.set(xlabel="seconds from launch to SERVING",
           title="start-up: empty caches, then a restart that keeps them" if fresh else
           "start-up on the suite's caches (from empty caches: the full run only)")
    ax.margins(x=0.15)
    fig.savefig(path, dpi=110)


# --- sections --------------------------------------------------------------------------------------------------------

def figure(suite: Suite, section: str, runs: list[dict], tables: list[tuple[str, dict]], notes: list[str],
           plot: str | None, **data) -> dict:
    """A section's record, as SECTION.json holds it."""
    return {"section": section, "title": TITLES[section], **suite.provenance, "runs": runs,
            "tables": [{"caption": c, **t} for c, t in tables], "notes": notes, "plot": plot, **data}


def prompts_text(result: dict) -> str:
    config = result["config"]
    source = "held-out prompts (docs/prompts/heldout.jsonl)" if config["prompts_file"] == HELDOUT else \
        "HumanEval problems (the first of the 164)" if config["prompts_file"] == HUMANEVAL else config["prompts_file"]
    return f"{config['num_prompts']} {source}, {config['max_new_tokens']} new tokens, greedy"


def c1_section(suite: Suite, section: str) -> dict:
    llama_cpp, failed = suite.llama_cpp, None
    try:
        run, result = bench(suite, section, bench_args(section, suite.sizes, llama_cpp))
    except SectionFailed as e:
        if not llama_cpp:
            raise
        # a llama-cpp-python build this CPU cannot run (SIGILL) must not cost the section
        failed, llama_cpp = str(e), False
        suite.say(f"  the bench with llama.cpp's AR failed ({e}); again without it")
        run, result = bench(suite, section, bench_args(section, suite.sizes, llama_cpp))
    notes = [f"{prompts_text(result)}; the fast precision and every flag at its default; each prompt in every mode "
             "in turn after one untimed warm-up request per mode."]
    if failed:
        notes.append("llama.cpp's AR: not shown, its run failed on this machine.")
    elif not llama_cpp:
        notes.append("llama.cpp's AR: not run here (llama-cpp-python is not installed: `make llama-cpp`).")
    else:
        notes.append("llama.cpp's AR ran before and after our modes (its figure sums both runs).")
    return figure(suite, section, [run], [("", c1_table(result))], notes, run["plot"])


def concurrency_section(suite: Suite, section: str = "concurrency") -> dict:
    run, result = bench(suite, section, bench_args(section, suite.sizes, False))
    notes = [f"{prompts_text(result)}; at concurrency 1 the modes take turns prompt by prompt; above it each mode runs "
             f"all prompts with C requests in flight, the modes in turn, {repeats(result['config']['repeat'])} (the "
             "plot's bars: each run)."]
    return figure(suite, section, [run], [("", concurrency_table(result))], notes, run["plot"])


def repeats(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


def exact_section(suite: Suite, section: str = "exact") -> dict:
    run, result = bench(suite, section, bench_args(section, suite.sizes, False))
    notes = [f"{prompts_text(result)}; the target in the exact precision (float32, equal to HF transformers), the "
             "drafter at its default."]
    return figure(suite, section, [run], [("", c1_table(result))], notes, run["plot"])


def round_section(suite: Suite, section: str = "round") -> dict:
    """Derived from the held-out and HumanEval runs of this suite (no run of its own)."""
    runs, results = [], {}
    for source, name in (("heldout", "held-out"), ("humaneval", "HumanEval")):
        path = suite.out / f"{source}.json"
        if not path.exists():
            raise SectionFailed(f"the round's phases come from the {source} section, which has not run into "
                                f"{rel(suite.out)}")
        record = json.loads(path.read_text())
        runs += record["runs"]
        results[name] = json.loads((suite.out / record["runs"][0]["data"]).read_text())
    phases = {name: {mode: round_phases(by_c["1"], result["results"][AR]["1"])
                     for mode, by_c in result["results"].items() if mode != AR and by_c["1"]["speculative_steps"]}
              for name, result in results.items()}
    phases = {name: by_mode for name, by_mode in phases.items() if by_mode}
    plot = f"{section}.png" if phases else None
    if plot:
        plot_round(suite.provenance, phases, suite.out / plot)
    notes = ["From the held-out and HumanEval runs above (their commands and data files). Per speculative step: the "
             "step's wait for the drafter's proposal (`draft_s`), and the drafter rounds' own time (`draft_round_s`: "
             "from the target's request to the reply read and planned; rounds asked ahead overlap other work), of it "
             "the draft service's (`draft_service_s`) and of that the proposals' compute (`draft_compute_s`); the "
             "verify per step over all steps (`verify_s`). In brackets: fractions of the same run's AR step (its "
             "decode time per target forward, prefill excluded); the AR row's bracket is its verify's share of its "
             "step."]
    return figure(suite, section, runs, [("", round_table(results))], notes, plot, phases=phases)


def rows_section(suite: Suite, section: str = "rows") -> dict:
    s = suite.sizes
    argv = [program("python"), "-m", "dspark_grpc.bench.engine_bench", "--precisions", "fast", "--compile", "max",
            "--rows", ",".join(map(str, s.rows)), "--rounds", str(s.rounds), "--repeats", str(s.repeats)]
    env = inductor_cache()
    log = suite.log(section)
    rc, seconds = run_logged(suite, argv, env, log, lambda line: not line.startswith("|") and bool(line.strip()))
    text = log.read_text().rsplit(f"$ {shown(argv, env)}\n", 1)[-1]
    if rc:
        raise SectionFailed(f"the engine bench exited with {rc} (log: {rel(log)})")
    raw = suite.out / f"{section}.engine_bench.txt"
    raw.write_text(text)
    parsed = parse_engine_bench(text)
    plot = f"{section}.png"
    plot_rows(suite.provenance, parsed, suite.out / plot)
    run = {"command": shown(argv, env), "data": raw.name, "plot": plot, "seconds": round(seconds, 1)}
    notes = [parsed["header"], "One session, a chain verify of R rows on top of the committed rows, timed by "
             "the target's start-up profiler; the CPU clock's figures are in the data file."]
    if parsed["invariance"]:
        notes.append(f"The compiled step's verify rows against its AR steps: {parsed['invariance']}.")
    return figure(suite, section, [run], [("", rows_table(parsed))], notes, plot, engine_bench=parsed)


def inductor_cache() -> dict[str, str]:
    """TORCHINDUCTOR_CACHE_DIR as the services set it (beside their compile cache) unless it is set: the engine
    bench leaves it alone, and loading the saved step then recompiles its kernels into torch's default cache."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return {}
    from dspark_grpc.speculation.cost_table import default_cache_dir

    return {"TORCHINDUCTOR_CACHE_DIR": rel(default_cache_dir("compiled", "DSPARK_COMPILE_CACHE") / "inductor")}


SERVICES = (("draft service", "dspark_grpc.draft_service.cli"), ("target service", "dspark_grpc.target_service.cli"))


def time_to_serving(argv: list[str], env: dict[str, str], log: Path, timeout: float = 1800.0) -> float:
    """Seconds from launching `argv` to its SERVING line; the process is stopped then."""
    with open(log, "a") as f:
        f.write(f"$ {shown(argv, env)}\n")
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                f.write(line)
                if _SERVING.search(line) and not _FAILED.search(line):
                    return time.perf_counter() - t0
                if _FAILED.search(line):
                    break
            raise SectionFailed(f"{argv[2]} did not report SERVING (log: {rel(log)})")
        finally:
            timer.cancel()
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def startup_plan(fresh: bool) -> list[tuple[str, str, str]]:
    """(service, module, caches) in the order they start: the draft service first, as the bench starts them, with
    empty caches, then both again keeping them; without `fresh`, each once on the suite's own caches (the bench
    sections before filled them)."""
    if not fresh:
        return [(service, module, SUITE_CACHES) for service, module in SERVICES]
    return [(service, module, caches) for caches in (FRESH, WARM) for service, module in SERVICES]


def startup_section(suite: Suite, section: str = "startup") -> dict:
    """Each service from launch to SERVING with empty caches (compile cache: the C++ kernels and compiled graphs;
    cost tables), then restarted keeping those caches."""
    caches = CACHE / "startup"
    shutil.rmtree(caches, ignore_errors=True)
    fresh_env = {"DSPARK_COMPILE_CACHE": rel(caches / "compiled"), "DSPARK_COST_CACHE": rel(caches / "cost-tables"),
                 "TORCHINDUCTOR_CACHE_DIR": rel(caches / "compiled" / "inductor")}
    suite_env = {"DSPARK_COST_CACHE": rel(CACHE / "cost-tables")}
    log = suite.log(section)
    records, runs = [], []
    for service, module, label in startup_plan(suite.sizes.fresh_starts):
        argv = [program("python"), "-m", module, "serve", "--host", "127.0.0.1", "--port", "0"]
        env = suite_env if label == SUITE_CACHES else fresh_env
        suite.say(f"  {service}, {label}: starting")
        seconds = time_to_serving(argv, env, log)
        suite.say(f"  {service}, {label}: SERVING after {seconds:.1f} s")
        records.append({"service": service, "caches": label, "seconds": round(seconds, 2)})
        runs.append({"command": shown(argv, env), "data": f"{section}.json", "plot": f"{section}.png"})
    if not suite.sizes.fresh_starts:
        records += [{"service": service, "caches": FRESH, "seconds": None,
                     "note": "not measured (--quick: a first start compiles for minutes)"} for service, _ in SERVICES]
    shutil.rmtree(caches, ignore_errors=True)
    plot = f"{section}.png"
    plot_startup(suite.provenance, records, suite.out / plot)
    notes = ["Each service alone, default flags (the fast precision, compiled; the start-up cost profile), from "
             "launch to its `SERVING` line. Fresh: an empty compile cache (the C++ kernels built, the step and the "
             "drafter's chain compiled) and cost-table cache, shared by the two services as in a first `make demo` "
             "(the draft service starts first and builds the kernels both use); warm: the same commands again, "
             "keeping them."]
    return figure(suite, section, runs, [("", startup_table(records))], notes, plot, startups=records)


RUNNERS: dict[str, Callable[[Suite, str], dict]] = {
    "heldout": c1_section, "humaneval": c1_section, "round": round_section, "concurrency": concurrency_section,
    "exact": exact_section, "rows": rows_section, "startup": startup_section,
}


# --- Markdown: a section, the index, PERFORMANCE.md -----------------------------------------------------------------

def section_markdown(record: dict, prefix: str = "") -> str:
    """A section's body (no heading): notes, tables, where each number comes from (data files, commands), plot.
    `prefix`: the path from the Markdown file to the figures folder ('' inside it)."""
    parts = [sentences(record["notes"])]
    for table in record["tables"]:
        parts.append((f"{table['caption']}\n\n" if table["caption"] else "") + markdown_table(table))
    files = [record["section"] + ".json"] + [r["data"] for r in record["runs"]]
    links = ", ".join(f"[{name}]({prefix}{name})" for name in dict.fromkeys(files))
    parts.append(f"{provenance_line(record)} Data: {links}. Commands (from the repository root):")
    parts.append("```bash\n" + "\n".join(dict.fromkeys(r["command"] for r in record["runs"])) + "\n```")
    if record.get("plot"):
        parts.append(f"![{record['title']}]({prefix}{record['plot']})")
    return "\n\n".join(parts)


def index_markdown(records: list[dict], p: dict, seconds: float) -> str:
    head = [f"# Figures: `{p['suite_command']}`",
            "Generated by docs/bench/figures.py; do not edit by hand (run it again). Every table below names its "
            "data files and the commands that wrote them.",
            f"{provenance_line(p)} The suite ran {duration(seconds)}."]
    body = [f"## {r['title']}\n\n{section_markdown(r)}" for r in records]
    return "\n\n".join(head + body) + "\n"


def _marker(name: str, end: bool) -> str:
    return f"<!-- figures:{name} {'end' if end else 'begin'} -->"


def replace_blocks(text: str, bodies: dict[str, str]) -> str:
    """`text` with the block between each `<!-- figures:NAME begin -->` and `<!-- figures:NAME end -->` replaced by
    bodies[NAME]; a missing pair raises ValueError."""
    for name, body in bodies.items():
        begin, end = _marker(name, False), _marker(name, True)
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"no {begin} ... {end} pair")
        text = text[: i + len(begin)] + "\n" + body.strip() + "\n" + text[j:]
    return text


def performance_bodies(records: list[dict], p: dict) -> dict[str, str]:
    """What docs/PERFORMANCE.md's blocks get: the run's provenance ("run") and each section's body."""
    bodies = {"run": f"From one run of `{p['suite_command']}` ([all tables](figures/README.md)). {provenance_line(p)}"}
    bodies.update({r["section"]: section_markdown(r, "figures/") for r in records})
    return bodies


# --- the suite -------------------------------------------------------------------------------------------------------

def run_suite(suite: Suite, sections: list[str]) -> tuple[list[dict], list[str]]:
    """Each section in turn (a failure is reported and the next one runs): the records written and the failures."""
    records, failed = [], []
    for n, section in enumerate(sections, 1):
        suite.say(f"{section} ({n} of {len(sections)}): {TITLES[section]}")
        suite.log(section).write_text("")
        t0 = time.perf_counter()
        try:
            record = RUNNERS[section](suite, section)
        except (SectionFailed, OSError, ValueError, KeyError, subprocess.SubprocessError) as e:
            suite.say(f"{section}: FAILED after {clock(time.perf_counter() - t0)}: {e}")
            failed.append(section)
            continue
        record["seconds"] = round(time.perf_counter() - t0, 1)
        (suite.out / f"{section}.json").write_text(json.dumps(record, indent=1) + "\n")
        (suite.out / f"{section}.md").write_text(f"## {record['title']}\n\n{section_markdown(record)}\n")
        records.append(record)
        suite.say(f"{section}: done in {clock(record['seconds'])}")
    return records, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="every section, small (make figures QUICK=1)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"output folder; default {rel(FIGURES)} (full) or {rel(QUICK_OUT)} (--quick)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    out = (args.out or (QUICK_OUT if args.quick else FIGURES)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    suite = Suite(out, QUICK if args.quick else FULL, args.quick, provenance(args.quick), started,
                  importlib.util.find_spec("llama_cpp") is not None)
    suite.say(f"{len(sections)} sections into {rel(out)}; {provenance_line(suite.provenance)}")
    # this run's services profile their cost tables afresh at its first start (a table profiled on a busy machine
    # would mislead the planner of every later run)
    shutil.rmtree(CACHE / "cost-tables", ignore_errors=True)
    records, failed = run_suite(suite, sections)
    seconds = time.perf_counter() - started
    everything = [json.loads((out / f"{s}.json").read_text()) for s in SECTIONS if (out / f"{s}.json").exists()]
    (out / "README.md").write_text(index_markdown(everything, suite.provenance, seconds))
    suite.say(f"wrote {rel(out / 'README.md')}")
    if out == FIGURES.resolve() and not args.quick and not failed and sections == list(SECTIONS):
        PERFORMANCE.write_text(replace_blocks(PERFORMANCE.read_text(), performance_bodies(records, suite.provenance)))
        suite.say(f"rewrote the current figures in {rel(PERFORMANCE)}")
    else:
        suite.say(f"{rel(PERFORMANCE)} left as it is (only a full run of every section into {rel(FIGURES)} "
                  "rewrites it)")
    suite.say(f"{len(records)} of {len(sections)} sections in {clock(seconds)}"
              + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
