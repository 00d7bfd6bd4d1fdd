"""Decoding loops the runtime tests share."""

from __future__ import annotations

import torch
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import ForwardOutput, Transformer


def greedy_decode(
    model: Transformer, prompt: list[int], steps: int, capture_layers: tuple[int, ...] = ()
) -> tuple[list[int], torch.Tensor]:
    """Our incremental greedy decode: prefill, then one single-node verify + commit per token.

    Returns the generated tokens and the logits [steps, V] each was chosen from.
    """
    cache = model.new_cache()
    logits, _ = prefill(model, cache, prompt, capture_layers)
    tokens, rows = [], [logits]
    for _ in range(steps - 1):
        tokens.append(int(rows[-1].argmax()))
        step_logits, _ = verify_tree(model, cache, [tokens[-1]], [-1], capture_layers)
        commit_path(cache, [0])
        rows.append(step_logits[0])
    tokens.append(int(rows[-1].argmax()))
    return tokens, torch.stack(rows)


@torch.no_grad()
def hf_logits(hf_model, tokens: list[int], **kwargs):
    """HF forward over one sequence: logits [T, V] (and the full output for hidden states)."""
    out = hf_model(torch.tensor([tokens]), **kwargs)
    return out.logits[0].float(), out


def random_tokens(n: int, seed: int, vocab_size: int = 49152) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward_all(model: Transformer, tokens: list[int], **kwargs) -> ForwardOutput:
    """One causal forward of a whole sequence on a fresh cache."""
    return model(torch.tensor(tokens), torch.arange(len(tokens)), model.new_cache(), **kwargs)
