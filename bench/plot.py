"""The bench's figure: tok/s per mode (bars at one concurrency, lines over several) and per-position acceptance,
captioned with what the run was measured on. matplotlib is imported only when a figure is drawn."""

from __future__ import annotations

from pathlib import Path

from dspark_grpc.speculation.wire import AR

VECTORS = {"avx512": "AVX-512", "avx2": "AVX2, no AVX-512", "other": "no AVX2"}


def run_caption(result: dict) -> str:
    """What a result was measured on, as it records it: the target model, the CPU (model, widest vector extension,
    count) and the code's commit."""
    machine, config = result.get("machine", {}), result["config"]
    model = config.get("target_info", {}).get("model_name") or config.get("target_model")
    cpu = machine.get("cpu_model") or "CPU model not recorded"
    vector = VECTORS.get(machine.get("cpu_vector"), "vector extension not recorded")
    cpus = f", {machine['cpu_count']} CPUs" if machine.get("cpu_count") else ""
    commit = config.get("commit")
    parts = [model, f"{cpu} ({vector}){cpus}", f"commit {commit}" if commit else "commit not recorded"]
    return " | ".join(part for part in parts if part)


def plot_bench(result: dict, path: str | Path):
    """Draws `bench_figure(result)` into `path` (the format by its suffix); returns the Figure."""
    fig = bench_figure(result)
    fig.savefig(path, dpi=120)
    return fig


