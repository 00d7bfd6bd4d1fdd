"""The attention op of the compiled step alone (`torch.ops.dspark.row_attention`), as docs/PERFORMANCE.md reports it:
microseconds per call for SmolLM2's shapes (9 query heads, 3 KV heads, head dimension 64) at 200 and 400 keys and 1, 4,
8 rows, causal masks over one slot. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/row_attention_op.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import dspark_grpc.serving.openmp  # noqa: F401  (before torch: libgomp's spin count)
import torch
from dspark_grpc.runtime.kernels import cpu_kernels

H, KV, D, CAPACITY, SLOTS = 9, 3, 64, 1024, 4


def microseconds(fn, *args, calls: int = 200, repeats: int = 7) -> float:
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    k_store = torch.randn(SLOTS, KV, CAPACITY, D, generator=g).bfloat16()
    v_store = torch.randn(SLOTS, KV, CAPACITY, D, generator=g).bfloat16()
    print("| keys | rows | us per call |\n|---|---|---|")
    for keys in (200, 400):
        for rows in (1, 4, 8):
            q = torch.randn(rows, H, D, generator=g).bfloat16()
            k, v = torch.randn(rows, KV, D, generator=g).bfloat16(), torch.randn(rows, KV, D, generator=g).bfloat16()
            slots, write_rows = torch.zeros(rows, dtype=torch.long), torch.arange(keys - rows, keys)
            mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
            us = microseconds(cpu_kernels.row_attention, q, k, v, k_store, v_store, slots, write_rows, mask)
            print(f"| {keys} | {rows} | {us:.1f} |")


if __name__ == "__main__":
    main()
