"""DrafterConfig from z-lab, DeepSpec and speculators config.json (as §4 of the reference describes them), and the
drafter's rotary tables vs transformers' ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

import copy

import pytest
import torch
from dspark_grpc.runtime.formats.drafter_config import (
    default_target_layer_ids,
    drafter_config_from_hf,
    layers_to_hf,
)
from dspark_grpc.runtime.models.rope import rope_inv_freq
from tolerance import rope_inv_freq_error
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

QWEN3_4B_LAYERS = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "attention_bias": False,
}
ZLAB_LEGACY = {  # z-lab/Qwen3-4B-DFlash-b16
    "architectures": ["DFlashDraftModel"],
    **QWEN3_4B_LAYERS,
    "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "num_target_layers": 36,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
}
ZLAB_2026 = {  # transformers >= 5 style: rope_parameters, block_size inside dflash_config, mostly-sliding layers
    "architectures": ["DFlashDraftModel"],
    **QWEN3_4B_LAYERS,
    "dflash_config": {"block_size": 10, "mask_token_id": 248077, "target_layer_ids": [1, 16, 31, 46, 61]},
    "num_target_layers": 64,
    "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"},
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "sliding_window": 2048,
    "vocab_size": 248320,
}
DEEPSPEC = {  # deepseek-ai/dspark_qwen3_4b_block7: the target's config plus top-level drafter keys
    "architectures": ["Qwen3DSparkModel"],
    **QWEN3_4B_LAYERS,
    "rope_theta": 1000000.0,
    "num_target_layers": 36,
    "block_size": 7,
    "target_layer_ids": [1, 9, 17, 25, 33],
    "mask_token_id": 151669,
    "num_anchors": 512,
    "markov_rank": 256,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "layer_types": ["full_attention"] * 5,
    "tie_word_embeddings": False,
}
SPECULATORS = {  # speculators DSparkSpeculator (Qwen3-0.6B example: block 8, 3 layers, r 256, draft vocab 32000)
    "speculators_model_type": "dspark",
    "architectures": ["DSparkSpeculator"],
    "transformer_layer_config": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 3,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "vocab_size": 151936,
        "layer_types": ["full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 512,
    },
    "draft_vocab_size": 32000,
    "block_size": 8,
    "target_hidden_size": 1024,
    "aux_hidden_state_layer_ids": [2, 14, 25],
    "mask_token_id": 151669,
    "sliding_window_non_causal": False,
    "sample_from_anchor": True,
    "markov_rank": 256,
    "markov_head_type": "gated",
    "enable_confidence_head": True,
    "confidence_head_with_markov": False,
    "speculators_config": {
        "algorithm": "dspark",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 8}],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": "Qwen/Qwen3-0.6B", "architectures": ["Qwen3ForCausalLM"]},
    },
}


def test_zlab_legacy():
    c = drafter_config_from_hf(ZLAB_LEGACY)
    assert c.slot_convention == "dflash" and c.num_drafts == 15 and c.block_size == 16
    assert c.mask_token_id == 151669 and c.target_layer_ids == (1, 9, 17, 25, 33) and c.num_target_layers == 36
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2560, 5, 32, 8, 128)
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.layer_types == ("full_attention",) * 5 and c.sliding_window is None
    assert c.vocab_size == c.draft_vocab_size == 151936 and c.target_hidden_size == 2560 and c.fc_in_features == 12800
    assert c.markov_rank == 0 and not c.confidence_enabled
    m = c.layer_model_config()
    assert m.architecture == "qwen3" and m.qk_norm and not m.attention_bias and m.num_layers == 5


def test_zlab_2026_nested_block_size_rope_parameters_and_sliding_layers():
    c = drafter_config_from_hf(ZLAB_2026)
    assert c.block_size == 10 and c.mask_token_id == 248077 and c.target_layer_ids == (1, 16, 31, 46, 61)
    assert c.rope_theta == 1e7 and c.rope_scaling is None
    assert c.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert c.sliding_window == 2048 and c.causal_sliding
    non_causal = drafter_config_from_hf({**ZLAB_2026, "is_causal": False})
    assert not non_causal.causal_sliding
    with pytest.raises(ValueError, match="causal"):
        drafter_config_from_hf({**ZLAB_2026, "is_causal": True})  # would make the full layer causal


def test_zlab_default_target_layer_ids():
    cj = copy.deepcopy(ZLAB_LEGACY)
    del cj["dflash_config"]["target_layer_ids"]
    assert drafter_config_from_hf(cj).target_layer_ids == (1, 9, 17, 25, 33)  # Qwen3-4B, 5 draft layers
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)  # Qwen3-14B
    del cj["num_target_layers"]
    with pytest.raises(ValueError, match="target_layer_ids"):
        drafter_config_from_hf(cj)


def test_deepspec():
    c = drafter_config_from_hf(DEEPSPEC)
    assert c.slot_convention == "dspark" and c.num_drafts == 7
    assert c.mask_token_id == 151669 and c.target_layer_ids == (1, 9, 17, 25, 33) and c.num_target_layers == 36
    assert c.markov_rank == 256 and c.markov_head_type == "vanilla"
    assert c.confidence_enabled and c.confidence_with_markov
    assert not c.confidence_pre_norm  # DeepSpec's head reads the post-norm hidden state
    assert c.draft_vocab_size == c.vocab_size == 151936
    plain = {k: v for k, v in DEEPSPEC.items() if k not in ("markov_head_type", "confidence_head_with_markov")}
    c = drafter_config_from_hf({**plain, "markov_rank": 0, "enable_confidence_head": False})  # DeepSpec "DFlash"
    assert c.markov_rank == 0 and not c.confidence_enabled and c.slot_convention == "dspark"


def test_speculators_dspark():
    c = drafter_config_from_hf(SPECULATORS)
    assert c.slot_convention == "dspark" and c.num_drafts == 8
    assert c.target_layer_ids == (1, 13, 24)  # aux ids are one higher (vLLM captures layer inputs)
    assert c.num_target_layers is None and c.target_hidden_size == 1024
    assert c.vocab_size == 151936 and c.draft_vocab_size == 32000
    assert c.markov_rank == 256 and c.markov_head_type == "gated" and c.confidence_enabled
    assert not c.confidence_with_markov and not c.confidence_pre_norm
    assert c.layer_types == ("full_attention", "sliding_attention", "full_attention") and c.sliding_window == 512
    assert c.causal_sliding
    assert not drafter_config_from_hf({**SPECULATORS, "sliding_window_non_causal": True}).causal_sliding


def test_speculators_slot_convention_comes_from_the_checkpoint():
    dflash = drafter_config_from_hf({**SPECULATORS, "sample_from_anchor": False})
    assert dflash.slot_convention == "dflash" and dflash.num_drafts == 7
    no_flag = {k: v for k, v in SPECULATORS.items() if k != "sample_from_anchor"}
    assert drafter_config_from_hf(no_flag).slot_convention == "dspark"  # speculative_tokens == block_size
    seven = copy.deepcopy(no_flag)
    seven["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    assert drafter_config_from_hf(seven).slot_convention == "dflash"
    del seven["speculators_config"]
    with pytest.raises(ValueError, match="slot convention"):
        drafter_config_from_hf(seven)
    plain_dflash = {**seven, "speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"]}
    assert drafter_config_from_hf(plain_dflash).slot_convention == "dflash"


def test_speculators_layer_config_saved_as_a_diff_and_nested_mask_token():
    cj = copy.deepcopy(SPECULATORS)
    for key in ("vocab_size", "head_dim", "rms_norm_eps"):  # equal to Qwen3Config's defaults: left out
        del cj["transformer_layer_config"][key]
    cj["dflash_config"] = {"mask_token_id": cj.pop("mask_token_id")}
    c = drafter_config_from_hf(cj)
    assert (c.vocab_size, c.head_dim, c.rms_norm_eps, c.mask_token_id) == (151936, 128, 1e-6, 151669)


@pytest.mark.parametrize(
    "config_json, message",
    [
        ({**ZLAB_LEGACY, "architectures": []}, "slot convention"),
        ({k: v for k, v in DEEPSPEC.items() if k != "architectures"}, "slot convention"),
        ({**ZLAB_LEGACY, "architectures": ["DFlash2DraftModel"]}, "unsupported drafter architecture"),
        ({**DEEPSPEC, "architectures": ["Gemma4DSparkModel"]}, "unsupported drafter architecture"),
        ({**ZLAB_LEGACY, "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}}, "mask_token_id"),
        ({**ZLAB_LEGACY, "final_logit_softcapping": 20.0}, "softcapping"),
        ({**ZLAB_LEGACY, "attention_bias": True}, "attention_bias"),
        ({**DEEPSPEC, "markov_head_type": "lstm"}, "markov head"),
        ({**DEEPSPEC, "block_size": 1, "architectures": ["DFlashDraftModel"]}, "no draft slot"),
        ({**SPECULATORS, "speculators_model_type": "eagle3"}, "speculators_model_type"),
        ({"architectures": ["Qwen3ForCausalLM"], **QWEN3_4B_LAYERS}, "not a DFlash/DSpark drafter"),
    ],
)
def test_config_errors(config_json, message):
    with pytest.raises(ValueError, match=message):
        drafter_config_from_hf(config_json)


YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8192}
YARN_PARAMS = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 0.8, "truncate": False}
ROPE_LAYOUTS = {
    "legacy_rope_scaling": ({"rope_theta": 1e6, "rope_scaling": {k: v for k, v in YARN.items() if k != "rope_theta"}},
                            YARN),
    "rope_parameters": ({"rope_parameters": YARN}, YARN),
    "rope_parameters_beta_attention_factor": ({"rope_parameters": YARN_PARAMS}, YARN_PARAMS),
    "nested_per_layer_type": (
        {"rope_parameters": {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        YARN,
    ),
    "default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e7}},
                {"rope_type": "default", "rope_theta": 1e7}),
}


@pytest.mark.parametrize("layout", list(ROPE_LAYOUTS))
def test_rope_tables_match_transformers(layout):
    fields, reference = ROPE_LAYOUTS[layout]
    cj = {k: v for k, v in ZLAB_LEGACY.items() if k not in ("rope_theta", "rope_scaling")}
    c = drafter_config_from_hf({**cj, **fields})
    hf = Qwen3Config(**{k: v for k, v in QWEN3_4B_LAYERS.items() if k != "model_type"}, rope_parameters=dict(reference))
    if reference["rope_type"] == "default":
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        expected, expected_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        expected, expected_scale = ROPE_INIT_FUNCTIONS[reference["rope_type"]](hf, None)
    inv_freq, scale = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    torch.testing.assert_close(inv_freq, expected, rtol=2 * rope_inv_freq_error(c.rope_theta), atol=0)
    assert scale == pytest.approx(expected_scale, rel=1e-12)  # a few float64 ops: within ~1e-15
    again = drafter_config_from_hf({**cj, **layers_to_hf(c)})  # what save_drafter writes parses back the same
    assert again.rope_theta == c.rope_theta and again.rope_scaling == c.rope_scaling


def test_speculators_nested_rope_uses_the_sliding_entry():
    cj = copy.deepcopy(SPECULATORS)
    cj["transformer_layer_config"]["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        "sliding_attention": YARN,
    }
    c = drafter_config_from_hf(cj)
    assert c.rope_theta == 1e6 and c.rope_scaling is not None and c.rope_scaling.kind == "yarn"
