"""Two commits' bench runs, alternated A, B, A, B on one host, summed up as one result: per run the speculation/AR
ratio (each run measures both modes interleaved), the wait for the drafter per speculative step and the verify per
step (each as a fraction of the same run's AR step: the host's speed drifts between runs, the fractions much less),
and whether every output of both commits was the same. Writes one JSON and its plot. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/ab_pairs.py --label-a 97f3fe5 --label-b 6238f0d \\
        --a A1.json A2.json --b B1.json B2.json --json OUT.json --plot OUT.png

where each file is a `dspark bench --modes ar,speculation --json` result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from dspark_grpc.bench.machine import git_commit, machine_info


def ar_step_s(entry: dict) -> float:
    """The AR run's seconds per token, prefill excluded."""
    return (entry["wall_s"] - entry["prefill_s"]) / entry["generated_tokens"]


def run_summary(result: dict) -> dict:
    ar, spec = result["results"]["ar"]["1"], result["results"]["speculation"]["1"]
    step, steps = ar_step_s(ar), max(spec["speculative_steps"], 1)
    return {"speculation_over_ar": spec["tokens_per_s"] / ar["tokens_per_s"],
            "ar_tokens_per_s": ar["tokens_per_s"], "speculation_tokens_per_s": spec["tokens_per_s"],
            "tokens_per_step": spec["acceptance_length"], "draft_rounds": spec["draft_rounds"],
            "wait_per_speculative_step_x_ar_step": spec["draft_s"] / steps / step,
            "verify_per_step_x_ar_step": spec["verify_s"] / spec["steps"] / step,
            "from_lookup_rate": spec.get("from_lookup_rate", 0.0),
            "outputs": spec.get("outputs"), "prompts": result["config"]["prompts_file"]}


def summarize(runs: dict[str, list[dict]]) -> dict:
    out = {}
    for label, results in runs.items():
        each = [run_summary(r) for r in results]
        out[label] = {"runs": [{k: v for k, v in s.items() if k != "outputs"} for s in each],
                      "median": {k: statistics.median(s[k] for s in each) for k in each[0]
                                 if isinstance(each[0][k], float | int)}}
    outputs = [s["outputs"] for results in runs.values() for s in map(run_summary, results)]
    out["same_outputs"] = all(o == outputs[0] for o in outputs) if outputs[0] is not None else None
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(report["config"]["labels"])
    keys = [("speculation_over_ar", "speculation / AR"), ("wait_per_speculative_step_x_ar_step",
            "wait per speculative step (x AR step)"), ("tokens_per_step", "tokens per step")]
    fig, axes = plt.subplots(1, len(keys), figsize=(11, 3.8))
    for ax, (key, title) in zip(axes, keys, strict=True):
        top = max(r[key] for label in labels for r in report["results"][label]["runs"])
        for i, label in enumerate(labels):
            values = [r[key] for r in report["results"][label]["runs"]]
            ax.plot([i] * len(values), values, "o", alpha=0.7)
            ax.text(i, max(values), f" {statistics.median(values):.2f}", fontsize=8, va="bottom")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.6, len(labels) - 0.4)
        ax.set_ylim(0, top * 1.2)
        ax.set_title(title, fontsize=9)
    m = report["machine"]
    fig.suptitle(f"{report['config']['prompts']}: A/B runs alternated (median beside)\n{m.get('cpu_model')}, "
                 f"{m['cpu_count']} CPUs | summarised at commit {report['config']['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label-a", required=True)
    p.add_argument("--label-b", required=True)
    p.add_argument("--a", nargs="+", required=True, help="commit A's bench JSONs, in the order they ran")
    p.add_argument("--b", nargs="+", required=True, help="commit B's bench JSONs, in the order they ran")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", required=True)
    args = p.parse_args()
    runs = {args.label_a: [json.loads(Path(f).read_text()) for f in args.a],
            args.label_b: [json.loads(Path(f).read_text()) for f in args.b]}
    first = runs[args.label_a][0]
    report = {"command": sys.argv, "machine": first["machine"] or machine_info(),
              "config": {"commit": git_commit() or "unknown", "labels": [args.label_a, args.label_b],
                         "prompts": first["config"]["prompts_file"], "bench_command": first["command"],
                         "max_new_tokens": first["config"]["max_new_tokens"],
                         "num_prompts": first["config"]["num_prompts"]},
              "results": summarize(runs)}
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.plot)


if __name__ == "__main__":
    main()
