"""Run by tests/runtime/test_kernel_isas.py in a process of its own, whose CPU kernels are built for one instruction
set (DSPARK_CPU_MARCH, its own DSPARK_COMPILE_CACHE): the checks the suite makes of the kernels built for this
machine, made of another build.

    python isa_checks.py INPUTS OUTPUTS build-only|run [TINY_HF_DIR ...]

build-only: the build must compile (an instruction set this CPU cannot run). run: every kernel's rows are batch
invariant (an M-row call's row equals its 1-row call bitwise), the BF16 matmul is within its float32 error bound
of the float64 product, each tiny model's verify rows equal its AR steps bitwise in the fast precision (its float
matrices on the BF16 kernel, and again with them as Q4_1 blocks, and as llama.cpp's Q4_K_M and Q5_K_M mixes write
them: Q4_K/Q5_K/Q6_K where rows are multiples of 256, Q5_0/Q5_1/Q8_0 where not); OUTPUTS gets the kernels' outputs on
the shared INPUTS for the test to compare across builds, and `kernel_isa()`.
"""

from __future__ import annotations

import sys

import gguf
import torch
from block_quants import fast_block_model, llama_cpp_mix
from dspark_grpc.bench.engine_bench import check_invariance
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.cpu_kernels import default_compile_cache

Q = gguf.GGMLQuantizationType
ROWS = [*range(1, 17), 40]
U32 = 2.0**-24  # float32's unit roundoff


def rows_invariant(run, x: torch.Tensor) -> None:
    ones = torch.cat([run(x[i : i + 1]) for i in range(x.shape[0])])
    for m in ROWS:
        assert torch.equal(run(x[:m]), ones[:m]), m


def bf16_within_bound(args: tuple, out: torch.Tensor, reference: torch.Tensor) -> None:
    """bf16 x bf16 products are exact in float32; K of them summed in float32 err by at most
    gamma_K * sum |x_k w_k| (gamma_K = K u / (1 - K u)), and the bias adds one more rounding."""
    x, weight = args[0].double(), reference.double()
    k = x.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    bound = gamma * (x.abs() @ weight.abs().T) + U32 * (x @ weight.T).abs() + 1e-30
    err = (out.double() - x @ weight.T).abs()
    assert (err <= bound).all(), (err / bound).max().item()


def main(inputs_path: str, outputs_path: str, mode: str, *model_dirs: str) -> None:
    path = cpu_kernels._library_path(default_compile_cache())
    path.parent.mkdir(parents=True, exist_ok=True)
    cpu_kernels._build(path)  # this instruction set's build must compile
    if mode == "build-only":
        return
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    inputs = torch.load(inputs_path)
    outputs = {"isa": cpu_kernels.kernel_isa(), "matmul": []}
    for args in inputs["matmul"]:
        x, rest = args[0], args[1:]
        rows_invariant(lambda rows, rest=rest: torch.ops.dspark.gguf_matmul(rows, *rest), x)
        outputs["matmul"].append(torch.ops.dspark.gguf_matmul(*args))
    for args, reference in inputs["bf16"]:
        out = torch.ops.dspark.gguf_matmul(*args)
        bf16_within_bound(args, out, reference)
        rows_invariant(lambda rows, rest=args[1:]: torch.ops.dspark.gguf_matmul(rows, *rest), args[0])
        outputs["matmul"].append(out)
    q, k, v, ks, vs, slots, rows, mask = inputs["attention"]
    ks, vs = ks.clone(), vs.clone()
    outputs["attention"] = torch.ops.dspark.row_attention(q, k, v, ks, vs, slots, rows, mask)
    outputs["alone"] = torch.cat([torch.ops.dspark.row_attention(q[r : r + 1], k[r : r + 1], v[r : r + 1], ks, vs,
                                                                 slots[r : r + 1], rows[r : r + 1], mask[r : r + 1])
                                  for r in range(q.shape[0])])  # the others' keys already written
    for directory in model_dirs:
        for blocks in (None, Q.Q4_1, llama_cpp_mix(Q.Q4_K), llama_cpp_mix(Q.Q5_K)):
            model = (inference_model(load_checkpoint(directory, progress=False), "fast") if blocks is None
                     else fast_block_model(directory, blocks))
            verdict = check_invariance(model, steps=24)
            assert verdict.startswith("0 of"), (directory, blocks, verdict)
    torch.save(outputs, outputs_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
