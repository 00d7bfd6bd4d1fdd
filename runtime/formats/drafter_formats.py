"""Drafter checkpoints: z-lab DFlash, DeepSpec DSpark and speculators HF directories, and our drafter GGUF.

HF tensor names (all three layouts): fc.weight, hidden_norm.weight, norm.weight, layers.N.<Qwen3 layer names>;
DeepSpec adds embed_tokens.weight, lm_head.weight (frozen target copies); DeepSpec and speculators add
markov_head.markov_w{1,2}.weight (+ gate_proj / joint_proj), confidence_head.proj.{weight,bias}; speculators adds
d2t / t2d and lm_head.weight when its draft vocabulary is reduced. What a checkpoint lacks (z-lab: embed and
lm_head; speculators: embed, and lm_head over the full vocabulary) comes from the target checkpoint.

GGUF (arch "dspark-draft", written by `convert_to_gguf`): every tensor inline, no Q/K permutation (NEOX RoPE).
Tensors: dflash.fc.weight, dflash.hidden_norm.weight, output_norm.weight, blk.N.* (llama.cpp names),
token_embd.weight, output.weight (absent = tied to token_embd), d2t (I32), dflash.dspark.markov.{w1,w2},
dflash.dspark.markov.{gate,joint}.{weight,bias}, dflash.dspark.confidence.{weight,bias}.
Metadata: llama.cpp hparams under `dspark-draft.*` and the drafter's keys under `dflash.*`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from dspark_grpc.runtime.formats.checkpoint import _GGUF_LAYER, _HF_LAYER, default_model_path, load_checkpoint
from dspark_grpc.runtime.formats.drafter_config import (
    GGUF_ARCH,
    DrafterConfig,
    default_target_layer_ids,
    drafter_config_from_gguf,
    drafter_config_from_hf,
    layers_to_hf,
)
from dspark_grpc.runtime.formats.gguf_reader import dequantize_tensor, open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.safetensors_reader import SINGLE_FILE, is_hf_dir, read_hf_config, read_safetensors
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.drafter import Drafter
from safetensors.torch import save_file

LAYOUTS = ("zlab", "deepspec", "speculators")
PathLike = str | os.PathLike[str]

_HEADS = {
    "markov_head.markov_w1.weight": "markov.w1.weight",
    "markov_head.markov_w2.weight": "markov.w2.weight",
    "markov_head.gate_proj.weight": "markov.gate_proj.weight",
    "markov_head.gate_proj.bias": "markov.gate_proj.bias",
    "markov_head.joint_proj.weight": "markov.joint_proj.weight",
    "markov_head.joint_proj.bias": "markov.joint_proj.bias",
    "confidence_head.proj.weight": "confidence.proj.weight",
    "confidence_head.proj.bias": "confidence.proj.bias",
}
_HF_GLOBAL = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "norm.weight": "norm.weight",
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    **_HEADS,
}
# TensorRT-LLM's standalone spellings of the heads.
_HF_ALIASES = {
    "markov_w1.weight": "markov.w1.weight",
    "markov_w2.weight": "markov.w2.weight",
    "confidence_proj.weight": "confidence.proj.weight",
    "confidence_proj.bias": "confidence.proj.bias",
}
_HF_SKIPPED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")
_GGUF_GLOBAL = {
    "dflash.fc.weight": "fc.weight",
    "dflash.hidden_norm.weight": "hidden_norm.weight",
    "output_norm.weight": "norm.weight",
    "token_embd.weight": "embed.weight",
    "output.weight": "lm_head.weight",
    "d2t": "d2t",
    "dflash.dspark.markov.w1": "markov.w1.weight",
    "dflash.dspark.markov.w2": "markov.w2.weight",
    "dflash.dspark.markov.gate.weight": "markov.gate_proj.weight",
    "dflash.dspark.markov.gate.bias": "markov.gate_proj.bias",
    "dflash.dspark.markov.joint.weight": "markov.joint_proj.weight",
    "dflash.dspark.markov.joint.bias": "markov.joint_proj.bias",
    "dflash.dspark.confidence.weight": "confidence.proj.weight",
    "dflash.dspark.confidence.bias": "confidence.proj.bias",
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _invert(mapping: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in mapping.items()}


def _rename(name: str, global_map: dict[str, str], layer_map: dict[str, str], layer_re: re.Pattern[str]) -> str | None:
    if name in global_map:
        return global_map[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    return None


def _ours_to_hf(name: str) -> str:
    hf = _rename(name, _invert(_HF_GLOBAL), _invert(_HF_LAYER), _LAYER_RE)
    assert hf is not None, name
    return hf


def _ours_to_gguf(name: str) -> str:
    m = _LAYER_RE.fullmatch(name)
    if m:
        return f"blk.{m.group(1)}.{_invert(_GGUF_LAYER)[m.group(2)]}"
    return _invert(_GGUF_GLOBAL)[name]


# -- loading ---------------------------------------------------------------------------------------------------


def load_drafter(path: PathLike, target_path: PathLike | None = None, dtype: torch.dtype = torch.float32) -> Drafter:
    """A drafter from an HF directory (z-lab, DeepSpec or speculators layout) or from our drafter GGUF.

    `target_path` (.gguf or HF dir; default: the embedded SmolLM2) lends the embedding and lm_head that an HF
    checkpoint lacks; it is not read when the checkpoint has them.
    """
    config, weights = read_drafter_weights(path, target_path)
    return build_drafter(config, weights, dtype)


def read_drafter_weights(path: PathLike, target_path: PathLike | None = None) -> tuple[DrafterConfig, dict[str, Any]]:
    """The config and every tensor under our names, in its stored dtype (GGUF: float32; d2t: int64)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no drafter at {p}: expected an HF directory with config.json or a .gguf file")
    if p.is_file() and p.suffix == ".gguf":
        return _read_gguf(p)
    if is_hf_dir(p):
        return _read_hf(p, target_path)
    raise ValueError(f"{p} is neither a .gguf file nor a directory with config.json and safetensors weights")


