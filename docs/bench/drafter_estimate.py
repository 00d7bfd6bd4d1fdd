"""dspark-train's held-out estimate for several drafters on the same held-out sequences.

    PYTHONPATH=. .venv/bin/python docs/bench/drafter_estimate.py .cache/dspark-train/<key> DRAFTER [DRAFTER ...]
    PYTHONPATH=. .venv/bin/python docs/bench/drafter_estimate.py docs/prompts/heldout.jsonl DRAFTER [DRAFTER ...]
    PYTHONPATH=. .venv/bin/python docs/bench/drafter_estimate.py humaneval DRAFTER [DRAFTER ...]

The sequences: the held-out shards of a dspark-train feature cache (<key>), or a bench prompts file's prompts
("humaneval": the first 40 HumanEval problems, as `dspark bench --prompts humaneval --limit 40` poses them)
continued greedily by the embedded target in the fast precision (up to 128 new tokens, as `dspark bench
--max-new-tokens 128` does; chat prompts in the chat template, plain prompts as they are), with an anchor at every
position. Each DRAFTER is a drafter directory for the embedded target. Prints the acceptance length and the
per-position acceptance of greedy chains (train/loop.py `evaluate`, the estimate dspark-train logs at every
eval).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from dspark_grpc.bench.prompts import HUMANEVAL, load_prompts
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.drafter_formats import load_drafter
from dspark_grpc.train.cli import load_target
from dspark_grpc.train.data import Prompt, TargetSequence, encode_prompt, generate_batch
from dspark_grpc.train.loop import TrainSettings, evaluate
from dspark_grpc.train.vocab import DraftVocab

NEW_TOKENS = 128
HUMANEVAL_LIMIT = 40


def prompt_sequences(path: Path, layer_ids: list[int]) -> list[TargetSequence]:
    target = load_target(None, torch.device("cpu"), "fast", "max")
    tok = target.tokenizer
    prompts = []
    items = load_prompts(path)[:HUMANEVAL_LIMIT] if str(path) == HUMANEVAL else [
        json.loads(line) for line in path.read_text().splitlines()]
    for i, item in enumerate(items):
        if "messages" in item:
            prompts.append(encode_prompt(tok, Prompt(str(i), item["messages"][-1]["content"], "bench")))
        else:
            prompts.append(tok.encode(item["prompt"], add_special_tokens=True))
    return generate_batch(target.generator, prompts, layer_ids, NEW_TOKENS, eos_ids=tok.eos_token_ids,
                          prompt_ids=[str(i) for i in range(len(prompts))])


def main(source: str, drafters: list[str]) -> None:
    path = Path(source)
    if path.suffix == ".jsonl" or source == HUMANEVAL:
        first = load_drafter(drafters[0], target_path=default_model_path())
        sequences, anchors = prompt_sequences(path, list(first.config.target_layer_ids)), NEW_TOKENS
    else:
        sequences = [TargetSequence(**r) for shard in sorted(path.glob("shard-heldout-*.pt"))
                     for r in torch.load(shard, weights_only=True)]
        anchors = TrainSettings().eval_anchors
    print(f"{len(sequences)} held-out sequences from {source}")
    for drafter_path in drafters:
        drafter = load_drafter(drafter_path, target_path=default_model_path())
        c = drafter.config
        vocab = DraftVocab.from_d2t(drafter.d2t, c.vocab_size) if drafter.d2t is not None else DraftVocab.full(
            c.vocab_size)
        result, _ = evaluate(drafter, sequences, TrainSettings(eval_anchors=anchors), vocab.t2d)
        decoded = "" if result.decoded_length is None else \
            f"; walked as greedy decoding visits positions: {result.decoded_length:.3f} tokens per step"
        print(f"{drafter_path}: acceptance length {result.acceptance_length:.3f}, per position "
              f"{[round(x, 3) for x in result.per_position]} ({result.anchors} chains){decoded}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
