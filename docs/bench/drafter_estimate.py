"""dspark-train's held-out estimate for several drafters on the same cached held-out sequences.

    PYTHONPATH=. .venv/bin/python docs/bench/drafter_estimate.py .cache/dspark-train/<key> DRAFTER [DRAFTER ...]

<key> is the feature cache of a dspark-train run (its held-out shards); each DRAFTER is a drafter directory for the
embedded target. Prints the acceptance length and the per-position acceptance of greedy chains (runtime/train/loop.py
`evaluate`, the estimate dspark-train logs at every eval).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from dspark_grpc.runtime.formats.checkpoint import default_model_path
from dspark_grpc.runtime.formats.drafter_formats import load_drafter
from dspark_grpc.runtime.train.data import TargetSequence
from dspark_grpc.runtime.train.loop import TrainSettings, evaluate
from dspark_grpc.runtime.train.vocab import DraftVocab


def main(cache: str, drafters: list[str]) -> None:
    sequences = [TargetSequence(**r) for path in sorted(Path(cache).glob("shard-heldout-*.pt"))
                 for r in torch.load(path, weights_only=True)]
    print(f"{len(sequences)} held-out sequences from {cache}")
    for path in drafters:
        drafter = load_drafter(path, target_path=default_model_path())
        c = drafter.config
        vocab = DraftVocab.from_d2t(drafter.d2t, c.vocab_size) if drafter.d2t is not None else DraftVocab.full(
            c.vocab_size)
        result, _ = evaluate(drafter, sequences, TrainSettings(), vocab.t2d)
        print(f"{path}: acceptance length {result.acceptance_length:.3f}, per position "
              f"{[round(x, 3) for x in result.per_position]} ({result.anchors} chains)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
