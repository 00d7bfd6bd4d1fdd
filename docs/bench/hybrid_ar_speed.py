"""In-process AR speed of a random qwen3_5 hybrid (Gated DeltaNet + gated attention) vs a Llama of the same
shape (hidden size, layers, heads, MLP, vocabulary): tokens/s of greedy AR (one verify + commit per token, packed
weights), each model timed in alternation, median of the repeats. Timed by the process's CPU time (one torch thread
by default), so that other work on a shared machine does not count; wall-clock figures are printed too. Also
the CPU seconds of prefilling a 256-token prompt (one forward). Usage:

    .venv/bin/python docs/bench/hybrid_ar_speed.py [--threads 1] [--steps 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

SIZES = {  # name: (hidden, layers, heads, kv heads, head_dim, intermediate)
    "tiny (test size)": (64, 4, 4, 2, 16, 128),
    "small": (512, 8, 8, 2, 64, 1536),
}
VOCAB = 49152


def build(kind: str, size: tuple[int, ...], root: Path) -> Transformer:
    hidden, layers, heads, kv, head_dim, inter = size
    common = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=4096)
    if kind == "qwen35":  # 3 of 4 layers linear attention; linear heads as Qwen3.5's ratios (2 value heads per key)
        config = Qwen3_5TextConfig(**common, linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
                                   linear_key_head_dim=head_dim, linear_value_head_dim=head_dim)
        model = Qwen3_5ForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    directory = root / f"{kind}-{hidden}"
    model.save_pretrained(directory)
    return Transformer.from_checkpoint(load_checkpoint(directory, progress=False)).pack()


def ar_tokens_per_second(model: Transformer, steps: int) -> tuple[float, float]:
    """(tokens per CPU second, tokens per wall second)."""
    cache = model.new_cache(max_length=steps + 64)
    logits, _ = prefill(model, cache, list(range(100, 132)))
    token = int(logits.argmax())
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        logits, _ = verify_tree(model, cache, [token], [-1])
        commit_path(cache, [0])
        token = int(logits[0].argmax())
    return steps / (time.process_time() - c0), steps / (time.perf_counter() - t0)


def prefill_cpu_seconds(model: Transformer, tokens: int = 256) -> float:
    cache = model.new_cache(max_length=tokens)
    c0 = time.process_time()
    prefill(model, cache, [100 + i % 1000 for i in range(tokens)])
    return time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, size in SIZES.items():
            models = {kind: build(kind, size, Path(tmp)) for kind in ("llama", "qwen35")}
            runs: dict[str, list[tuple[float, float]]] = {kind: [] for kind in models}
            for model in models.values():
                ar_tokens_per_second(model, 8)  # warm-up
            for _ in range(args.repeats):
                for kind, model in models.items():
                    runs[kind].append(ar_tokens_per_second(model, args.steps))
            cpu = {kind: statistics.median(r[0] for r in rs) for kind, rs in runs.items()}
            wall = {kind: statistics.median(r[1] for r in rs) for kind, rs in runs.items()}
            pre = {kind: statistics.median(prefill_cpu_seconds(m) for _ in range(args.repeats))
                   for kind, m in models.items()}
            print(f"{name}: prefill of 256 tokens: llama {pre['llama']:.3f}, qwen35 {pre['qwen35']:.3f} CPU s")
            print(f"{name}: llama {cpu['llama']:.0f}, qwen35 {cpu['qwen35']:.0f} tokens per CPU second "
                  f"(qwen35/llama {cpu['qwen35'] / cpu['llama']:.2f}); wall: llama {wall['llama']:.0f}, qwen35 "
                  f"{wall['qwen35']:.0f} tok/s", flush=True)


if __name__ == "__main__":
    main()
