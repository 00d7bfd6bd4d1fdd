"""A tiny qwen3 target (2 layers, hidden 64, vocab 49152) that lends its embedding/lm_head to the test drafters."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.config import ModelConfig


@dataclass
class TinyTarget:
    path: Path
    config: ModelConfig
    embed: torch.Tensor
    lm_head: torch.Tensor


@pytest.fixture(scope="session")
def tiny_target(tiny_hf_models: dict[str, Path]) -> TinyTarget:
    ckpt = load_checkpoint(tiny_hf_models["qwen3"], progress=False)
    embed = ckpt.weights["tok_embeddings.weight"]
    return TinyTarget(tiny_hf_models["qwen3"], ckpt.config, embed, ckpt.weights.get("output.weight", embed))