def build_drafter(config: DrafterConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
                  ) -> Drafter:
    """A Drafter around these tensors (shared, not copied, when they already have `dtype`)."""
    with torch.device("meta"):
        drafter = Drafter(config)
    _check_weights(drafter, weights)
    state = {k: v.long() if k == "d2t" else v.to(dtype) for k, v in weights.items()}
    drafter.load_state_dict(state, strict=True, assign=True)
    return drafter.eval().requires_grad_(False)


def _check_weights(drafter: Drafter, weights: dict[str, torch.Tensor]) -> None:
    expected = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"the drafter's tensors do not match its config: missing {missing[:8]}, "
                         f"unexpected {extra[:8]}")
    wrong = [(k, got[k], expected[k]) for k in expected if got[k] != expected[k]]
    if wrong:
        raise ValueError(f"drafter tensor shapes differ from its config: {wrong[:8]} (name, got, expected)")


def _read_hf(path: Path, target_path: PathLike | None) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    config = drafter_config_from_hf(read_hf_config(path))
    weights: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in read_safetensors(path).items():
        if name in _HF_SKIPPED or name.endswith("rotary_emb.inv_freq"):
            continue
        ours = _HF_ALIASES.get(name) or _rename(name, _HF_GLOBAL, _HF_LAYER, _LAYER_RE)
        if ours is None:
            unknown.append(name)
        else:
            weights[ours] = tensor
    if unknown:
        raise ValueError(f"{path}: tensors {unknown[:8]} are not part of a DFlash/DSpark drafter")
    if "embed.weight" not in weights or "lm_head.weight" not in weights:
        _borrow_from_target(config, weights, target_path, path)
    if config.draft_vocab_size < config.vocab_size and "d2t" not in weights:
        raise ValueError(f"{path}: the draft vocabulary is reduced ({config.draft_vocab_size} < {config.vocab_size}) "
                         "but the checkpoint has no d2t")
    return config, weights


