"""`make gpu-check`: the stack on a CUDA device, in under 8 minutes, its figures in docs/bench/gpu-check.md.

1. The CUDA tests (tests/runtime/test_cuda.py) with Triton compiling for real (TRITON_INTERPRET=0).
2. The shipped drafter's DSpark chain through the fused Triton kernel and through the torch path, on the same block
   outputs: tokens identical, and the time of each.
3. The embedded target's forward time by the rows it carries (one session's 1-16 rows, 4 or 16 sessions of 1 or 5).
4. `dspark bench` on the device: AR, speculation and adaptive at concurrency 1, 4 and 16 on the embedded target (its
   JSON and plot go to build/gpu-check/).

Where torch sees no CUDA device it exits 1 with one line. docs/bench/gpu-check.md holds its last run's figures.

    .venv/bin/python docs/bench/gpu_check.py [--device cuda:0]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports triton: the kernel compiles, it is not interpreted
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "docs" / "bench" / "gpu-check.md"
OUT = ROOT / "build" / "gpu-check"
BENCH = ["--prompts", "docs/prompts/heldout.jsonl", "--limit", "16", "--max-new-tokens", "64",
         "--modes", "ar,speculation,adaptive", "--concurrency", "1,4,16"]


def run(name: str, command: list[str], timeout: float) -> tuple[bool, str]:
    """A step as a child process, its output shown as it runs (what it printed stays in the log when it times out);
    whether it passed, and its last output line."""
    print(f"== gpu-check: {name}", flush=True)
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = threading.Event()
    timer = threading.Timer(timeout, lambda: (killed.set(), proc.kill()))
    timer.start()
    last = ""
    for line in proc.stdout:
        print(line, end="", flush=True)
        last = line.strip() or last
    proc.wait()
    timer.cancel()
    if killed.is_set():
        return False, f"timed out after {timeout:.0f} s (last line: {last})"
    return proc.returncode == 0, last


def fused_vs_torch(device: str, contexts: int = 32, repeats: int = 20) -> dict:
    """The chain of each kernel on the same block outputs (random target features as context): how many chains are
    identical, and the median seconds of one chain (host sync included: both return tokens on the host)."""
    from dspark_grpc.draft_service.engine import EMBEDDED_DRAFTER
    from dspark_grpc.runtime.drafting.markov import draft_chain
    from dspark_grpc.runtime.formats.checkpoint import default_model_path
    from dspark_grpc.runtime.formats.drafter_formats import load_drafter

    print("== gpu-check: fused Triton kernel against the torch path", flush=True)
    d = load_drafter(EMBEDDED_DRAFTER, target_path=default_model_path()).to(device).eval().requires_grad_(False)
    d = d.pack()  # as the draft service serves it (a vanilla head's biases cached)
    g = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {"torch": [], "fused": []}
    same = 0
    for i in range(contexts):
        ctx = d.new_context()
        ctx.append(torch.randn(64, len(d.config.target_layer_ids), d.config.target_hidden_size, generator=g), 0)
        anchor = 100 + i
        out = d.forward_block(ctx, anchor)
        chains = {}
        for kernel in seconds:
            chain = functools.partial(draft_chain, out.base_logits, out.hidden_pre_norm, out.hidden_post_norm, anchor,
                                      d.markov, d.confidence, d.d2t, kernel=kernel)
            chains[kernel] = chain()  # untimed: the first call compiles the kernel
            for _ in range(repeats):
                t0 = time.perf_counter()
                chain()
                seconds[kernel].append(time.perf_counter() - t0)
        same += chains["fused"].tokens == chains["torch"].tokens
    return {"contexts": contexts, "identical": same, "torch_us": 1e6 * statistics.median(seconds["torch"]),
            "fused_us": 1e6 * statistics.median(seconds["fused"])}


def forward_costs(device: str, repeats: int = 30) -> dict[str, float]:
    """Milliseconds per forward of the embedded target (fast precision, eager) by the rows it carries: one session's
    1-16 rows (an AR step, verifies), and 4 or 16 sessions of 1 row (AR) or 5 rows (chain verifies) each, over
    200-token caches. What a verify row costs beside an AR step is what decides whether speculation pays."""
    from dspark_grpc.runtime.formats.checkpoint import default_model_path, inference_model, load_checkpoint
    from dspark_grpc.runtime.models.decode import prefill, tree_input

    print("== gpu-check: forward cost by rows", flush=True)
    model = inference_model(load_checkpoint(default_model_path(), progress=False), "fast", device=device)
    caches = []
    for i in range(16):
        caches.append(model.new_cache())
        prefill(model, caches[-1], [100 + i] * 200)

    def timed(batch) -> float:
        for _ in range(3):
            model.forward_batch(batch)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.forward_batch(batch)
        torch.cuda.synchronize(device)
        return 1e3 * (time.perf_counter() - t0) / repeats

    chain = lambda k: (list(range(10, 10 + k)), list(range(-1, k - 1)))  # noqa: E731
    costs = {f"1 session, {k} rows": timed([tree_input(caches[0], *chain(k))]) for k in (1, 4, 8, 16)}
    for c in (4, 16):
        for k in (1, 5):
            costs[f"{c} sessions, {k} row{'s' if k > 1 else ''} each"] = timed(
                [tree_input(caches[i], *chain(k)) for i in range(c)])
    return costs


def guarded(step, device: str) -> dict:
    """A step run here; its error (shown, and reported) instead of its figures where it fails: the next steps run."""
    try:
        return step(device)
    except Exception as e:  # noqa: BLE001 - any failure is a finding to report, and the bench still runs
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    if not torch.cuda.is_available():
        fix = " (a CPU-only build: `make clean && make gpu-check` installs PyPI's CUDA build)" \
            if torch.version.cuda is None else ""
        sys.exit(f"gpu-check: torch {torch.__version__} sees no CUDA device{fix}; nothing was checked")
    t0 = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    tests = run("CUDA tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "tests/runtime/test_cuda.py"],
                timeout=150)
    kernel = guarded(fused_vs_torch, args.device)
    costs = guarded(forward_costs, args.device)
    bench_json = OUT / "bench.json"
    bench_json.unlink(missing_ok=True)
    bench = run("bench", [sys.executable, "-m", "dspark_grpc.bench", *BENCH, "--device", args.device,
                          "--json", str(bench_json), "--plot", str(OUT / "bench.png")], timeout=270)
    elapsed = time.perf_counter() - t0
    result = json.loads(bench_json.read_text()) if bench_json.exists() else None
    REPORT.write_text(report(args.device, tests, kernel, costs, bench, result, elapsed))
    print(f"== gpu-check: {elapsed:.0f} s; wrote {REPORT.relative_to(ROOT)}", flush=True)
    passed = tests[0] and bench[0] and "error" not in costs and kernel.get("identical", -1) == kernel.get("contexts")
    sys.exit(0 if passed else 1)


def report(device: str, tests: tuple[bool, str], kernel: dict, costs: dict[str, float], bench: tuple[bool, str],
           result: dict | None, elapsed: float) -> str:
    from dspark_grpc.bench.machine import git_commit
    from dspark_grpc.bench.served import format_table

    index = torch.device(device).index or 0
    table = format_table(result) if result else f"no result: {bench[1]}"
    if "error" in costs:
        cost_lines = f"| failed: {costs['error']} | | |"
    else:
        one_row = costs["1 session, 1 rows"]
        cost_lines = "\n".join(f"| {name} | {ms:.2f} | {ms / one_row:.2f} |" for name, ms in costs.items())
    if "error" in kernel:
        kernel_line = f"FAILED: {kernel['error']}"
    else:
        kernel_line = (f"tokens identical in {kernel['identical']} of {kernel['contexts']}; median per chain "
                       f"{kernel['torch_us']:.0f} µs (torch) and {kernel['fused_us']:.0f} µs (fused)")
    return f"""# gpu-check: the stack on a CUDA device

`make gpu-check` (docs/bench/gpu_check.py) on {torch.cuda.get_device_name(index)}, torch {torch.__version__} (CUDA
{torch.version.cuda}), commit {git_commit() or "not recorded"}, {time.strftime("%Y-%m-%d")}: {elapsed:.0f} s in all.

- CUDA tests (tests/runtime/test_cuda.py): {"passed" if tests[0] else "FAILED"}: {tests[1]}
- The shipped drafter's DSpark chain, fused Triton kernel against the torch path, on the same block outputs:
  {kernel_line}.
- The embedded target's forward (fast precision: bf16, eager, rows in fixed chunks), by the rows it carries
  (200-token caches):

| forward | ms | x a 1-row step |
| --- | --- | --- |
{cost_lines}

- `dspark bench {" ".join(BENCH)} --device {device}` (embedded SmolLM2-135M-Instruct, the shipped drafter; both
  services on the device): {"passed" if bench[0] else "FAILED: " + bench[1]}

```text
{table}
```
"""


if __name__ == "__main__":
    main()
