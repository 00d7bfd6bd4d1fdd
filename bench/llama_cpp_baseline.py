"""llama.cpp's greedy AR speed on the same GGUF and prompts: the reference line of `dspark bench --baseline llama-cpp`.

The bench runs this as a child process after its own modes (never alongside them). Prompts are encoded by the
target service's own code (same chat template, same ids), generation is greedy with EOS honoured unless told
otherwise, and llama.cpp runs with the same number of threads as the target. One JSON object goes to stdout:
tokens_per_s (generated tokens / wall time, prompt evaluation included, as in the bench), the outputs (token ids)
and the setup. Needs `llama-cpp-python` (`make llama-cpp`, a ~12 minute source build); not used by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.target_service.engine import encode_prompt

# llama.cpp's llama_ftype values (include/llama.h) of the files `quantize` writes
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


def quantize(source: Path, out: Path, ftype: str, threads: int = 2) -> Path:
    """`source` requantized by llama.cpp's own quantizer (`llama_model_quantize`, as `llama-quantize --allow-requantize`
    does) to `ftype`, written to `out` once (a file already there is kept); its log lines go to /dev/null."""
    import llama_cpp

    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = FTYPES[ftype], True, threads
    partial = out.with_name(f"{out.name}.part")
    with open(os.devnull, "w") as null:  # the C library prints a line per tensor on fd 2
        saved = os.dup(2)
        os.dup2(null.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {ftype} (llama_model_quantize returned {rc})")
    partial.replace(out)
    return out


def generate(llm: object, prompt_ids: list[int], max_new_tokens: int, eos: frozenset[int]) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt_ids, temp=0.0, top_k=1, reset=True):  # temp 0: llama.cpp's greedy sampler
        if token in eos:  # not counted, as in the bench's own modes
            break
        out.append(int(token))
        if len(out) >= max_new_tokens:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_grpc.bench.llama_cpp_baseline", description=__doc__)
    p.add_argument("--prompts-json", required=True, help="a JSON list of bench prompts ({prompt} or {messages})")
    p.add_argument("--model", help="a .gguf file; default: the embedded SmolLM2 GGUF")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ignore-eos", action="store_true")
    args = p.parse_args(argv)
    try:
        from llama_cpp import Llama, __version__
    except ImportError:
        print("llama-cpp-python is not installed: run `make llama-cpp` (builds it from source, ~12 minutes)",
              file=sys.stderr)
        return 2
    model = Path(args.model) if args.model else default_model_path()
    if model.suffix != ".gguf":
        print(f"llama.cpp needs a .gguf model, got {model}", file=sys.stderr)
        return 2
    tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(model)))
    eos = frozenset() if args.ignore_eos else frozenset(tokenizer.eos_token_ids)
    prompts = json.loads(Path(args.prompts_json).read_text())
    ids = [encode_prompt(tokenizer, p.get("prompt") or p["messages"], 1 << 31) for p in prompts]
    llm = Llama(model_path=str(model), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, verbose=False)
    generate(llm, ids[0], 16, eos)  # warm-up, not timed
    outputs, seconds = [], []
    for i, prompt_ids in enumerate(ids):
        t0 = time.perf_counter()
        outputs.append(generate(llm, prompt_ids, args.max_new_tokens, eos))
        seconds.append(time.perf_counter() - t0)
        print(f"  [llama.cpp] {i + 1}/{len(ids)}: {len(outputs[-1])} tokens", file=sys.stderr, flush=True)
    generated = sum(len(o) for o in outputs)
    json.dump({"engine": f"llama.cpp (llama-cpp-python {__version__})", "model": str(model),
               "threads": args.threads, "tokens_per_s": generated / sum(seconds), "generated_tokens": generated,
               "wall_s": sum(seconds), "outputs": outputs}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