def _borrow_from_target(config: DrafterConfig, weights: dict[str, torch.Tensor], target_path: PathLike | None,
                        source: Path) -> None:
    if "lm_head.weight" not in weights and config.draft_vocab_size < config.vocab_size:
        raise ValueError(f"{source}: a reduced draft vocabulary needs lm_head.weight in the checkpoint")
    target = Path(target_path) if target_path is not None else default_model_path()
    ckpt = load_checkpoint(target, progress=False)
    t = ckpt.config
    if (t.vocab_size, t.hidden_size) != (config.vocab_size, config.hidden_size):
        raise ValueError(
            f"{source} takes its embedding/lm_head from the target, but the target {target} has vocab {t.vocab_size}"
            f" and hidden size {t.hidden_size}, the drafter {config.vocab_size} and {config.hidden_size}: pass the "
            "drafter's own target model"
        )
    embed = ckpt.weights["tok_embeddings.weight"]
    weights.setdefault("embed.weight", embed)
    weights.setdefault("lm_head.weight", ckpt.weights.get("output.weight", embed))


def _read_gguf(path: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    reader = open_gguf(path)
    config = drafter_config_from_gguf(read_gguf_metadata(reader))
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        ours = _rename(tensor.name, _GGUF_GLOBAL, _GGUF_LAYER, _GGUF_LAYER_RE)
        if ours is None:
            raise ValueError(f"{path}: tensor {tensor.name!r} is not part of a drafter GGUF")
        if ours == "d2t":
            weights[ours] = torch.from_numpy(np.array(tensor.data, dtype=np.int64)).reshape(-1)
        else:
            weights[ours] = dequantize_tensor(tensor)
    if "lm_head.weight" not in weights and "embed.weight" in weights:
        weights["lm_head.weight"] = weights["embed.weight"]
    return config, weights


# -- saving ----------------------------------------------------------------------------------------------------


def save_drafter(drafter: Drafter, directory: PathLike, layout: str, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors in the z-lab, DeepSpec or speculators layout (floating tensors in `dtype`,
    else in their own).

    z-lab keeps no embed/lm_head and speculators no embed (nor lm_head over the full vocabulary): loading takes
    them from the target, so save those layouts only for a drafter whose tables are its target's.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    c = drafter.config
    state = drafter.state_dict()
    backbone = [k for k in state if not k.startswith(("embed.", "lm_head.", "markov.", "confidence.", "d2t"))]
    heads = [k for k in state if k.startswith(("markov.", "confidence."))]
    if layout == "zlab":
        if c.slot_convention != "dflash" or heads or c.draft_vocab_size < c.vocab_size:
            raise ValueError("the z-lab layout holds only DFlash drafters (slot k predicts p+k) without Markov or "
                             "confidence heads and over the full vocabulary; use the speculators layout")
        config_json, names = _zlab_json(c), backbone
    elif layout == "deepspec":
        if c.slot_convention != "dspark" or c.draft_vocab_size < c.vocab_size:
            raise ValueError("the DeepSpec layout holds only DSpark-convention drafters over the full vocabulary; "
                             "use the speculators layout")
        config_json, names = _deepspec_json(c), [*backbone, "embed.weight", "lm_head.weight", *heads]
    else:
        reduced = ["lm_head.weight", "d2t"] if c.draft_vocab_size < c.vocab_size else []
        config_json, names = _speculators_json(c), [*backbone, *heads, *reduced]
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in names:
        t = state[name].detach().cpu().contiguous()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if t.data_ptr() in seen:
            t = t.clone()  # safetensors refuses shared storage (tied tables)
        seen.add(t.data_ptr())
        tensors[_ours_to_hf(name)] = t
    if layout == "speculators" and drafter.d2t is not None:
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + drafter.d2t.cpu()] = True
        tensors["t2d"] = t2d
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / SINGLE_FILE)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
    return out


