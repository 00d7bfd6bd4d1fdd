"""A tiny llama target (4 layers, hidden 32, vocab 128) saved as an HF directory, and sequences it generated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.drafting.sampling import SamplingParams
from dspark_grpc.runtime.formats.checkpoint import _HF_GLOBAL, _HF_LAYER, load_checkpoint
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.transformer import Transformer
from dspark_grpc.train.data import TargetSequence, generate_batch
from safetensors.torch import save_file

VOCAB, LAYERS, EOS = 128, 4, 2
LAYER_IDS = (1, 2)


@dataclass
class Tiny:
    path: Path
    model: Transformer
    train: list[TargetSequence]
    heldout: list[TargetSequence]


def tiny_config() -> ModelConfig:
    return ModelConfig(architecture="llama", name="tiny-llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_layers=LAYERS, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True)


def save_hf(model: Transformer, directory: Path) -> Path:
    """config.json + model.safetensors with HF names, loadable by runtime.formats.checkpoint.load_checkpoint."""
    c = model.config
    hf_global = {v: k for k, v in _HF_GLOBAL.items()}
    hf_layer = {v: k for k, v in _HF_LAYER.items()}
    tensors = {}
    for name, t in model.state_dict().items():
        if name in hf_global:
            tensors[hf_global[name]] = t.contiguous()
        else:
            _, i, rest = name.split(".", 2)
            tensors[f"model.layers.{i}.{hf_layer[rest]}"] = t.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
              "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
              "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": True}
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 12, (count,), generator=g)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds contention (100x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def tiny(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> Tiny:
    torch.manual_seed(0)
    model = Transformer(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name == "tok_embeddings.weight":
                p.mul_(0.3)  # logits of a few units: sampled and greedy continuations differ
    path = save_hf(model, tmp_path_factory.mktemp("tiny") / "target")
    model = Transformer.from_checkpoint(load_checkpoint(path, progress=False))
    sampled = SamplingParams(temperature=1.0)
    train_prompts = prompts(12, 1)
    modes = [None if i % 2 else sampled for i in range(12)]
    train = generate_batch(model, train_prompts, LAYER_IDS, 24, top_k=8, eos_ids=(EOS,), sampling=modes,
                           seeds=range(12), prompt_ids=[f"t{i}" for i in range(12)])
    heldout = generate_batch(model, prompts(6, 2), LAYER_IDS, 24, top_k=8, eos_ids=(EOS,),
                             prompt_ids=[f"h{i}" for i in range(6)])
    return Tiny(path, model, train, heldout)
