"""The CPU kernels (runtime/kernels/gguf_matmul.cpp, row_attention.cpp) have a path per instruction set and a machine
builds the one its CPU has (-march=native). So that no host kind finds a path the suite never ran, the others are
built here too, each in a process of its own (tests/runtime/isa_checks.py): x86-64-v3 (AVX2: the block and bf16
matmuls' AVX2 paths, attention in 8 lanes) and x86-64-v4 (AVX-512 without VNNI or BF16: the bf16 matmul's FMA path,
attention in 16 lanes without vdpbf16ps). A level this CPU cannot run is only compiled. Each build must keep every
kernel's rows batch invariant (every block type: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, on quantized
weights, random bytes and extreme codes) and the tiny fast models' verify rows equal to their AR steps (float, Q4_1,
and llama.cpp's Q4_K_M / Q5_K_M mixes at widths 64 and 256); across builds the block matmul agrees bitwise (exact
integer block dots, one float order), bf16 and attention within their rounding."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
from block_quants import extreme_blocks, quantize_blocks, random_blocks, wide_tiny_models
from dspark_grpc.runtime.kernels import cpu_kernels
from dspark_grpc.runtime.kernels.quant import BLOCK_TYPES, K_TYPES, BlockWeight, bf16_blocks

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")

# -march level -> the CPU flags it needs to run
LEVELS = {"x86-64-v3": ("avx2", "fma", "f16c", "bmi2"),
          "x86-64-v4": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd")}
EXPECTED_ISA = {"x86-64-v3": "blocks avx2, bf16 avx2, attention avx2",  # neither level has AVX-512 VNNI or BF16
                "x86-64-v4": "blocks avx2, bf16 avx512f, attention avx512f"}
SCRIPT = Path(__file__).with_name("isa_checks.py")
U32, U_BF16 = 2.0**-24, 2.0**-8  # unit roundoffs
Q = gguf.GGMLQuantizationType


def runs_here(level: str) -> bool:
    flags = cpu_kernels._cpu_flags().split()
    return all(flag in flags for flag in LEVELS[level])


def shared_inputs(g: torch.Generator) -> dict:
    matmul = []
    for qtype in BLOCK_TYPES:
        shape = (64, 512) if qtype in K_TYPES else (64, 96)
        cases = [quantize_blocks(torch.randn(*shape, generator=g), qtype)]
        if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q8_0):  # the new types' every field value and largest integer sums
            cases += [random_blocks(shape, qtype, seed=int(qtype)), extreme_blocks(shape, qtype, high=True),
                      extreme_blocks(shape, qtype, high=False)]
        for blocks in cases:
            w = BlockWeight.of([blocks])
            x = torch.randn(40, shape[1], generator=g)
            x[:3] = torch.tensor([1.0, -1.0, 0.0])[:, None]  # activations of one magnitude (codes +-127), zero
            matmul.append((x.bfloat16(), w.codes, w.d, w.m, int(qtype), None, torch.float32))
    bf16 = []
    for shape in ((48, 96), (576, 1536)):
        weight = torch.randn(*shape, generator=g).bfloat16()
        w = BlockWeight.of([bf16_blocks(weight)])
        x = torch.randn(40, shape[1], generator=g).bfloat16()
        args = (x, w.codes, None, None, int(gguf.GGMLQuantizationType.BF16), None, torch.float32)
        bf16.append((args, weight.float()))
    slots_count, KV, cap, D, H, R, C = 2, 3, 40, 64, 9, 4, 33
    attention = (torch.randn(R, H, D, generator=g).bfloat16(), torch.randn(R, KV, D, generator=g).bfloat16(),
                 torch.randn(R, KV, D, generator=g).bfloat16(),
                 torch.randn(slots_count, KV, cap, D, generator=g).bfloat16(),
                 torch.randn(slots_count, KV, cap, D, generator=g).bfloat16(), torch.tensor([0, 1, 1, 0]),
                 torch.tensor([29, 30, 31, 32]), torch.ones(R, C, dtype=torch.bool).tril(C - R))
    return {"matmul": matmul, "bf16": bf16, "attention": attention}


def attention_bound(attention: tuple, ours: torch.Tensor) -> torch.Tensor:
    """|o_a - o_b| for two builds: each score q.k / sqrt(D) errs by at most gamma_D sum |q_d k_d| / sqrt(D) (bf16
    products exact in float32), which moves a softmax weight p_c by at most p_c * 2 * max|ds|; the weighted sum of
    C values adds gamma_C; then each side rounds to bf16 (half an ulp, 2^-8 relative, each)."""
    q, k, v, ks, vs = (t.double() for t in attention[:5])
    D, C = q.shape[-1], attention[7].shape[-1]
    gamma = lambda n: n * U32 / (1 - n * U32)  # noqa: E731
    keys = torch.cat([ks.flatten(0, 2), k.flatten(0, 1)]).abs()
    score_err = gamma(D) * (q.abs().flatten(0, 1) @ keys.T).max() / D**0.5
    v_max = torch.cat([vs.flatten(), v.flatten()]).abs().max()
    return 2 * (2 * score_err + gamma(C + 4)) * v_max + 2 * U_BF16 * ours.double().abs()


@pytest.fixture(scope="module")
def wide_tiny_hf_models(tiny_hf_models, tmp_path_factory):
    return wide_tiny_models(tiny_hf_models, tmp_path_factory.mktemp("wide_tiny_hf"))


def test_every_instruction_set_build_keeps_rows_invariant_and_agrees(tmp_path, tiny_hf_models, wide_tiny_hf_models):
    g = torch.Generator().manual_seed(11)
    inputs = shared_inputs(g)
    torch.save(inputs, tmp_path / "inputs.pt")
    procs = {}
    for level in LEVELS:  # both builds at once: most of the time is g++ on torch's headers
        mode = "run" if runs_here(level) else "build-only"
        env = {**os.environ, "DSPARK_CPU_MARCH": level, "DSPARK_COMPILE_CACHE": str(tmp_path / level)}
        procs[level] = (mode, subprocess.Popen(
            [sys.executable, str(SCRIPT), str(tmp_path / "inputs.pt"), str(tmp_path / f"{level}.pt"), mode,
             *(str(d) for d in (tiny_hf_models["llama3"], tiny_hf_models["qwen2"], *wide_tiny_hf_models.values()))],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    ours_matmul = [torch.ops.dspark.gguf_matmul(*args) for args in inputs["matmul"]]
    ours_bf16 = [torch.ops.dspark.gguf_matmul(*args) for args, _ in inputs["bf16"]]
    q, k, v, ks, vs, slots, rows, mask = inputs["attention"]
    ours_attention = torch.ops.dspark.row_attention(q, k, v, ks.clone(), vs.clone(), slots, rows, mask)
    bound = attention_bound(inputs["attention"], ours_attention)
    ran = []
    for level, (mode, proc) in procs.items():
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{level}: {output[-3000:]}"
        if mode != "run":
            continue
        ran.append(level)
        theirs = torch.load(tmp_path / f"{level}.pt")
        assert theirs["isa"] == EXPECTED_ISA[level], theirs["isa"]
        for ours, other in zip(ours_matmul, theirs["matmul"], strict=False):
            assert torch.equal(ours, other), level
        for (args, weight), ours, other in zip(inputs["bf16"], ours_bf16, theirs["matmul"][len(ours_matmul):],
                                               strict=True):
            x = args[0].double()
            k_len = x.shape[-1]
            both = 2 * (k_len * U32 / (1 - k_len * U32)) * (x.abs() @ weight.double().abs().T)
            assert ((ours.double() - other.double()).abs() <= both + 1e-30).all(), level
        assert ((theirs["attention"].double() - ours_attention.double()).abs() <= bound).all(), level
        assert torch.equal(theirs["alone"], theirs["attention"]), level
    assert ran, "no other instruction set ran here"
