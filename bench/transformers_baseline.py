"""HF transformers' greedy AR on the same model and prompts: the reference lines `dspark bench --baseline transformers`
(its `generate` as a user calls it: eager, a dynamic cache) and `--baseline transformers-compiled` (its static cache
with the forward under torch.compile, "reduce-overhead" on a GPU: CUDA graphs), issue 57 point 3.

The bench runs this as a child process after its own modes (never alongside them). The model: an HF directory, or a
GGUF through transformers' own GGUF loader (every tensor dequantized to float32: what our `exact` precision runs, so
its greedy tokens are ours in that precision). Prompts are encoded by the target service's own code; generation is
greedy, EOS honoured unless told otherwise; on the GPU where there is one (`--device`), else on the CPU with as many
threads as torch's default. One JSON object goes to stdout, as llama_cpp_baseline's: tokens_per_s (generated tokens
/ wall time, prompt included), the outputs (token ids) and the setup.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.target_service.engine import encode_prompt


def load_model(path: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.to(device).eval()


def generate(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, eos: list[int],
             static_cache: bool) -> list[int]:
    """Greedy: `eos` empty generates max_new_tokens whatever comes (the EOS token included, as the bench's modes do
    with ignore_eos); else stops at the first of them, which is not returned."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                              cache_implementation="static" if static_cache else None)
    model.generation_config.eos_token_id = eos or None  # else generate fills an unset EOS in from the model's
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=device), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device))
    new = out[0, len(prompt_ids):].tolist()
    stop = next((i for i, t in enumerate(new) if t in eos), len(new))
    return new[:stop]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_grpc.bench.transformers_baseline",
                                description=__doc__)
    p.add_argument("--prompts-json", required=True, help="a JSON list of bench prompts ({prompt} or {messages})")
    p.add_argument("--model", help="a .gguf file or an HF directory; default: the embedded SmolLM2 GGUF")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--compiled", action="store_true",
                   help="the static cache and torch.compile of the forward (reduce-overhead on a GPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("transformers is not installed: pip install transformers (it comes with the dev extra)", file=sys.stderr)
        return 2
    path = Path(args.model) if args.model else default_model_path()
    if path.is_dir():
        tokenizer = TextTokenizer.from_hf_dir(path)
    else:
        tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(path)))
    eos = [] if args.ignore_eos else sorted(tokenizer.eos_token_ids)
    prompts = json.loads(Path(args.prompts_json).read_text())
    ids = [encode_prompt(tokenizer, p.get("prompt") or p["messages"], 1 << 31) for p in prompts]
    device = torch.device(args.device)
    model = load_model(path, device)
    if args.compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead" if device.type == "cuda" else None)
    generate(model, ids[0], 16, eos, args.compiled)  # warm-up (and the compile), not timed
    outputs, seconds = [], []
    for i, prompt_ids in enumerate(ids):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outputs.append(generate(model, prompt_ids, args.max_new_tokens, eos, args.compiled))
        seconds.append(time.perf_counter() - t0)
        print(f"  [transformers] {i + 1}/{len(ids)}: {len(outputs[-1])} tokens", file=sys.stderr, flush=True)
    generated = sum(len(o) for o in outputs)
    setup = "static cache, torch.compile" if args.compiled else "eager, dynamic cache"
    json.dump({"engine": f"transformers {transformers.__version__} ({setup}, float32, {device})",
               "model": str(path), "threads": torch.get_num_threads(), "tokens_per_s": generated / sum(seconds),
               "generated_tokens": generated, "wall_s": sum(seconds), "outputs": outputs}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
