"""Shared pieces of the drafter tests."""

from __future__ import annotations

import dataclasses

import torch
from dspark_grpc.runtime.formats.drafter_config import DrafterConfig
from dspark_grpc.runtime.models.drafter import BlockOutput, Drafter
from heads.reference import confidence_tolerance, z_bound
from tolerance import drafter_chain_length, log_softmax_error, model_logit_scale, network_tolerance, row_scale


def random_features(config: DrafterConfig, n: int, seed: int = 0) -> torch.Tensor:
    """[n, m, target_hidden] target features."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, len(config.target_layer_ids), config.target_hidden_size, generator=g)


def run_block(drafter: Drafter, features: torch.Tensor, anchor: int) -> BlockOutput:
    ctx = drafter.new_context()
    ctx.append(features, 0)
    return drafter.forward_block(ctx, anchor)


def block_tolerances(drafter: Drafter, context: int, out: BlockOutput, sides: int = 2) -> dict[str, float]:
    """tests/tolerance.py's bound for each BlockOutput field of a block over `context` rows (float32 computations in
    other orders, or sides=1: one against the exact value), scaled by `out`'s rows and the drafter's head."""
    c = drafter.config
    rows = context + c.block_size
    logits = drafter_chain_length(c, rows)
    return {"hidden_pre_norm": network_tolerance(drafter_chain_length(c, rows, c.num_layers),
                                                 row_scale(out.hidden_pre_norm), sides=sides),
            "hidden_post_norm": network_tolerance(logits, row_scale(out.hidden_post_norm), sides=sides),
            "base_logits": network_tolerance(logits, model_logit_scale(drafter), sides=sides)}


def chain_tolerances_of_block(drafter: Drafter, context: int, out: BlockOutput, temperature: float = 1.0,
                              depths: int = 1) -> tuple[float, float]:
    """(log-prob, confidence) tolerances of a drafter's chain computed two ways from a block over `context` rows
    whose outputs are like `out` (their scales): the block's outputs within `block_tolerances`, the Markov-corrected
    log-softmax of Z / T per depth (summed along a path of `depths`), the confidence head's sigmoid of a dot with
    the hidden state it reads."""
    atol = block_tolerances(drafter, context, out)
    z_max, z_error = z_bound(out.base_logits, drafter.markov, out.hidden_post_norm)
    z_error = atol["base_logits"] + 2 * z_error
    logprob = 2 * depths * log_softmax_error(out.base_logits.shape[-1], z_max / temperature, z_error / temperature)
    conf = drafter.confidence
    if conf is None:
        return logprob, 0.0
    read = atol["hidden_pre_norm" if drafter.config.confidence_pre_norm else "hidden_post_norm"]
    x_max = max(float(out.hidden_pre_norm.abs().max()), float(out.hidden_post_norm.abs().max())) + read
    t_min = float(conf.position_temperatures(drafter.config.block_size).min())
    moved = float(conf.proj.weight.detach().abs().sum()) * read / t_min / 4  # sigmoid is 1/4-Lipschitz
    return logprob, moved + confidence_tolerance(conf, x_max, drafter.config.block_size, sides=2)


def kv_tolerance(drafter: Drafter, kv: torch.Tensor) -> float:
    """Context K/V computed twice (other row counts): fc over the features, the hidden norm, wk/wv, the k norm and
    RoPE on the chain, scaled by the heads' rows [..., head_dim]."""
    c = drafter.config
    chain = len(c.target_layer_ids) * c.target_hidden_size + 2 * c.hidden_size + 2 * c.head_dim + 3
    return network_tolerance(chain, row_scale(kv))


def assert_same_output(a: BlockOutput, b: BlockOutput, tolerances: dict[str, float] | None = None) -> None:
    """Bitwise, or each field within its tolerance (`block_tolerances`)."""
    for field in dataclasses.fields(BlockOutput):
        x, y = getattr(a, field.name), getattr(b, field.name)
        assert x.shape == y.shape, (field.name, x.shape, y.shape)
        atol = 0.0 if tolerances is None else tolerances[field.name]
        torch.testing.assert_close(x, y, rtol=0, atol=atol, msg=lambda m, f=field.name: f"{f}: {m}")
