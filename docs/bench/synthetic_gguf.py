"""A multi-GB GGUF of a user's kind, made here (issue 55's memory bound where it matters): a Llama of a chosen shape
with random weights and the embedded SmolLM2's tokenizer and chat template, written in f16 and requantized by
llama.cpp's own quantizer (as a user's downloaded Q4_K_M was made).

    PYTHONPATH=. .venv/bin/python docs/bench/synthetic_gguf.py --shape 3b --ftype Q4_K_M --out runs/llama-3b-q4_k_m.gguf

The f16 intermediate is deleted once quantized. Random weights: the file's tokens mean nothing, but its size, tensor
types and per-token cost are those of a real model of the shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

# name -> (hidden, layers, heads, kv heads, feed-forward); head dim = hidden / heads
SHAPES = {"1b": (2048, 16, 32, 8, 8192), "3b": (3072, 28, 24, 8, 8192), "8b": (4096, 32, 32, 8, 14336)}
DIMENSION_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                  "attention.head_count_kv", "rope.dimension_count")


def copy_field(writer: gguf.GGUFWriter, field: gguf.ReaderField) -> None:
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        sub = field.types[1]
        if sub == gguf.GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        else:
            values = [field.parts[i][0].item() for i in field.data]
        writer.add_array(field.name, values)
    elif kind == gguf.GGUFValueType.STRING:
        writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
    else:
        writer.add_key_value(field.name, field.parts[field.data[0]][0].item(), kind)


def write_f16(source: Path, out: Path, shape: str, seed: int = 0) -> None:
    hidden, layers, heads, kv_heads, ff = SHAPES[shape]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(source)
    vocab = int(reader.fields["llama.vocab_size"].parts[-1][0])
    writer = gguf.GGUFWriter(out, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        if field.name.removeprefix("llama.") in DIMENSION_KEYS:
            continue
        copy_field(writer, field)
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors: list[tuple[str, tuple[int, ...], type]] = [("token_embd.weight", (vocab, hidden), np.float16),
                                                         ("output_norm.weight", (hidden,), np.float32)]
    for i in range(layers):  # (out, in) as torch stores a matrix; gguf writes the shape reversed
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", (hidden,), np.float32), (b + "ffn_norm.weight", (hidden,), np.float32),
                    (b + "attn_q.weight", (heads * head_dim, hidden), np.float16),
                    (b + "attn_k.weight", (kv_heads * head_dim, hidden), np.float16),
                    (b + "attn_v.weight", (kv_heads * head_dim, hidden), np.float16),
                    (b + "attn_output.weight", (hidden, heads * head_dim), np.float16),
                    (b + "ffn_gate.weight", (ff, hidden), np.float16), (b + "ffn_up.weight", (ff, hidden), np.float16),
                    (b + "ffn_down.weight", (hidden, ff), np.float16)]
    for name, shape, dtype in tensors:  # the tied head is token_embd, as SmolLM2's
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for k, (_, shape, dtype) in enumerate(tensors):  # one tensor in memory at a time
        if len(shape) == 1:
            data = np.ones(shape, dtype)
        else:
            data = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
        writer.write_tensor_data(data)
        print(f"\rtensor {k + 1}/{len(tensors)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    writer.close()


def main() -> None:
    from dspark_grpc.bench.llama_cpp_baseline import quantize
    from dspark_grpc.runtime.formats.checkpoint import default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="3b")
    parser.add_argument("--ftype", default="Q4_K_M")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.out.is_file():
        print(f"{args.out} is there")
        return
    f16 = args.out.with_name(f"{args.out.stem}-f16.gguf")
    if not f16.is_file():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_f16(default_model_path(), f16, args.shape)
    print(f"quantizing to {args.ftype} with llama.cpp's quantizer", file=sys.stderr)
    quantize(f16, args.out, args.ftype)
    f16.unlink()
    print(f"{args.out}: {args.out.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
