"""Where a served model's resident memory goes (issue 55): each measure in a fresh process, VmRSS before and after.

    PYTHONPATH=. .venv/bin/python docs/bench/resident_memory.py --json OUT.json --plot OUT.png [FILE.gguf ...]

Per file (default: SmolLM2 requantized to Q4_K_M by llama.cpp, as docs/bench/gguf_files_vs_llama_cpp.py makes it, and
Gemma 3 270M Q4_K_M): `TargetEngine.load` in the fast precision eager (`--compile off`) and compiled (`max`, the
default; loaded from the compile cache when a run before saved it), what the model's tensors hold (`model_tensors`,
each storage once), the process's peak while loading (ru_maxrss), and the file's tokenizer alone. And, with no
model, what torch.compile's machinery adds to a process that compiles a one-line function.
Writes one bench-shaped JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PROBES = {
    "engine": """
from dspark_grpc.target_service.engine import TargetEngine, resident_mib
from dspark_grpc.runtime.kernels.compiled_step import model_tensors
before = resident_mib()
engine = TargetEngine.load(PATH, precision="fast", compile=COMPILE, progress=False)
after = resident_mib()
weights = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
           for t in model_tensors(engine.model) if not t.is_meta}
import resource
print(json.dumps({"before": before, "after": after, "weights": sum(weights.values()) / 2**20,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""",
    "tokenizer": """
from dspark_grpc.target_service.engine import resident_mib
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
before = resident_mib()
from dspark_grpc.runtime.formats.checkpoint import release_freed_memory
tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(PATH)))
release_freed_memory()  # what building it freed goes back, as TargetEngine.load hands it back
print(json.dumps({"before": before, "after": resident_mib()}))
""",
    "compile": """
import torch
from dspark_grpc.target_service.engine import resident_mib
before = resident_mib()
f = torch.compile(lambda x: (x * 2).sin(), dynamic=True)
f(torch.randn(10)), f(torch.randn(20))
print(json.dumps({"before": before, "after": resident_mib()}))
""",
}


def probe(kind: str, path: Path | None = None, compile: str = "off") -> dict:
    code = "import json\n" + PROBES[kind].replace("PATH", repr(str(path))).replace("COMPILE", repr(compile))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["added"] = result["after"] - result["before"]
    return {k: round(v, 1) for k, v in result.items()}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]["files"]
    fig, (ax, ratio_ax) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    series = (("file_mib", "the file"), ("weights_mib", "the model's tensors"),
              ("eager_added_mib", "service process, eager: added"),
              ("compiled_added_mib", "service process, compiled: added"),
              ("tokenizer_added_mib", "the tokenizer alone: added"))
    width = 0.8 / len(series)
    names = [r["file"].removesuffix(".gguf") for r in rows]
    for k, (key, label) in enumerate(series):
        at = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        values = [r[key] for r in rows]
        ax.bar(at, values, width, label=label)
        for x, v in zip(at, values, strict=True):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
    ax.axhline(result["results"]["compile_machinery_added_mib"], color="gray", ls=":", lw=1,
               label="torch.compile's machinery alone (no model)")
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=12)
    ax.set_ylabel("MiB (log scale)")
    ax.legend(fontsize=6, loc="upper left")
    ratios = (("eager_added_mib", "eager: added / file"), ("compiled_added_mib", "compiled: added / file"))
    for k, (key, label) in enumerate(ratios):
        at = [i + (k - 0.5) * 0.35 for i in range(len(rows))]
        values = [r[key] / r["file_mib"] for r in rows]
        ratio_ax.bar(at, values, 0.35, label=label)
        for x, v in zip(at, values, strict=True):
            ratio_ax.text(x, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ratio_ax.axhline(1.3, color="red", ls="--", lw=1, label="issue 55's bound (1.3x, KV cache aside)")
    ratio_ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=12)
    ratio_ax.set_ylabel("resident memory added / file size")
    ratio_ax.legend(fontsize=7, loc="upper right")
    m = result["machine"]
    fig.suptitle(f"resident memory (VmRSS): {m.get('cpu_model', m.get('processor'))}, commit "
                 f"{result['config']['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="GGUF files (default: SmolLM2 Q4_K_M requantized, Gemma 3 270M Q4_K_M)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args()
    from dspark_grpc.bench.machine import git_commit, machine_info

    from docs.bench.gguf_files_vs_llama_cpp import gemma3_path, requantized

    files = [Path(f) for f in args.files] or [requantized("Q4_K_M"), gemma3_path()]
    rows = []
    for path in files:
        print(f"{path.name}: eager, compiled, tokenizer", file=sys.stderr, flush=True)
        eager, compiled = probe("engine", path, "off"), probe("engine", path, "max")
        tokenizer = probe("tokenizer", path)
        rows.append({"file": path.name, "file_mib": round(path.stat().st_size / 2**20, 1),
                     "weights_mib": eager["weights"], "eager_added_mib": eager["added"],
                     "compiled_added_mib": compiled["added"], "tokenizer_added_mib": tokenizer["added"],
                     "eager_peak_mib": eager["peak"], "compiled_peak_mib": compiled["peak"],
                     "process_before_mib": eager["before"], "eager": eager, "compiled": compiled,
                     "tokenizer": tokenizer})
    machinery = probe("compile")
    result = {"command": sys.argv, "machine": machine_info(), "config": {"commit": git_commit()},
              "results": {"files": rows, "compile_machinery_added_mib": machinery["added"],
                          "compile_machinery": machinery}}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    for r in rows:
        print(f"{r['file']}: file {r['file_mib']} MiB, weights {r['weights_mib']}, eager +{r['eager_added_mib']}, "
              f"compiled +{r['compiled_added_mib']}, tokenizer +{r['tokenizer_added_mib']}; the process's peak while "
              f"loading {r['eager_peak_mib']:.0f} eager, {r['compiled_peak_mib']:.0f} compiled")
    print(f"torch.compile's machinery: +{machinery['added']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
