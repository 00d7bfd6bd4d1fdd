"""Tiny random Qwen3.5 (qwen3_5 text) models made with transformers' own classes, and GGUFs written from them the
way llama.cpp's converter writes the qwen35 architecture (shared by the runtime and service tests)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch

# name -> Qwen3_5TextConfig arguments. Attention: GQA and the output gate always; linear attention: value heads
# grouped per key head ("every4") or one each ("every2"); "mixed" starts with full attention and has 5 layers.
LAYOUTS: dict[str, dict] = {
    "every4": dict(num_hidden_layers=4, layer_types=None, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4, rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                   tie_word_embeddings=False),
    "every2": dict(num_hidden_layers=4, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=3,
                   rope_parameters={"rope_theta": 1e6, "partial_rotary_factor": 0.5}, tie_word_embeddings=True),
    "mixed": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                    "full_attention", "linear_attention"],
                  num_attention_heads=2, num_key_value_heads=2, head_dim=32, linear_num_key_heads=1,
                  linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.25}, tie_word_embeddings=False),
}


def make_qwen35(directory: Path, layout: str, vocab_size: int, seed: int = 0) -> Path:
    """Save a random-weight Qwen3_5ForCausalLM (float32) with every tensor non-trivial: zero-centred norms
    around 0, the gated norm around 1, A_log and dt_bias spread."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    args = dict(LAYOUTS[layout])
    if args.get("layer_types") is None:
        args.pop("layer_types", None)
    config = Qwen3_5TextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                               max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
                               bos_token_id=1, eos_token_id=2, **args)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
    model.save_pretrained(directory)
    return directory


def _tiled(t: torch.Tensor, dim: int, num_k: int, per_k: int, size: int) -> torch.Tensor:
    """llama.cpp's V-head reorder: blocks of `size` along `dim`, grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, per_k, size, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def write_qwen35_gguf(hf_dir: Path, path: Path) -> Path:
    """An F32 GGUF of a saved qwen3_5 text model, with llama.cpp's qwen35 names, keys and tensor transforms:
    norms +1 (not the gated linear_attn.norm), A_log -> -exp(A_log), conv1d squeezed, dt_bias -> ssm_dt.bias,
    value heads tiled when there are more value heads than key heads."""
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(hf_dir / "model.safetensors"))
    types = c["layer_types"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    interval = full[0] + 1
    assert full == list(range(interval - 1, len(types), interval)), "GGUF can only say every n-th layer is full"
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    arch = "qwen35"
    w = gguf.GGUFWriter(path, arch)
    w.add_string("general.name", "tiny-qwen35")
    for key, value in [("block_count", c["num_hidden_layers"]), ("context_length", c["max_position_embeddings"]),
                       ("embedding_length", c["hidden_size"]), ("feed_forward_length", c["intermediate_size"]),
                       ("attention.head_count", c["num_attention_heads"]),
                       ("attention.head_count_kv", c["num_key_value_heads"]),
                       ("attention.key_length", c["head_dim"]), ("attention.value_length", c["head_dim"]),
                       ("rope.dimension_count", int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"])),
                       ("ssm.conv_kernel", c["linear_conv_kernel_dim"]), ("ssm.state_size", dk),
                       ("ssm.group_count", nk), ("ssm.time_step_rank", nv), ("ssm.inner_size", nv * dv),
                       ("full_attention_interval", interval), ("vocab_size", c["vocab_size"])]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(f"{arch}.rope.freq_base", c["rope_parameters"]["rope_theta"])
    w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
             "linear_attn.in_proj_b": "ssm_beta", "linear_attn.in_proj_a": "ssm_alpha",
             "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out"}
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        else:
            _, _, bid, rest = name.split(".", 3)
            r = nv // nk
            if rest.endswith("A_log"):
                t, out = -torch.exp(t), "ssm_a"
            elif rest.endswith("dt_bias"):
                out = "ssm_dt.bias"
            else:
                module, suffix = rest.rsplit(".", 1)
                out = f"{names[module]}.{suffix}"
            if "conv1d" in rest:
                t = t.squeeze(1)
            if r > 1 and rest.startswith("linear_attn."):
                qk = 2 * nk * dk
                if "in_proj_qkv" in rest or "conv1d" in rest:
                    t = torch.cat([t[:qk], _tiled(t[qk:], 0, nk, r, dv)])
                elif "in_proj_z" in rest:
                    t = _tiled(t, 0, nk, r, dv)
                elif rest.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
                    t = _tiled(t, 0, nk, r, 1)
                elif "out_proj" in rest:
                    t = _tiled(t, 1, nk, r, dv)
            out = f"blk.{bid}.{out}"
        w.add_tensor(out, np.ascontiguousarray(t.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
