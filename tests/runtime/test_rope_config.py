"""RoPE frequencies vs transformers' ROPE_INIT_FUNCTIONS, and ModelConfig parsing from HF and GGUF metadata."""

from __future__ import annotations

import math

import pytest
import torch
from dspark_grpc.runtime.models.config import RopeScaling, config_from_gguf, config_from_hf
from dspark_grpc.runtime.models.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotate_half
from tolerance import assert_within, gamma, rope_inv_freq_error, unit_roundoff
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

BASE = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn_params": {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 2048,
        "attention_factor": 0.75,
    },
    "yarn_mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def _hf_rope(rope: dict) -> tuple[LlamaConfig, torch.Tensor, float]:
    config = LlamaConfig(**BASE, rope_parameters=dict(rope))
    if rope["rope_type"] == "default":
        inv_freq, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, None)
    return config, inv_freq, scale


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_scaling_match_hf(name):
    config, expected, expected_scale = _hf_rope(ROPES[name])
    ours = config_from_hf(config.to_dict())
    inv_freq, scale = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (ours.head_dim // 2,)
    torch.testing.assert_close(inv_freq, expected, rtol=2 * rope_inv_freq_error(ours.rope_theta), atol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-12)  # a few float64 ops: within ~1e-15
    assert (ours.rope_scaling is None) == (name == "default")


@pytest.mark.parametrize("name", ["default", "yarn"])
def test_cos_sin_and_rotation_match_hf(name):
    config, _, _ = _hf_rope(ROPES[name])
    ours = config_from_hf(config.to_dict())
    positions = torch.tensor([0, 1, 7, 300, 5000])
    q, k = torch.randn(2, 1, 4, len(positions), ours.head_dim).unbind(0)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(q, positions[None])
    inv_freq, scale = rope_inv_freq(ours.head_dim, ours.rope_theta, ours.rope_scaling)
    cos, sin = rope_cos_sin(positions, inv_freq, scale, torch.float32)
    # the angles p * inv_freq differ by the two sides' inv_freq errors and their own rounding (u each) times the
    # largest angle; cos and sin are 1-Lipschitz, evaluated within 1 ulp (2 u) and scaled (u), on each side
    u = unit_roundoff()
    angle = float(positions.max()) * float(inv_freq.max())
    atol = scale * (angle * (2 * rope_inv_freq_error(ours.rope_theta) + 2 * u) + 6 * u)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=atol)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=atol)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    for x, hf_x in ((q[0], hf_q[0]), (k[0], hf_k[0])):
        # x cos + rotate_half(x) sin: the cos/sin differences times |x|, plus each side's two products and sum
        magnitude = x.abs() + rotate_half(x).abs()
        assert_within(apply_rope(x, cos, sin), hf_x, (atol + 2 * gamma(2) * scale) * magnitude)


def _hf_json(**overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **BASE, **overrides}


def test_nested_rope_parameters_parse_like_legacy_rope_scaling():
    legacy = config_from_hf(
        _hf_json(
            rope_theta=1e6,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        )
    )
    legacy_rope_type = config_from_hf(
        _hf_json(
            rope_theta=1e6,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192},
        )
    )
    nested = config_from_hf(
        _hf_json(
            rope_parameters={
                "rope_theta": 1e6,
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    assert legacy == legacy_rope_type == nested
    assert nested.rope_theta == 1e6
    assert nested.rope_scaling == RopeScaling(
        "yarn", 4.0, original_max_position_embeddings=8192, attention_factor=0.1 * math.log(4.0) + 1
    )
    assert config_from_hf(_hf_json(rope_theta=5e5)).rope_theta == 5e5
    assert config_from_hf(_hf_json()).rope_theta == 10000.0


def test_hf_architectures():
    qwen2 = config_from_hf({**_hf_json(), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    assert qwen2.architecture == "qwen2" and qwen2.attention_bias and not qwen2.attention_out_bias
    qwen3 = config_from_hf({**_hf_json(head_dim=128), "architectures": ["Qwen3ForCausalLM"]})
    assert qwen3.architecture == "qwen3" and qwen3.qk_norm and qwen3.head_dim == 128
    llama = config_from_hf(_hf_json(attention_bias=True))
    assert llama.attention_bias and llama.attention_out_bias
    assert config_from_hf(_hf_json()).num_kv_heads == 2
    for bad in (["MistralForCausalLM"], ["GPT2LMHeadModel"]):
        with pytest.raises(ValueError, match="unsupported HF architecture"):
            config_from_hf({**_hf_json(), "architectures": bad})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        config_from_hf(_hf_json(rope_scaling={"type": "dynamic", "factor": 2.0}))


def _gguf_meta(arch: str = "llama", **extra) -> dict:
    meta = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.block_count": 2,
        f"{arch}.embedding_length": 256,
        f"{arch}.feed_forward_length": 512,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 9.999999747378752e-06,  # 1e-5 as float32
        f"{arch}.context_length": 32768,
        "tokenizer.ggml.tokens": ["a"] * 1000,
    }
    meta.update({k.format(arch=arch): v for k, v in extra.items()})
    return meta


def test_gguf_config_and_fingerprint_match_hf():
    hf = config_from_hf(
        _hf_json(
            rope_parameters={
                "rope_theta": 1e6,
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    gguf = config_from_gguf(
        _gguf_meta(
            **{
                "{arch}.rope.scaling.type": "yarn",
                "{arch}.rope.scaling.factor": 4.0,
                "{arch}.rope.scaling.original_context_length": 8192,
            }
        ),
        has_output_weight=True,
    )
    assert gguf.vocab_size == 1000 and gguf.head_dim == 64 and gguf.rms_norm_eps == 1e-5
    assert gguf.rope_scaling == hf.rope_scaling
    assert gguf.fingerprint() == hf.fingerprint()
    assert not gguf.tie_word_embeddings
    assert config_from_gguf(_gguf_meta()).tie_word_embeddings  # no output.weight
    # The fingerprint ignores what does not change the architecture's shape...
    assert config_from_gguf(_gguf_meta(**{"{arch}.context_length": 4096})).fingerprint() == (
        config_from_gguf(_gguf_meta()).fingerprint()
    )
    # ...and changes with what does.
    assert config_from_gguf(_gguf_meta(**{"{arch}.rope.freq_base": 1e4})).fingerprint() != (
        config_from_gguf(_gguf_meta()).fingerprint()
    )
    qwen3 = config_from_gguf(_gguf_meta("qwen3", **{"{arch}.attention.key_length": 128, "{arch}.vocab_size": 7}))
    assert qwen3.qk_norm and qwen3.head_dim == 128 and qwen3.vocab_size == 7
    assert config_from_gguf(_gguf_meta("qwen2")).attention_bias


def test_gguf_config_errors():
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi3'"):
        config_from_gguf(_gguf_meta("phi3"))
    meta = _gguf_meta()
    del meta["llama.block_count"]
    with pytest.raises(ValueError, match="llama.block_count"):
        config_from_gguf(meta)
    with pytest.raises(ValueError, match="partial rotary"):
        config_from_gguf(_gguf_meta(**{"{arch}.rope.dimension_count": 32}))
    with pytest.raises(ValueError, match="longrope"):
        config_from_gguf(_gguf_meta(**{"{arch}.rope.scaling.type": "longrope", "{arch}.rope.scaling.factor": 2.0}))
