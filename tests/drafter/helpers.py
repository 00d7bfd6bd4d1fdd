"""Shared pieces of the drafter tests."""

from __future__ import annotations

import dataclasses

import torch
from dspark_grpc.runtime.formats.drafter_config import DrafterConfig
from dspark_grpc.runtime.models.drafter import BlockOutput, Drafter


def random_features(config: DrafterConfig, n: int, seed: int = 0) -> torch.Tensor:
    """[n, m, target_hidden] target features."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(config.target_layer_ids), config.target_hidden_size, generator=g)


def run_block(drafter: Drafter, features: torch.Tensor, anchor: int) -> BlockOutput:
    ctx = drafter.new_context()
    ctx.append(features, 0)
    return drafter.forward_block(ctx, anchor)


def assert_same_output(a: BlockOutput, b: BlockOutput, atol: float = 0.0) -> None:
    for field in dataclasses.fields(BlockOutput):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert x.shape == y.shape, (field.name, x.shape, y.shape)
        torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=lambda m, f=field.name: f"{f}: {m}")
