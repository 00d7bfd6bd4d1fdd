"""Model shape: one frozen dataclass, filled from GGUF metadata or an HF config.json."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Architecture = Literal["llama", "qwen2", "qwen3", "qwen35", "gemma3"]
ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen35", "gemma3")
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                     "Qwen3_5ForCausalLM": "qwen35", "Qwen3_5ForConditionalGeneration": "qwen35",
                     "Gemma3ForCausalLM": "gemma3"}
_HF_MODEL_TYPES = {"qwen3_5": "qwen35", "qwen3_5_text": "qwen35", "gemma3_text": "gemma3"}
_HF_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen35": 32768, "gemma3": 131072}
LAYER_KINDS = ("attention", "linear_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as HF transformers defines it. Fields a kind does not use keep their defaults."""

    kind: Literal["linear", "yarn", "llama3"]
    factor: float
    original_max_position_embeddings: int | None = None  # yarn, llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: 0.1 * ln(factor) + 1
    truncate: bool = True  # yarn: floor/ceil the correction range
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3


@dataclass(frozen=True)
class ModelConfig:
    architecture: Architecture
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections have a bias (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    attention_out_bias: bool = False  # o projection has a bias (llama/qwen3 with attention_bias=true)
    # Divisors of the inverse frequencies from a GGUF rope_freqs tensor: llama.cpp's form of llama3 scaling.
    rope_freq_factors: tuple[float, ...] | None = None
    # qwen35 (Qwen3.5 hybrid): the kind of each layer (LAYER_KINDS; empty = every layer is attention), RoPE on the
    # first rotary_dim dims of a head only (0 = all), a sigmoid output gate on attention (q_proj gives q and gate
    # per head), and the Gated DeltaNet shape of the linear-attention layers.
    layer_types: tuple[str, ...] = ()
    rotary_dim: int = 0
    attention_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # gemma3 (Gemma 3): "sliding_attention" layers see only the last `sliding_window` positions (a query at p, keys at
    # p - sliding_window + 1 .. p) and rotate with rope_local_theta, unscaled; scores are scaled by
    # query_pre_attn_scalar ** -0.5 (0: head_dim's); logits are soft-capped, c tanh(z / c), at final_logit_softcapping
    # (0: not). The architecture brings the rest: norms after attention and after the MLP, a GELU-tanh MLP, the
    # embeddings scaled by sqrt(hidden_size).
    sliding_window: int = 0
    rope_local_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.layer_types:
            self._check_layer_types()

    def _check_layer_types(self) -> None:
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_KINDS for t in self.layer_types):
            raise ValueError(f"layer_types must name one of {LAYER_KINDS} for each of the {self.num_layers} layers, "
                             f"got {list(self.layer_types)}")
        if self.linear_layers and "attention" not in self.layer_types:
            raise ValueError("a hybrid model needs at least one full-attention layer")
        if "sliding_attention" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding-window layers need a positive sliding_window, got {self.sliding_window}")
        if self.linear_layers:
            dims = (self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                    self.linear_value_head_dim, self.linear_conv_kernel)
            if min(dims) < 1:
                raise ValueError(f"linear-attention layers need positive head counts, head dims and conv kernel, "
                                 f"got {dims}")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                                 f"linear_num_key_heads {self.linear_num_key_heads}")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Ids of the linear-attention (Gated DeltaNet) layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def fingerprint(self) -> str:
        """sha256 of the architecture's shape: equal for the same model in any quantization or file format."""
        scaling = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
        shape = {
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
        }
        if self.rope_freq_factors is not None:
            shape["rope_freq_factors"] = list(self.rope_freq_factors)
        if self.architecture == "qwen35":
            shape.update(layer_types=list(self.layer_types), rotary_dim=self.rotary_dim,
                         attention_output_gate=self.attention_output_gate,
                         linear=[self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
                                 self.linear_value_head_dim, self.linear_conv_kernel])
        if self.architecture == "gemma3":
            shape.update(layer_types=list(self.layer_types), sliding_window=self.sliding_window,
                         rope_local_theta=self.rope_local_theta, query_pre_attn_scalar=self.query_pre_attn_scalar,
                         final_logit_softcapping=self.final_logit_softcapping)
        canonical = json.dumps(_round_floats(shape), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _round_floats(value: Any) -> Any:
    # GGUF stores float32, config.json float64: compare at float32 precision.
    if isinstance(value, float):
        return struct.unpack("<f", struct.pack("<f", value))[0]
    if isinstance(value, dict):
        return {k: _round_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round_floats(v) for v in value]
    return value


def _f32(value: Any) -> float:
    """A GGUF float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)


def config_from_gguf(metadata: dict[str, Any], has_output_weight: bool = False) -> ModelConfig:
    """ModelConfig from GGUF metadata (keys as llama.cpp's converter writes them).

    `has_output_weight`: whether the file holds an `output.weight` tensor; without it the embeddings are tied.
    """
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}")

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key '{arch}.{key}'")
        return value

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // num_heads)
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim and arch != "qwen35":
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head_dim {head_dim}) are unsupported")

    if f"{arch}.vocab_size" in metadata:
        vocab = int(metadata[f"{arch}.vocab_size"])
    elif "tokenizer.ggml.tokens" in metadata:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    else:
        raise ValueError(f"GGUF metadata has neither '{arch}.vocab_size' nor 'tokenizer.ggml.tokens'")

    scaling = None
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = metadata.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor is not None:
        scaling = RopeScaling("linear", _f32(factor))
    elif kind == "yarn" and factor is not None:
        attention_factor = metadata.get(f"{arch}.rope.scaling.yarn_attn_factor")
        attention_factor = (
            _yarn_attention_factor(_f32(factor), None, None) if attention_factor is None else _f32(attention_factor)
        )
        scaling = RopeScaling(
            "yarn",
            _f32(factor),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=_f32(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=_f32(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=attention_factor,
        )
    elif kind not in ("none", "linear", "yarn"):
        raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")

    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    num_layers = int(get("block_count"))
    hybrid = {}
    if arch == "qwen35":
        hybrid = _qwen35_from_gguf(get, num_layers, rope_dim)
    elif arch == "gemma3":
        hybrid = _gemma3_from_gguf(metadata, get, num_layers, hidden // num_heads, head_dim)
    return ModelConfig(
        architecture=arch,
        name=str(metadata.get("general.name", arch)),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=not has_output_weight,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen35", "gemma3"),
        **hybrid,
    )


def _gemma3_from_gguf(metadata: dict[str, Any], get: Any, num_layers: int, hidden_per_head: int,
                      head_dim: int) -> dict[str, Any]:
    """Gemma 3's fields as llama.cpp sets them (src/llama-model.cpp): a full-attention layer every 6th (the others
    slide), local RoPE base 10000, scores scaled by 1/sqrt(head_dim) except the 27B's (62 layers)
    1/sqrt(hidden / heads). Keys a newer converter may write take precedence."""
    if "gemma3.attention.logit_softcapping" in metadata:
        raise ValueError("attention logit soft-capping is unsupported (transformers' Gemma 3 does not apply it)")
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, (list, tuple)):
        sliding = [bool(s) for s in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    scale = metadata.get("gemma3.attention.scale")
    scalar = float(hidden_per_head if num_layers == 62 else head_dim) if scale is None else 1.0 / _f32(scale) ** 2
    return dict(
        layer_types=tuple("sliding_attention" if s else "attention" for s in sliding),
        sliding_window=int(get("attention.sliding_window")),
        rope_local_theta=_f32(metadata.get("gemma3.rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=_f32(metadata.get("gemma3.final_logit_softcapping", 0.0)),
    )


def _qwen35_from_gguf(get: Any, num_layers: int, rope_dim: int) -> dict[str, Any]:
    """The hybrid fields from llama.cpp's qwen35 keys: ssm.group_count = linear key heads, ssm.time_step_rank =
    linear value heads, ssm.state_size = key head dim, ssm.inner_size = value heads x value head dim; every
    full_attention_interval-th layer is full attention."""
    interval = int(get("full_attention_interval", 4))
    num_v_heads = int(get("ssm.time_step_rank"))
    return dict(
        layer_types=tuple("attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)),
        rotary_dim=rope_dim,
        attention_output_gate=True,
        linear_num_key_heads=int(get("ssm.group_count")),
        linear_num_value_heads=num_v_heads,
        linear_key_head_dim=int(get("ssm.state_size")),
        linear_value_head_dim=int(get("ssm.inner_size")) // num_v_heads,
        linear_conv_kernel=int(get("ssm.conv_kernel")),
    )


def _rope_from_hf(params: dict[str, Any], max_positions: int) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "yarn", "llama3"):
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: default, linear, yarn, llama3")
    original = params.get("original_max_position_embeddings", max_positions)
    factor = params.get("factor")
    if kind == "linear":
        return RopeScaling("linear", float(factor))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(factor),
            original_max_position_embeddings=int(original),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    if factor is None:
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = _yarn_attention_factor(factor, params.get("mscale"), params.get("mscale_all_dim"))
    return RopeScaling(
        "yarn",
        float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )


def config_from_hf(config_json: dict[str, Any]) -> ModelConfig:
    """ModelConfig from an HF config.json of LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3.5
    (Qwen3_5ForCausalLM, or the text model of Qwen3_5ForConditionalGeneration) or Gemma3ForCausalLM."""
    names = config_json.get("architectures") or []
    arch = next((_HF_ARCHITECTURES[n] for n in names if n in _HF_ARCHITECTURES), None)
    if arch is None and not names:
        model_type = config_json.get("model_type")
        arch = model_type if model_type in ARCHITECTURES else _HF_MODEL_TYPES.get(model_type)
    if arch == "qwen35" and isinstance(config_json.get("text_config"), dict):
        outer = {k: config_json[k] for k in ("tie_word_embeddings", "_name_or_path") if k in config_json}
        config_json = {**config_json["text_config"], **outer, "architectures": names}
    if arch is None:
        raise ValueError(
            f"unsupported HF architecture {names or config_json.get('model_type')!r}; "
            f"supported: {sorted(_HF_ARCHITECTURES)}"
        )
    if config_json.get("mlp_bias"):
        raise ValueError("mlp_bias=true is unsupported")
    if arch == "gemma3":
        return _gemma3_from_hf(config_json, names)
    if config_json.get("use_sliding_window"):
        raise ValueError("sliding-window attention (use_sliding_window=true) is unsupported")
    if config_json.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config_json['hidden_act']!r}; only silu (SwiGLU)")
    params = dict(config_json.get("rope_parameters") or config_json.get("rope_scaling") or {})
    partial = params.get("partial_rotary_factor", config_json.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and arch != "qwen35":
        raise ValueError("partial rotary embeddings are unsupported")

    hidden = int(config_json["hidden_size"])
    num_heads = int(config_json["num_attention_heads"])
    max_positions = int(config_json.get("max_position_embeddings", _HF_DEFAULT_MAX_POSITIONS[arch]))
    # transformers < 5: rope_theta + rope_scaling; >= 5: rope_parameters {rope_theta, rope_type, ...}.
    theta = params.get("rope_theta", config_json.get("rope_theta", 10000.0))
    bias = arch == "qwen2" or bool(config_json.get("attention_bias", False))
    name = config_json.get("_name_or_path") or (names[0] if names else arch)
    head_dim = int(config_json.get("head_dim") or hidden // num_heads)
    hybrid = _qwen35_from_hf(config_json, head_dim) if arch == "qwen35" else {}
    return ModelConfig(
        architecture=arch,
        name=str(name),
        vocab_size=int(config_json["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config_json["intermediate_size"]),
        num_layers=int(config_json["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config_json.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(config_json.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=_rope_from_hf(params, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
        attention_bias=bias,
        qk_norm=arch in ("qwen3", "qwen35"),
        attention_out_bias=bias and arch != "qwen2",
        **hybrid,
    )


def _qwen35_from_hf(config_json: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """Qwen3_5TextConfig's hybrid fields (its defaults where the file omits one: partial_rotary_factor 0.25, a
    full-attention layer every 4). For text the three M-RoPE sections share the position, i.e. plain RoPE."""
    layers = int(config_json["num_hidden_layers"])
    interval = int(config_json.get("full_attention_interval", 4))
    types = config_json.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "linear_attention"})
    if unknown:
        raise ValueError(f"unsupported qwen3_5 layer types {unknown}; supported: full_attention, linear_attention")
    params = dict(config_json.get("rope_parameters") or {})
    partial = float(params.get("partial_rotary_factor", config_json.get("partial_rotary_factor", 0.25)))
    return dict(
        layer_types=tuple("attention" if t == "full_attention" else t for t in types),
        rotary_dim=int(head_dim * partial),
        attention_output_gate=True,
        linear_num_key_heads=int(config_json.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(config_json.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(config_json.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(config_json.get("linear_value_head_dim", 128)),
        linear_conv_kernel=int(config_json.get("linear_conv_kernel_dim", 4)),
    )


def _gemma3_from_hf(config_json: dict[str, Any], names: list[str]) -> ModelConfig:
    """Gemma3TextConfig, its defaults where the file omits a field. RoPE as transformers >= 5 writes it
    (rope_parameters per layer type) or as older files do (rope_theta, rope_local_base_freq, rope_scaling)."""
    c = config_json
    act = c.get("hidden_activation", c.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; only gelu_pytorch_tanh")
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is unsupported (a causal target only)")
    if c.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is unsupported (transformers' Gemma 3 does not apply it)")
    layers = int(c.get("num_hidden_layers", 26))
    pattern = int(c.get("sliding_window_pattern", 6))
    types = c.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported gemma3 layer types {unknown}; supported: full_attention, sliding_attention")
    params = c.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or c.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope type {local['rope_type']!r} for Gemma 3's sliding layers")
    hidden = int(c.get("hidden_size", 2304))
    num_heads = int(c.get("num_attention_heads", 8))
    head_dim = int(c.get("head_dim") or 256)
    max_positions = int(c.get("max_position_embeddings", _HF_DEFAULT_MAX_POSITIONS["gemma3"]))
    bias = bool(c.get("attention_bias", False))
    return ModelConfig(
        architecture="gemma3",
        name=str(c.get("_name_or_path") or (names[0] if names else "gemma3")),
        vocab_size=int(c.get("vocab_size", 262208)),
        hidden_size=hidden,
        intermediate_size=int(c.get("intermediate_size", 9216)),
        num_layers=layers,
        num_heads=num_heads,
        num_kv_heads=int(c.get("num_key_value_heads") or 4),
        head_dim=head_dim,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", c.get("rope_theta", 1_000_000.0))),
        rope_scaling=_rope_from_hf(full, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        attention_bias=bias,
        qk_norm=True,
        attention_out_bias=bias,
        layer_types=tuple("attention" if t == "full_attention" else t for t in types),
        sliding_window=int(c.get("sliding_window") or 4096),
        rope_local_theta=float(local.get("rope_theta", c.get("rope_local_base_freq", 10_000.0))),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=float(c.get("final_logit_softcapping") or 0.0),
    )
