"""The drafter's precision (dspark-draft serve --precision exact|fast), bench runs side by side: tok/s vs AR per mode
and the target's wait for the drafter per speculative step. Usage: python docs/bench/drafter_precision_plot.py"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

HERE = Path(__file__).parent
RUNS = [  # (title, drafter exact json, drafter fast json)
    ("default stack (exact target), 64 tokens", "q8-drafter-off-default-64.json", "q8-drafter-default-64.json"),
    ("fast target, --compile max, 128 tokens", "q8-drafter-off-fast-target-128.json",
     "q8-drafter-fast-target-128.json"),
]
MODES = ("speculation", "adaptive")


def main() -> None:
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    axes = fig.subplots(1, 2 * len(RUNS), width_ratios=[1.3, 1] * len(RUNS))
    for i, (title, *files) in enumerate(RUNS):
        ratio_ax, wait_ax = axes[2 * i], axes[2 * i + 1]
        for j, (name, file) in enumerate(zip(("drafter exact", "drafter fast (Q8_0)"), files, strict=True)):
            r = json.loads((HERE / file).read_text())["results"]
            ar = r["ar"]["1"]["tokens_per_s"]
            ratios = [r[m]["1"]["tokens_per_s"] / ar for m in MODES]
            xs = [k + 0.38 * j for k in range(len(MODES))]
            bars = ratio_ax.bar(xs, ratios, 0.36, label=name, color=f"C{j}")
            ratio_ax.bar_label(bars, [f"{v:.2f}x" for v in ratios], fontsize=8)
            s = r["speculation"]["1"]
            wait = 1e3 * s["draft_s"] / s["speculative_steps"]
            wait_ax.bar([j], [wait], 0.6, color=f"C{j}")
            wait_ax.annotate(f"{wait:.1f} ms", (j, wait), ha="center", va="bottom", fontsize=8)
        ratio_ax.axhline(1.0, color="0.4", lw=0.8, ls="--")
        ratio_ax.set_xticks([k + 0.19 for k in range(len(MODES))], MODES)
        ratio_ax.set(ylabel="tok/s vs AR of the same run", title=title)
        ratio_ax.title.set_fontsize(9)
        ratio_ax.legend(fontsize=8, loc="lower right")
        ratio_ax.set_ylim(0, 1.5)
        wait_ax.set_xticks([0, 1], ["exact", "fast"])
        wait_ax.set(ylabel="drafter wait per speculative step (ms)", title="speculation mode")
        wait_ax.title.set_fontsize(9)
        wait_ax.margins(y=0.15)
    fig.savefig(HERE / "q8-drafter.png", dpi=110)


if __name__ == "__main__":
    main()
