"""Drafter shape: one frozen dataclass, filled from a z-lab DFlash, DeepSpec DSpark or speculators config.json,
or from the metadata of a drafter GGUF written by `drafter_formats.convert_to_gguf`.

Conventions. `target_layer_ids`: id l = the output of target decoder layer l (HF `hidden_states[l + 1]`; -1 = the
embedding output), as z-lab and DeepSpec write them; speculators' `aux_hidden_state_layer_ids` are one higher.
`slot_convention`: "dspark" = slot k of the block [anchor, MASK x (B-1)] predicts the token at p+k+1 (B drafts);
"dflash" = slot k predicts the token at p+k and slot 0 is unused (B-1 drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dspark_grpc.runtime.models.config import ModelConfig, RopeScaling, _f32, _yarn_attention_factor, config_from_hf

SlotConvention = Literal["dspark", "dflash"]
SLOT_CONVENTIONS = ("dspark", "dflash")
LAYER_TYPES = ("full_attention", "sliding_attention")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
GGUF_ARCH = "dspark-draft"
# transformers' Qwen3Config defaults for the shape keys (speculators saves transformer_layer_config as a diff).
_QWEN3_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None  # None: the checkpoint does not say (speculators)
    target_hidden_size: int
    mask_token_id: int
    slot_convention: SlotConvention
    vocab_size: int  # the target's
    draft_vocab_size: int
    layer_types: tuple[str, ...] = ()  # () = all full attention
    sliding_window: int | None = None
    causal_sliding: bool = True  # sliding layers are causal inside the block
    markov_rank: int = 0  # 0 = no Markov head
    markov_head_type: str = "vanilla"
    confidence_enabled: bool = False
    confidence_with_markov: bool = False
    confidence_pre_norm: bool = True  # the head reads the hidden state before the final norm
    confidence_temperatures: tuple[float, ...] | None = None
    name: str = "drafter"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.confidence_temperatures is not None:
            object.__setattr__(self, "confidence_temperatures", tuple(float(t) for t in self.confidence_temperatures))
        if not self.markov_rank:  # canonical values for absent heads, so that equal drafters compare equal
            object.__setattr__(self, "markov_head_type", "vanilla")
        if not self.confidence_enabled:
            object.__setattr__(self, "confidence_pre_norm", True)
            object.__setattr__(self, "confidence_temperatures", None)
        problems = []
        if self.slot_convention not in SLOT_CONVENTIONS:
            problems.append(f"slot_convention must be one of {SLOT_CONVENTIONS}, got {self.slot_convention!r}")
        elif self.num_drafts < 1:
            problems.append(f"block_size {self.block_size} leaves no draft slot ({self.slot_convention} convention)")
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            problems.append(f"layer_types must be {self.num_layers} entries of {LAYER_TYPES}, got {self.layer_types}")
        if "sliding_attention" in self.layer_types and not (self.sliding_window or 0) > 0:
            problems.append("sliding_attention layers need a sliding_window > 0")
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        top = self.num_target_layers
        if any(i < -1 or (top is not None and i >= top) for i in self.target_layer_ids):
            bound = "?" if top is None else top - 1
            problems.append(f"target_layer_ids {list(self.target_layer_ids)} outside -1..{bound}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.vocab_size})")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} must be in 1..vocab_size {self.vocab_size}")
        if self.markov_rank < 0 or (self.markov_rank and self.markov_head_type not in MARKOV_HEAD_TYPES):
            problems.append(f"markov head: rank {self.markov_rank} >= 0, type in {MARKOV_HEAD_TYPES} "
                            f"(got {self.markov_head_type!r})")
        if self.confidence_with_markov and not (self.confidence_enabled and self.markov_rank):
            problems.append("confidence_with_markov needs an enabled confidence head and markov_rank > 0")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            problems.append(f"heads {self.num_heads}/{self.num_kv_heads} and head_dim {self.head_dim}: need "
                            "num_heads % num_kv_heads == 0 and an even head_dim")
        if problems:
            raise ValueError("invalid drafter config: " + "; ".join(problems))

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.slot_convention == "dspark" else self.block_size - 1

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    def layer_model_config(self) -> ModelConfig:
        """The draft layers as a qwen3 ModelConfig (q/k norm, no biases) for runtime.models.transformer.Block."""
        return ModelConfig(
            architecture="qwen3",
            name=self.name,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            qk_norm=True,
        )


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's choice: the middle layer for one draft layer, else evenly spaced from 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


# -- HF config.json --------------------------------------------------------------------------------------------


def drafter_config_from_hf(config_json: dict[str, Any]) -> DrafterConfig:
    """Auto-detects z-lab DFlash (DFlashDraftModel), DeepSpec DSpark (Qwen3DSparkModel) and speculators
    (speculators_model_type dspark/dflash). The slot convention comes from the checkpoint, never a guess."""
    archs = list(config_json.get("architectures") or [])
    if "speculators_model_type" in config_json:
        return _from_speculators(config_json)
    if "DFlashDraftModel" in archs:
        return _from_zlab(config_json)
    if "Qwen3DSparkModel" in archs:
        return _from_deepspec(config_json)
    unsupported = [a for a in archs if a in ("DFlash2DraftModel", "Gemma4DSparkModel", "DSparkForCausalLM")]
    if unsupported:
        raise ValueError(f"unsupported drafter architecture {unsupported[0]!r}; supported: DFlashDraftModel (z-lab), "
                         "Qwen3DSparkModel (DeepSpec), speculators dspark/dflash")
    if any(k in config_json for k in ("dflash_config", "block_size", "mask_token_id", "markov_rank")):
        raise ValueError(f"cannot determine the drafter's slot convention from architectures {archs}: expected "
                         "DFlashDraftModel (slot k predicts p+k), Qwen3DSparkModel (slot k predicts p+k+1) or a "
                         "speculators config with sample_from_anchor")
    raise ValueError(f"not a DFlash/DSpark drafter config (architectures {archs})")


def _from_zlab(cj: dict[str, Any]) -> DrafterConfig:
    dc = cj.get("dflash_config") or {}
    _reject_extras(cj, dc)
    layers = _layer_fields(cj, prefer_rope="full_attention")
    causal = cj.get("is_causal", dc.get("causal"))
    if causal and "full_attention" in layers["layer_types"] and "is_causal" in cj:
        raise ValueError("is_causal=true makes full-attention draft layers causal, which is unsupported")
    mask = dc.get("mask_token_id", cj.get("mask_token_id"))
    if mask is None:
        raise ValueError("z-lab drafter config lacks dflash_config.mask_token_id")
    num_target = cj.get("num_target_layers")
    ids = dc.get("target_layer_ids", cj.get("target_layer_ids"))
    return DrafterConfig(
        **layers,
        block_size=int(dc.get("block_size", cj.get("block_size", 16))),
        target_layer_ids=_layer_ids(ids, num_target, layers["num_layers"]),
        num_target_layers=None if num_target is None else int(num_target),
        target_hidden_size=int(cj.get("target_hidden_size") or layers["hidden_size"]),
        mask_token_id=int(mask),
        slot_convention="dflash",
        draft_vocab_size=layers["vocab_size"],
        causal_sliding=True if causal is None else bool(causal),
        name=str(cj.get("_name_or_path") or "z-lab DFlash drafter"),
    )


def _from_deepspec(cj: dict[str, Any]) -> DrafterConfig:
    _reject_extras(cj, {})
    layers = _layer_fields(cj, prefer_rope="full_attention")
    for key in ("block_size", "mask_token_id"):
        if key not in cj:
            raise ValueError(f"DeepSpec drafter config lacks {key}")
    num_target = cj.get("num_target_layers")
    rank = int(cj.get("markov_rank", 0))
    confidence = bool(cj.get("enable_confidence_head", False))
    return DrafterConfig(
        **layers,
        block_size=int(cj["block_size"]),
        target_layer_ids=_layer_ids(cj.get("target_layer_ids"), num_target, layers["num_layers"]),
        num_target_layers=None if num_target is None else int(num_target),
        target_hidden_size=int(cj.get("target_hidden_size") or layers["hidden_size"]),
        mask_token_id=int(cj["mask_token_id"]),
        slot_convention="dspark",
        draft_vocab_size=layers["vocab_size"],
        causal_sliding=not cj.get("sliding_window_non_causal", False),
        markov_rank=rank,
        markov_head_type=str(cj.get("markov_head_type", "vanilla")),
        confidence_enabled=confidence,
        confidence_with_markov=confidence and bool(cj.get("confidence_head_with_markov", False)),
        # DeepSpec feeds the post-final-norm hidden state; our own exports say otherwise explicitly.
        confidence_pre_norm=bool(cj.get("confidence_head_pre_norm", False)),
        confidence_temperatures=cj.get("confidence_temperatures"),
        name=str(cj.get("_name_or_path") or "DeepSpec DSpark drafter"),
    )


def _from_speculators(cj: dict[str, Any]) -> DrafterConfig:
    kind = cj["speculators_model_type"]
    if kind not in ("dspark", "dflash"):
        raise ValueError(f"unsupported speculators_model_type {kind!r}; supported: dspark, dflash")
    if cj.get("projector_type", "dflash") not in ("dflash", "dspark"):
        raise ValueError(f"unsupported speculators projector_type {cj['projector_type']!r}")
    layer_cfg = cj.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError("speculators config lacks transformer_layer_config")
    if layer_cfg.get("model_type", "qwen3") == "qwen3":  # saved with to_diff_dict: defaults may be left out
        layer_cfg = {**_QWEN3_DEFAULTS, **layer_cfg}
    layers = _layer_fields(layer_cfg, prefer_rope="sliding_attention")

    def get(key: str, default: Any = None) -> Any:
        for nested in ("dspark_config", "dflash_config"):
            if isinstance(cj.get(nested), dict) and key in cj[nested]:
                return cj[nested][key]
        return cj.get(key, default)

    block_size = get("block_size")
    mask = get("mask_token_id")
    if block_size is None or mask is None:
        raise ValueError("speculators drafter config lacks block_size or mask_token_id")
    block_size = int(block_size)
    aux = cj.get("aux_hidden_state_layer_ids")
    ids = None if aux is None else [int(a) - 1 for a in aux]  # vLLM's ids name the input of layer l
    num_target = get("num_target_layers")
    rank = int(get("markov_rank", 0))
    confidence = bool(get("enable_confidence_head", False))
    return DrafterConfig(
        **layers,
        block_size=block_size,
        target_layer_ids=_layer_ids(ids, num_target, layers["num_layers"]),
        num_target_layers=None if num_target is None else int(num_target),
        target_hidden_size=int(cj.get("target_hidden_size") or layers["hidden_size"]),
        mask_token_id=int(mask),
        slot_convention=_speculators_slots(cj, kind, block_size),
        draft_vocab_size=int(cj.get("draft_vocab_size") or layers["vocab_size"]),
        causal_sliding=not cj.get("sliding_window_non_causal", False),
        markov_rank=rank,
        markov_head_type=str(get("markov_head_type", "vanilla")),
        confidence_enabled=confidence,
        confidence_with_markov=confidence and bool(get("confidence_head_with_markov", False)),
        confidence_pre_norm=bool(get("confidence_head_pre_norm", False)),
        confidence_temperatures=get("confidence_temperatures"),
        name=str(cj.get("_name_or_path") or f"speculators {kind} drafter"),
    )


def _speculators_slots(cj: dict[str, Any], kind: str, block_size: int) -> SlotConvention:
    if "sample_from_anchor" in cj:
        return "dspark" if cj["sample_from_anchor"] else "dflash"
    methods = (cj.get("speculators_config") or {}).get("proposal_methods") or []
    tokens = next((m.get("speculative_tokens") for m in methods if isinstance(m, dict)), None)
    if tokens == block_size:
        return "dspark"
    if tokens == block_size - 1:
        return "dflash"
    if kind == "dflash":  # speculators' DFlash always predicted p+k before sample_from_anchor existed
        return "dflash"
    raise ValueError("cannot determine the slot convention of this speculators dspark drafter: it has neither "
                     "sample_from_anchor nor speculative_tokens equal to block_size or block_size - 1")


def _reject_extras(cj: dict[str, Any], dc: dict[str, Any]) -> None:
    def value(key: str) -> Any:
        return dc.get(key, cj.get(key))

    if value("output_multiplier") not in (None, 1, 1.0) or value("final_logit_softcapping"):
        raise ValueError("drafters with output_multiplier or final_logit_softcapping are unsupported")
    if value("input_embedding_scale") not in (None, 1, 1.0):
        raise ValueError("drafters with input_embedding_scale are unsupported")
    if dc.get("use_swa") or dc.get("attention_sink_bias"):
        raise ValueError("dflash_config.use_swa / attention_sink_bias are unsupported")
    if cj.get("is_neox_style") is False:
        raise ValueError("is_neox_style=false (interleaved RoPE) is unsupported")


def _layer_ids(ids: Any, num_target: Any, num_layers: int) -> tuple[int, ...]:
    if ids is not None:
        return tuple(int(i) for i in ids)
    if num_target is None:
        raise ValueError("the drafter config has neither target_layer_ids nor num_target_layers")
    return default_target_layer_ids(int(num_target), num_layers)


def _layer_fields(cfg: dict[str, Any], prefer_rope: str) -> dict[str, Any]:
    """The draft layers' hparams, parsed as a Qwen3 config (legacy rope_theta/rope_scaling or rope_parameters,
    possibly nested per layer type: `prefer_rope` picks the entry)."""
    cfg = dict(cfg)
    if cfg.get("attention_bias"):
        raise ValueError("drafters with attention_bias=true are unsupported")
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        other = next(t for t in LAYER_TYPES if t != prefer_rope)
        cfg["rope_parameters"] = rope.get(prefer_rope) or rope.get(other) or next(iter(rope.values()))
    num_layers = int(cfg["num_hidden_layers"])
    sliding_window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' Qwen3 rule
        first = int(cfg.get("max_window_layers") or num_layers)
        use = bool(cfg.get("use_sliding_window")) and sliding_window is not None
        layer_types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(num_layers)]
    layer_types = tuple(str(t) for t in layer_types)
    for key in ("use_sliding_window", "max_window_layers", "layer_types"):
        cfg.pop(key, None)
    cfg["architectures"] = ["Qwen3ForCausalLM"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key not in cfg:
            raise ValueError(f"drafter layer config lacks {key}")
    m = config_from_hf(cfg)
    return dict(
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        intermediate_size=m.intermediate_size,
        rms_norm_eps=m.rms_norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling=m.rope_scaling,
        max_position_embeddings=m.max_position_embeddings,
        vocab_size=m.vocab_size,
        layer_types=layer_types,
        sliding_window=int(sliding_window) if "sliding_attention" in layer_types else None,
    )


def rope_to_hf(config: DrafterConfig) -> dict[str, Any]:
    """`rope_parameters` (transformers >= 5) for config.json."""
    params: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    s = config.rope_scaling
    if s is None:
        return params
    params.update(rope_type=s.kind, factor=s.factor)
    if s.kind == "yarn":
        params.update(original_max_position_embeddings=s.original_max_position_embeddings, beta_fast=s.beta_fast,
                      beta_slow=s.beta_slow, truncate=s.truncate)
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
    elif s.kind == "llama3":
        params.update(original_max_position_embeddings=s.original_max_position_embeddings,
                      low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    return params


def layers_to_hf(config: DrafterConfig) -> dict[str, Any]:
    """The draft layers as Qwen3 config.json fields."""
    c = config
    sliding = "sliding_attention" in c.layer_types
    return {
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": rope_to_hf(c),
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": list(c.layer_types),
        "sliding_window": c.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "attention_bias": False,
        "vocab_size": c.vocab_size,
    }


# -- GGUF ---------------------------------------------------------------------------------------------------------


def drafter_config_from_gguf(metadata: dict[str, Any]) -> DrafterConfig:
    """DrafterConfig from the metadata of a GGUF written by `convert_to_gguf` (arch "dspark-draft").

    Hparams live under `dspark-draft.*` (llama.cpp names); drafter keys under `dflash.*` (also read as
    `dspark-draft.dflash.*`, lucebox's spelling).
    """
    arch = metadata.get("general.architecture")
    if arch != GGUF_ARCH:
        raise ValueError(f"not a drafter GGUF: general.architecture is {arch!r}, expected {GGUF_ARCH!r}")
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is missing:
            raise ValueError(f"drafter GGUF metadata lacks required key '{arch}.{key}'")
        return value

    def dflash(key: str, default: Any = missing) -> Any:
        value = metadata.get(f"dflash.{key}", metadata.get(f"{arch}.dflash.{key}", default))
        if value is missing:
            raise ValueError(f"drafter GGUF metadata lacks required key 'dflash.{key}'")
        return value

    num_layers = int(get("block_count"))
    pattern = get("attention.sliding_window_pattern", None)
    layer_types = () if pattern is None else tuple(LAYER_TYPES[bool(p)] for p in pattern)
    num_target = dflash("n_target_layers", None)
    temps = dflash("dspark.confidence.temperatures", None)
    hidden = int(get("embedding_length"))
    vocab = int(get("vocab_size"))
    return DrafterConfig(
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=int(get("attention.head_count")),
        num_kv_heads=int(get("attention.head_count_kv")),
        head_dim=int(get("attention.key_length")),
        intermediate_size=int(get("feed_forward_length")),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base")),
        rope_scaling=_rope_from_gguf(metadata, arch),
        max_position_embeddings=int(get("context_length")),
        layer_types=layer_types,
        sliding_window=int(get("attention.sliding_window")) if "sliding_attention" in layer_types else None,
        causal_sliding=bool(dflash("causal_sliding", True)),
        block_size=int(dflash("block_size")),
        target_layer_ids=tuple(int(i) for i in dflash("target_layer_ids")),
        num_target_layers=None if num_target is None else int(num_target),
        target_hidden_size=int(dflash("target_hidden_size", hidden)),
        mask_token_id=int(dflash("mask_token_id")),
        slot_convention=str(dflash("slot_convention")),
        vocab_size=vocab,
        draft_vocab_size=int(dflash("dspark.vocab_size", vocab)),
        markov_rank=int(dflash("dspark.markov_rank", 0)),
        markov_head_type=str(dflash("dspark.markov_head_type", "vanilla")),
        confidence_enabled=bool(dflash("dspark.confidence.enabled", False)),
        confidence_with_markov=bool(dflash("dspark.confidence.with_markov", False)),
        confidence_pre_norm=bool(dflash("dspark.confidence.pre_norm", True)),
        confidence_temperatures=None if temps is None else tuple(_f32(t) for t in temps),
        name=str(metadata.get("general.name", "drafter")),
    )


def _rope_from_gguf(metadata: dict[str, Any], arch: str) -> RopeScaling | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = _f32(metadata[f"{arch}.rope.scaling.factor"])
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor,
            original_max_position_embeddings=int(original),
            low_freq_factor=_f32(metadata[f"{arch}.rope.scaling.low_freq_factor"]),
            high_freq_factor=_f32(metadata[f"{arch}.rope.scaling.high_freq_factor"]),
        )
    if kind == "yarn":
        attention = metadata.get(f"{arch}.rope.scaling.yarn_attn_factor")
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=int(original),
            beta_fast=_f32(metadata.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=_f32(metadata.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=_yarn_attention_factor(factor, None, None) if attention is None else _f32(attention),
            truncate=bool(metadata.get(f"{arch}.rope.scaling.yarn_truncate", True)),
        )
    raise ValueError(f"unsupported rope scaling type {kind!r} in the drafter GGUF")
