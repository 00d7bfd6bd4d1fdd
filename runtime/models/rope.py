"""Rotary position embeddings in HF's rotate_half layout, with HF's default/linear/YaRN/llama3 frequencies."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from dspark_grpc.runtime.models.config import RopeScaling


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    freq_factors: Sequence[float] | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the factor applied to cos/sin.

    `freq_factors` (GGUF rope_freqs) divide the frequencies, as GGML does.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if freq_factors is not None:
        assert len(freq_factors) == head_dim // 2, (len(freq_factors), head_dim)
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.kind == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling kind {scaling.kind!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    assert s.original_max_position_embeddings is not None
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    assert s.original_max_position_embeddings is not None
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] for positions [T], computed in float32 and then cast to `dtype`."""
    assert positions.ndim == 1 and inv_freq.ndim == 1
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, head_dim] rotated by cos/sin [T, head_dim]."""
    assert x.shape[-2:] == cos.shape == sin.shape, (x.shape, cos.shape)
    return x * cos + rotate_half(x) * sin