def _common_extras(c: DrafterConfig) -> dict[str, Any]:
    extras: dict[str, Any] = {"_name_or_path": c.name}
    if c.num_target_layers is not None:
        extras["num_target_layers"] = c.num_target_layers
    if c.target_hidden_size != c.hidden_size:
        extras["target_hidden_size"] = c.target_hidden_size
    return extras


def _head_fields(c: DrafterConfig) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "markov_rank": c.markov_rank,
        "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.confidence_enabled,
        "confidence_head_with_markov": c.confidence_with_markov,
        "confidence_head_pre_norm": c.confidence_pre_norm,  # ours: DeepSpec/speculators read post-norm
    }
    if c.confidence_temperatures is not None:
        fields["confidence_temperatures"] = list(c.confidence_temperatures)
    return fields


def _zlab_json(c: DrafterConfig) -> dict[str, Any]:
    cj = {
        "architectures": ["DFlashDraftModel"],
        **layers_to_hf(c),
        **_common_extras(c),
        "tie_word_embeddings": True,
        "block_size": c.block_size,
        "dflash_config": {
            "block_size": c.block_size,
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
        },
    }
    if not c.causal_sliding:
        cj["is_causal"] = False
    return cj


def _deepspec_json(c: DrafterConfig) -> dict[str, Any]:
    cj = {
        "architectures": ["Qwen3DSparkModel"],
        **layers_to_hf(c),
        **_common_extras(c),
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "target_layer_ids": list(c.target_layer_ids),
        "mask_token_id": c.mask_token_id,
        "num_anchors": 512,
        **_head_fields(c),
    }
    if not c.causal_sliding:
        cj["sliding_window_non_causal"] = True
    return cj


def _speculators_json(c: DrafterConfig) -> dict[str, Any]:
    kind = "dspark" if c.markov_rank or c.confidence_enabled else "dflash"
    cj = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": layers_to_hf(c),
        **_common_extras(c),
        "draft_vocab_size": c.draft_vocab_size,
        "block_size": c.block_size,
        "target_hidden_size": c.target_hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],  # vLLM's convention
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": not c.causal_sliding,
        "sample_from_anchor": c.slot_convention == "dspark",
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.num_drafts}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": None, "architectures": []},
        },
    }
    if kind == "dspark":
        cj.update(_head_fields(c))
    return cj


# -- GGUF ------------------------------------------------------------------------------------------------------


def convert_to_gguf(hf_dir: PathLike, out_path: PathLike, target_path: PathLike | None = None) -> Path:
    """Our drafter GGUF from an HF drafter directory: every tensor inline (F32/F16/BF16 as stored; 1-D in F32),
    the embedding and lm_head taken from `target_path` when the checkpoint lacks them."""
    src = Path(hf_dir)
    if not is_hf_dir(src):
        raise FileNotFoundError(f"no HF drafter directory (with config.json) at {src}")
    config, weights = _read_hf(src, target_path)
    with torch.device("meta"):
        _check_weights(Drafter(config), weights)
    stored = weights["fc.weight"].dtype
    for name in ("embed.weight", "lm_head.weight"):  # tables lent by a float32 target: store them like the rest
        if weights[name].dtype == torch.float32 and stored in (torch.float16, torch.bfloat16):
            weights[name] = weights[name].to(stored)
    return write_gguf(config, weights, out_path)


