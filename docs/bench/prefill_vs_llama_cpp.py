"""Prompt throughput of our target against llama.cpp's prompt evaluation, the same GGUF and the same prompt ids
(issue 37: one ~2,000-token prompt). Ours: a Generate of one new token through the target service (started here,
the default model and precision, no drafter), its `GenerationStats.prefill_seconds` (the prompt's forward and its
first token, timed in the service). llama.cpp: `Llama.eval` of the same ids (encoded by the target's own code) on as
many threads as the target's torch, n_batch 512, after a reset. Rounds alternate the two (a machine drifts);
ratios are per round. Needs llama-cpp-python (`make llama-cpp`). Prints one JSON object. Usage:

    PYTHONPATH=. .venv/bin/python docs/bench/prefill_vs_llama_cpp.py [--prompt-tokens 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.target_service.engine import encode_prompt

from docs.bench.long_prompt_fairness import PARAGRAPH
from tests.reliability.conftest import service
from tests.reliability.lifecycle_helpers import Outcome, generate_rpc

SETTLE_S = 2.0  # before each measurement: the other engine's threads stop spinning and sleep


def ours(address: str, text: str) -> tuple[int, float]:
    out = Outcome()
    generate_rpc(address, text, out, max_new_tokens=1, ignore_eos=True, mode=common_pb2.DECODE_MODE_AR)
    assert out.code == 0 and out.stats is not None, out.message
    return out.stats.prompt_tokens, out.stats.prefill_seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=2000, help="about how long the prompt is")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from llama_cpp import Llama, __version__

    model = default_model_path()
    tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(model)))
    text = PARAGRAPH * max(1, round(args.prompt_tokens * 0.9 / len(PARAGRAPH.split())))
    ids = encode_prompt(tokenizer, text, 1 << 31)
    threads = torch.get_num_threads()
    llm = Llama(model_path=str(model), n_ctx=len(ids) + 16, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)

    def llama() -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t0

    rows: dict[str, list[float]] = {"ours_tok_s": [], "llama_cpp_tok_s": []}
    with service("target", []) as target:
        prompt_tokens, _ = ours(target.address, text)  # warms our path up
        assert prompt_tokens == len(ids), (prompt_tokens, len(ids))
        llama()  # and llama.cpp's
        for _ in range(args.rounds):
            time.sleep(SETTLE_S)
            rows["ours_tok_s"].append(len(ids) / ours(target.address, text)[1])
            time.sleep(SETTLE_S)
            rows["llama_cpp_tok_s"].append(len(ids) / llama())
    ratio = [a / b for a, b in zip(rows["ours_tok_s"], rows["llama_cpp_tok_s"], strict=True)]
    report = {k: dict(median=round(statistics.median(v), 1), each=[round(x, 1) for x in v]) for k, v in rows.items()}
    report.update(prompt_tokens=len(ids), ours_vs_llama_cpp=[round(x, 2) for x in ratio], threads=threads,
                  llama_cpp=f"llama-cpp-python {__version__}", cpu=platform.processor() or platform.machine())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
