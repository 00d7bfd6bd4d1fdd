"""Logits -> the distribution that is sampled from. AR decoding and speculative verification share it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Below this a temperature scales float32 logits towards overflow (NaN probabilities); greedy is temperature 0.
MIN_TEMPERATURE = 1e-4


def check_temperature(temperature: float) -> None:
    """ValueError unless 0 (greedy) or a finite value >= MIN_TEMPERATURE."""
    if not (math.isfinite(temperature) and (temperature == 0 or temperature >= MIN_TEMPERATURE)):
        raise ValueError(f"temperature must be 0 (greedy) or a finite value >= {MIN_TEMPERATURE:g}, got {temperature}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _greedy_one_hot(logits: Tensor) -> Tensor:
    # torch.argmax returns the first maximal index, so ties go to the lowest token id.
    index = logits.argmax(dim=-1, keepdim=True)
    dtype = logits.dtype if logits.dtype == torch.float64 else torch.float32
    return torch.zeros(logits.shape, dtype=dtype, device=logits.device).scatter_(-1, index, 1.0)


def _top_p_mask(probs: Tensor, top_p: float) -> Tensor:
    """Keep the most probable tokens until their mass reaches top_p, and any tied with the last one kept."""
    sorted_probs = probs.sort(dim=-1, descending=True).values
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    n_keep = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_probs.gather(-1, n_keep - 1)
    return probs >= threshold


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] probabilities: temperature, then top-k, then top-p (HF/vLLM order).

    Greedy gives a one-hot at the argmax. Ties at the top-k or top-p boundary keep every tied token,
    so the result depends only on the values, never on sort order.
    """
    if params.is_greedy:
        return _greedy_one_hot(logits)
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    probs = x.softmax(dim=-1)
    if params.top_p < 1:
        probs = probs.masked_fill(~_top_p_mask(probs, params.top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def make_generator(seed: int | None = None, device: str | torch.device = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def draw_device(generator: torch.Generator | None, tensor: Tensor) -> torch.device:
    """Where random numbers are drawn: the generator's device (an engine on a GPU keeps a CPU generator, so that a
    seed draws the same numbers on either device)."""
    return tensor.device if generator is None else generator.device


def multinomial(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """[R, V] (or [V]) probabilities -> [R, 1] (or [1]) draws, on the probabilities' device, drawn on the
    generator's."""
    return torch.multinomial(probs.to(draw_device(generator, probs)), 1, generator=generator).to(probs.device)


def sample(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """[..., V] logits -> [...] token ids drawn from `target_probs` (argmax when greedy)."""
    if params.is_greedy:
        return logits.argmax(dim=-1)
    probs = target_probs(logits, params)
    return multinomial(probs.reshape(-1, probs.shape[-1]), generator).view(probs.shape[:-1])