def write_gguf(config: DrafterConfig, weights: dict[str, torch.Tensor], out_path: PathLike) -> Path:
    """Write `weights` (our names) and `config` as a drafter GGUF."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(out, GGUF_ARCH)
    _write_metadata(w, config)
    embed, lm_head = weights["embed.weight"], weights["lm_head.weight"]
    tied = lm_head is embed or (lm_head.shape == embed.shape and torch.equal(lm_head, embed))
    for name, tensor in weights.items():
        if name == "lm_head.weight" and tied:
            continue
        array, raw_dtype = _gguf_array(name, tensor.detach().cpu())
        w.add_tensor(_ours_to_gguf(name), array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_array(name: str, t: torch.Tensor) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
    if name == "d2t":
        return t.to(torch.int32).numpy(), None
    if t.dtype == torch.float16 and t.ndim > 1:
        return t.numpy(), None
    if t.dtype == torch.bfloat16 and t.ndim > 1:
        bf16 = gguf.GGMLQuantizationType.BF16
        return gguf.quants.quantize(t.float().numpy(), bf16), bf16
    return t.float().numpy(), None


def _write_metadata(w: gguf.GGUFWriter, c: DrafterConfig) -> None:
    arch = GGUF_ARCH
    w.add_name(c.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    s = c.rope_scaling
    if s is not None:
        w.add_string(f"{arch}.rope.scaling.type", s.kind)
        w.add_rope_scaling_factor(s.factor)
        if s.original_max_position_embeddings is not None:
            w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        if s.kind == "yarn":
            w.add_rope_scaling_yarn_beta_fast(s.beta_fast)
            w.add_rope_scaling_yarn_beta_slow(s.beta_slow)
            if s.attention_factor is not None:
                w.add_rope_scaling_yarn_attn_factor(s.attention_factor)
            w.add_bool(f"{arch}.rope.scaling.yarn_truncate", s.truncate)
        elif s.kind == "llama3":
            w.add_float32(f"{arch}.rope.scaling.low_freq_factor", s.low_freq_factor)
            w.add_float32(f"{arch}.rope.scaling.high_freq_factor", s.high_freq_factor)
    if "sliding_attention" in c.layer_types:
        assert c.sliding_window is not None
        w.add_sliding_window(c.sliding_window)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    w.add_uint32("dflash.block_size", c.block_size)
    w.add_uint32("dflash.mask_token_id", c.mask_token_id)
    w.add_array("dflash.target_layer_ids", [int(i) for i in c.target_layer_ids])
    if c.num_target_layers is not None:
        w.add_uint32("dflash.n_target_layers", c.num_target_layers)
    w.add_uint32("dflash.target_hidden_size", c.target_hidden_size)
    w.add_string("dflash.slot_convention", c.slot_convention)
    w.add_bool("dflash.causal_sliding", c.causal_sliding)
    w.add_bool("dflash.dspark.enabled", bool(c.markov_rank or c.confidence_enabled))
    w.add_uint32("dflash.dspark.vocab_size", c.draft_vocab_size)
    w.add_uint32("dflash.dspark.markov_rank", c.markov_rank)
    w.add_string("dflash.dspark.markov_head_type", c.markov_head_type)
    w.add_bool("dflash.dspark.confidence.enabled", c.confidence_enabled)
    w.add_bool("dflash.dspark.confidence.with_markov", c.confidence_with_markov)
    w.add_bool("dflash.dspark.confidence.pre_norm", c.confidence_pre_norm)
    if c.confidence_enabled:
        w.add_uint32("dflash.dspark.confidence_dim", c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0))
    if c.confidence_temperatures is not None:
        w.add_array("dflash.dspark.confidence.temperatures", [float(t) for t in c.confidence_temperatures])


# -- random drafters ---------------------------------------------------------------------------------------------


def init_random_drafter(
    target_config: ModelConfig,
    *,
    num_layers: int = 1,
    block_size: int = 4,
    target_layer_ids: tuple[int, ...] | list[int] | None = None,
    markov_rank: int = 16,
    markov_head_type: str = "vanilla",
    confidence: bool = True,
    slot_convention: str = "dspark",
    seed: int = 0,
    target_embed: torch.Tensor | None = None,
    target_lm_head: torch.Tensor | None = None,
    mask_token_id: int | None = None,
    draft_vocab_size: int | None = None,
    layer_types: tuple[str, ...] | None = None,
    sliding_window: int | None = None,
    causal_sliding: bool = True,
    confidence_temperatures: tuple[float, ...] | None = None,
) -> Drafter:
    """A small seeded random drafter for `target_config`: hidden size, heads and RoPE like the target's, the
    embedding and lm_head copied from `target_embed` / `target_lm_head` when given (the lm_head's rows restricted
    to a random draft vocabulary when `draft_vocab_size` is smaller). mask_token_id defaults to the last id."""
    t = target_config
    vocab = t.vocab_size
    ids = default_target_layer_ids(t.num_layers, num_layers) if target_layer_ids is None else tuple(target_layer_ids)
    config = DrafterConfig(
        hidden_size=t.hidden_size,
        num_layers=num_layers,
        num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads,
        head_dim=t.head_dim,
        intermediate_size=t.intermediate_size,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta,
        rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings,
        layer_types=layer_types or (),
        sliding_window=sliding_window,
        causal_sliding=causal_sliding,
        block_size=block_size,
        target_layer_ids=ids,
        num_target_layers=t.num_layers,
        target_hidden_size=t.hidden_size,
        mask_token_id=vocab - 1 if mask_token_id is None else mask_token_id,
        slot_convention=slot_convention,  # type: ignore[arg-type]
        vocab_size=vocab,
        draft_vocab_size=draft_vocab_size or vocab,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        confidence_enabled=confidence,
        confidence_with_markov=confidence and markov_rank > 0,
        confidence_temperatures=confidence_temperatures,
        name=f"random drafter for {t.name}",
    )
    g = torch.Generator().manual_seed(seed)
    drafter = Drafter(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name == "embed.weight" and target_embed is not None:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1, generator=g)
            elif name in ("embed.weight", "markov.w1.weight"):
                p.normal_(0.0, 1.0, generator=g)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
        draft_ids = torch.arange(vocab)
        if drafter.d2t is not None:
            draft_ids = torch.randperm(vocab, generator=g)[: config.draft_vocab_size].sort().values
            drafter.d2t.copy_(draft_ids - torch.arange(config.draft_vocab_size))
        copies = ((target_embed, drafter.embed.weight, None), (target_lm_head, drafter.lm_head.weight, draft_ids))
        for table, param, rows in copies:
            if table is None:
                continue
            if tuple(table.shape) != (vocab, t.hidden_size):
                raise ValueError(f"target table has shape {tuple(table.shape)}, expected {(vocab, t.hidden_size)}")
            param.copy_(table if rows is None else table[rows])
    return drafter.eval().requires_grad_(False)


# -- dspark-convert --------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dspark-convert",
        description="Convert a DFlash/DSpark drafter (z-lab, DeepSpec or speculators HF directory) to a drafter GGUF "
        "with every tensor inline.",
    )
    p.add_argument("hf_dir", help="the drafter's HF directory (config.json + model.safetensors)")
    p.add_argument("out", help="the .gguf file to write")
    p.add_argument("--target", default=None,
                   help="target model (.gguf or HF dir) lending the embedding/lm_head the drafter lacks "
                   "(default: the embedded SmolLM2-135M)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out = convert_to_gguf(args.hf_dir, args.out, args.target)
        c = drafter_config_from_gguf(read_gguf_metadata(open_gguf(out)))
    except (FileNotFoundError, ValueError) as e:
        print(f"dspark-convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): {c.num_layers} layers, hidden {c.hidden_size}, "
          f"block {c.block_size} ({c.slot_convention}: {c.num_drafts} drafts), target layers "
          f"{list(c.target_layer_ids)}, mask token {c.mask_token_id}, markov rank {c.markov_rank}, "
          f"confidence {'on' if c.confidence_enabled else 'off'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
