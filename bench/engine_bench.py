"""`python -m dspark_grpc.bench.engine_bench`: ms per target forward for 1/2/4/8/16 verify rows per precision.

Each variant is timed by the start-up profiler itself (cost_profile.profile_target: a chain verify of M rows on
top of `--context` committed rows, sizes interleaved), `--rounds` times with the variants interleaved (a busy
machine then slows every variant alike); the median over rounds is printed, in wall ms and in CPU ms of the
process (all threads: on a machine shared with other work the CPU figure is the steadier one). Also the aten
calls of one eager 1-row forward (an AR step), counted with a TorchDispatchMode. "fast, rows attend together" is
the fast precision with one SDPA over all rows of a verify: not batch invariant (not lossless), shown for the cost
of invariance.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import dspark_grpc.serving.openmp  # noqa: F401  (before torch: libgomp's spin count)
import torch
from dspark_grpc.runtime.formats.checkpoint import PRECISIONS, default_model_path, inference_model, load_checkpoint
from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache
from dspark_grpc.runtime.models.decode import commit_path, prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.linear import matmul_kind
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.serving.cost_profile import profile_target
from torch.utils._python_dispatch import TorchDispatchMode


class _CountCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[str(func.overloadpacket).removeprefix("aten.")] += 1
        return func(*args, **(kwargs or {}))


def count_torch_calls(model: Transformer, context: int) -> Counter[str]:
    """aten calls (by op) of one 1-row forward on top of `context` committed rows."""
    cache = model.new_cache()
    prefill(model, cache, torch.randint(model.config.vocab_size, (context,)).tolist())
    with _CountCalls() as mode:
        model.forward_batch([tree_input(cache, [0], [-1])])
    return mode.calls


def ar_steps(model: Transformer, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy AR, one 1-row forward per token, on a cache that grows while decoding: tokens[0] from the prompt,
    then logits[i] -> tokens[i + 1]."""
    cache = model.new_cache(initial_capacity=len(prompt) + 4)
    logits, _ = prefill(model, cache, prompt)
    tokens, rows = [int(logits.argmax())], []
    for _ in range(steps):
        step, _ = verify_tree(model, cache, [tokens[-1]], [-1])
        commit_path(cache, [0])
        rows.append(step[0])
        tokens.append(int(step[0].argmax()))
    return tokens, rows


def check_invariance(model: Transformer, steps: int = 48, context: int = 200) -> str:
    """Greedy AR for `steps` tokens, then the same tokens verified as chains of 2..16 rows: how many rows differ."""
    prompt = torch.randint(model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens, rows = ar_steps(model, prompt, steps)
    checked = differ = 0
    for width in (2, 3, 4, 5, 8, 16):
        cache = model.new_cache()
        prefill(model, cache, prompt)
        for lo in range(0, steps - width + 1, width):
            out, _ = verify_tree(model, cache, tokens[lo : lo + width], list(range(-1, width - 1)))
            commit_path(cache, list(range(width)))
            differ += sum(not torch.equal(out[j], rows[lo + j]) for j in range(width))
            checked += width
    return f"{differ} of {checked} rows differ (chains of 2, 3, 4, 5, 8, 16 rows over {steps} AR steps)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dspark_grpc.bench.engine_bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a .gguf file or an HF directory; default: the embedded SmolLM2 GGUF")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--context", type=int, default=200, help="committed rows under each verify")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per size and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compile", default="off", help="off, fast or max: also time the fast precision's compiled step "
                   "(compiled first, progress shown) and check its verify rows against its AR steps")
    p.add_argument("--compile-cache", type=Path, default=default_compile_cache(),
                   help="where the compiled step is saved and looked up (as the target's --compile-cache)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_model_path()
    rows = [int(r) for r in args.rows.split(",")]
    variants: dict[str, Transformer] = {}
    for precision in args.precisions.split(","):
        model = inference_model(load_checkpoint(path, progress=False, precision=precision), precision)
        variants[f"{precision} ({model.dtype}, {matmul_kind(model)})"] = model
        if precision == "fast" and args.compile != "off":
            compiled = inference_model(load_checkpoint(path, progress=False, precision=precision), precision,
                                       compile=args.compile, progress=True, compile_cache=args.compile_cache)
            variants[f"{precision}, compile {args.compile}"] = compiled
            print(f"compiled step, verify rows vs AR steps: {check_invariance(compiled)}", flush=True)
        if model.batch_invariant:
            shared = inference_model(load_checkpoint(path, progress=False, precision=precision), precision)
            shared.batch_invariant = False
            variants[f"{precision}, rows attend together (NOT lossless)"] = shared
    clocks = {"wall": time.perf_counter, "CPU": time.process_time}
    ms: dict[tuple[str, str], list[list[float]]] = {(c, name): [] for name in variants for c in clocks}
    for _ in range(args.rounds):
        for name, model in variants.items():
            for clock_name, clock in clocks.items():
                table = profile_target(model, rows, repeats=args.repeats, context=args.context, clock=clock)
                raw = table.measured or table.seconds  # before the table's running max
                ms[clock_name, name].append([s * 1e3 for size, s in zip(table.sizes, raw, strict=True)
                                             if size in rows])
    print(f"{path.name}, {args.threads} threads, {args.context} committed rows; ms per forward, "
          f"median of {args.rounds} rounds x {args.repeats} repeats; load average {_load_average()}")
    print(f"| variant | clock | {' | '.join(f'{r} rows' for r in rows)} |")
    print(f"|---|---|{'---|' * len(rows)}")
    for (clock_name, name), runs in ms.items():
        cells = [f"{statistics.median(r[i] for r in runs):.1f}" for i in range(len(rows))]
        print(f"| {name} | {clock_name} | {' | '.join(cells)} |")
    print("\n| variant | aten calls per eager 1-row forward | top ops |\n|---|---|---|")
    for name, model in variants.items():
        if model.compiled is not None:
            print(f"| {name} | (a compiled graph) | |")
            continue
        calls = count_torch_calls(model, args.context)
        print(f"| {name} | {calls.total()} | {', '.join(f'{op} {n}' for op, n in calls.most_common(5))} |")


def _load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