def bench_figure(result: dict):
    """Left: tok/s per mode, as labelled bars for one concurrency or lines over several (concurrency on a log2
    axis), each with its ratio to AR, and any baseline as a reference. Right: per-position acceptance of the
    speculative modes. Above both: `run_caption`."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, NullLocator

    results, conc, config = result["results"], result["config"]["concurrency"], result["config"]
    baselines = result.get("baselines", {})
    fig = Figure(figsize=(15, 5.4), layout="constrained")
    fig.suptitle(run_caption(result), fontsize=10)
    speed, accept = fig.subplots(1, 2, width_ratios=[1.2, 1])
    ar = results.get(AR)
    colors = {m: f"C{i}" for i, m in enumerate(results)}
    if len(conc) == 1:
        c = str(conc[0])
        names = list(results) + [f"{n} AR (reference)" for n in baselines]
        values = [results[m][c]["tokens_per_s"] for m in results] + [b["tokens_per_s"] for b in baselines.values()]
        rows = list(range(len(names)))[::-1]  # the first mode on top
        bars = speed.barh(rows, values, color=[colors.get(m, "0.6") for m in names])
        for i in range(len(results), len(names)):
            bars[i].set_hatch("//")
        for bar, v in zip(bars, values, strict=True):
            label = f" {v:.1f} tok/s" + (f", {v / ar[c]['tokens_per_s']:.2f}x AR" if ar else "")
            speed.annotate(label, (v, bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
        speed.set_yticks(rows, names, fontsize=8)
        speed.set(xlabel="generated tokens / s", title=f"concurrency {c}: {config['max_new_tokens']} new tokens, "
                                                         f"{config['num_prompts']} prompts (greedy)")
        speed.margins(x=0.3)
        speed.set_xlim(left=0)
    else:
        tops = [b["tokens_per_s"] for b in baselines.values()]
        for mode, by_c in results.items():
            ys = [by_c[str(c)]["tokens_per_s"] for c in conc]
            speed.plot(conc, ys, marker="o", label=mode, color=colors[mode])
            tops += ys
            for c in conc:  # each --repeat run's own figure: the machine's run-to-run spread
                runs = by_c[str(c)].get("runs_tokens_per_s", [])
                tops += runs
                if len(runs) > 1:
                    speed.vlines(c, min(runs), max(runs), color=colors[mode], linewidth=4, alpha=0.35)
        for name, base in baselines.items():
            speed.axhline(base["tokens_per_s"], color="gray", linestyle="--", label=f"{name} AR (reference)")
        top = 1.12 * max(tops)
        speed.set_ylim(0, top)
        if ar:
            _ratio_labels(speed, conc, results, ar, colors, top)
        speed.set_xscale("log", base=2)
        speed.set_xticks(conc, [str(c) for c in conc])
        speed.xaxis.set_minor_locator(NullLocator())
        speed.set_xlim(conc[0] / 1.25, conc[-1] * 1.7)  # room for the last concurrency's labels
        speed.set(xlabel="concurrent requests", ylabel="generated tokens / s (aggregate)",
                  title=f"{config['max_new_tokens']} new tokens, {config['num_prompts']} prompts (greedy); "
                        "labels: x AR at that concurrency" + ("; bars: each run" if any(
                            len(e.get("runs_tokens_per_s", [])) > 1 for by_c in results.values()
                            for e in by_c.values()) else ""))
        speed.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)

    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3))]
    for mode, by_c in results.items():
        for i, c in enumerate(conc):
            ppa = by_c[str(c)]["per_position_acceptance"]
            if ppa:
                label = mode if len(conc) == 1 else f"{mode} c={c}"
                accept.plot(range(1, len(ppa) + 1), ppa, marker=".", label=label, color=colors[mode],
                            linestyle=styles[i % len(styles)])
    accept.xaxis.set_major_locator(MaxNLocator(integer=True))
    if accept.lines:  # whole positions, also when only position 1 was ever drafted (matplotlib pads a lone point)
        deepest = max(len(line.get_xdata()) for line in accept.lines)
        accept.set_xlim(0.5, deepest + 0.5)
        if deepest <= 16:
            accept.set_xticks(range(1, deepest + 1))
    accept.set(xlabel="draft position (depth in the chain or tree)", ylabel="accepted / drafted at that position",
               ylim=(-0.03, 1.03), title="per-position acceptance")
    block = config.get("drafter_info", {}).get("block_size")
    if block and any(len(line.get_xdata()) > block for line in accept.lines):
        # hybrid drafts past the DSpark block come only from prompt lookup, which drafts that deep only where the
        # text repeats itself: acceptance jumps there
        accept.axvline(block + 0.5, color="gray", linestyle=":")
        accept.text(block + 0.6, 0.97, f"past the DSpark block ({block}):\nprompt-lookup drafts only\n(hybrid)",
                    fontsize=7, va="top", color="gray")
    if accept.lines:
        accept.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        accept.text(0.5, 0.5, "no speculative steps", ha="center", va="center", transform=accept.transAxes)
    return fig


def _ratio_labels(speed, conc: list[int], results: dict, ar: dict, colors: dict, top: float) -> None:
    """Each non-AR mode's ratio to AR right of its point, at every concurrency. The labels of one concurrency are
    stacked at least 6 % of the axis apart (lowest first, the stack kept below the top), with a thin line to a
    point they had to leave; a white box keeps a label readable over the lines it crosses."""
    gap = 0.06 * top
    for c in conc:
        marks = sorted((by_c[str(c)]["tokens_per_s"], mode) for mode, by_c in results.items() if mode != AR)
        placed: list[float] = []
        for y, _ in marks:
            placed.append(max(y, placed[-1] + gap) if placed else y)
        over = placed[-1] - 0.96 * top if placed else 0.0
        placed = [y - max(over, 0.0) for y in placed]
        for (y, mode), at in zip(marks, placed, strict=True):
            moved = abs(at - y) > 0.01 * top
            speed.annotate(f"{y / ar[str(c)]['tokens_per_s']:.2f}x", (c, y), xytext=(c * 2 ** 0.17, at),
                           textcoords="data", ha="left", va="center", fontsize=8, color=colors[mode], zorder=5,
                           bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                                 "alpha": 0.85},
                           arrowprops={"arrowstyle": "-", "color": colors[mode], "linewidth": 0.6, "relpos": (0, 0.5)}
                           if moved else None)  # from the label's left edge: clear of the labels below it
