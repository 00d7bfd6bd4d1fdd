"""The micro-benchmark command (bench/engine_bench.py) runs and reports; its timings are not asserted."""

from __future__ import annotations

import torch
from dspark_grpc.bench import engine_bench
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels import cpu_kernels
from test_batch_invariance import Q, fast_tiny_model


def test_torch_calls_are_counted_per_op(tiny_hf_models):
    model = fast_tiny_model(tiny_hf_models["qwen2"], Q.Q4_1)
    calls = engine_bench.count_torch_calls(model, context=8)
    matmul = "dspark.gguf_matmul" if cpu_kernels.available() else "_weight_int4pack_mm_for_cpu"
    # per layer: fused q/k/v, wo, fused gate/up, down; and the tied head (the tiny model's embedding is float: its
    # bf16 blocks on the same kernel, where it builds)
    assert calls[matmul] == 2 * 4 + cpu_kernels.available()
    exact = inference_model(load_checkpoint(tiny_hf_models["qwen2"], progress=False), "exact")
    assert matmul not in engine_bench.count_torch_calls(exact, context=8)


def test_the_command_prints_one_row_per_variant_and_clock(tiny_hf_models, capsys):
    engine_bench.main(["--model", str(tiny_hf_models["qwen2"]), "--rows", "1,2", "--rounds", "1", "--repeats", "1",
                       "--context", "8", "--threads", str(torch.get_num_threads())])
    out = capsys.readouterr().out
    for variant in ("exact (torch.float32", "fast (torch.bfloat16", "fast, rows attend together"):
        assert out.count(f"| {variant}") == 3, out  # wall, CPU and the aten-calls table
