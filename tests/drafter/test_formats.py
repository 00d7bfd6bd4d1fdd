"""Random drafters saved in the z-lab, DeepSpec and speculators layouts and converted to GGUF load back identical."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest
import torch
from dspark_grpc.runtime.formats.drafter_formats import (
    convert_to_gguf,
    init_random_drafter,
    load_drafter,
    main,
    save_drafter,
)
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.models.config import RopeScaling
from safetensors.torch import load_file, save_file

from .helpers import assert_same_output, random_features, run_block

YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=256, attention_factor=1.25)


def make_drafter(tiny_target, kind: str):
    t = tiny_target
    common = dict(target_embed=t.embed, target_lm_head=t.lm_head, num_layers=2, block_size=5, seed=11)
    if kind == "dspark":  # Markov + confidence heads, a sliding layer, YaRN
        target = dataclasses.replace(t.config, rope_scaling=YARN)
        return init_random_drafter(target, **common, target_layer_ids=(0, 1), mask_token_id=48000,
                                   layer_types=("full_attention", "sliding_attention"), sliding_window=8,
                                   markov_rank=16, confidence_temperatures=(1.0, 1.5, 2.0))
    if kind == "dflash":  # z-lab-like: no heads, slot 0 unused, non-causal sliding layer
        return init_random_drafter(t.config, **common, target_layer_ids=(-1, 1), slot_convention="dflash",
                                   markov_rank=0, confidence=False, layer_types=("sliding_attention", "full_attention"),
                                   sliding_window=4, causal_sliding=False)
    assert kind == "reduced_vocab"  # speculators-like: draft vocab 1000 + d2t, rnn head, confidence without markov
    drafter = init_random_drafter(t.config, **common, target_layer_ids=(1,), draft_vocab_size=1000,
                                  markov_rank=8, markov_head_type="rnn", confidence=True)
    return drafter


LAYOUTS = {"dspark": ["deepspec", "speculators"], "dflash": ["zlab", "speculators"], "reduced_vocab": ["speculators"]}


def assert_same_drafter(got, expected) -> None:
    assert got.config == expected.config
    a, b = got.state_dict(), expected.state_dict()
    assert a.keys() == b.keys()
    for name, value in b.items():
        assert a[name].dtype == value.dtype and torch.equal(a[name], value), name


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_round_trip_through_every_format(kind, tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, kind)
    c = drafter.config
    features = random_features(c, 11, seed=5)
    expected = run_block(drafter, features, anchor=321)
    shape = {"dspark": (5, 49152), "dflash": (4, 49152), "reduced_vocab": (5, 1000)}[kind]
    assert expected.base_logits.shape == (c.num_drafts, c.draft_vocab_size) == shape
    for layout in LAYOUTS[kind]:
        directory = save_drafter(drafter, tmp_path / layout, layout)
        for path in (directory, convert_to_gguf(directory, tmp_path / f"{layout}.gguf", tiny_target.path)):
            loaded = load_drafter(path, target_path=tiny_target.path)
            assert loaded.config.mask_token_id == c.mask_token_id
            assert loaded.config.target_layer_ids == c.target_layer_ids
            assert loaded.config.slot_convention == c.slot_convention
            assert_same_drafter(loaded, drafter)
            assert_same_output(run_block(loaded, features, anchor=321), expected)


def test_layout_contents(tiny_target, tmp_path):
    dspark, dflash, reduced = (make_drafter(tiny_target, k) for k in ("dspark", "dflash", "reduced_vocab"))
    deepspec = load_file(save_drafter(dspark, tmp_path / "deepspec", "deepspec") / "model.safetensors")
    assert {"embed_tokens.weight", "lm_head.weight", "markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight", "hidden_norm.weight",
            "norm.weight", "layers.1.self_attn.q_norm.weight", "layers.0.mlp.down_proj.weight"} <= deepspec.keys()
    assert deepspec["confidence_head.proj.weight"].shape == (1, 64 + 16)
    zlab_dir = save_drafter(dflash, tmp_path / "zlab", "zlab")
    zlab = load_file(zlab_dir / "model.safetensors")
    assert not any(k.startswith(("embed", "lm_head", "markov", "confidence")) for k in zlab)
    config = json.loads((zlab_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"block_size": 5, "mask_token_id": 49151, "target_layer_ids": [-1, 1]}
    spec_dir = save_drafter(reduced, tmp_path / "speculators", "speculators")
    spec = load_file(spec_dir / "model.safetensors")
    assert "embed_tokens.weight" not in spec and spec["lm_head.weight"].shape == (1000, 64)
    assert spec["markov_head.markov_w1.weight"].shape == (49152, 8) and spec["markov_head.markov_w2.weight"].shape == (
        1000, 8)
    d2t, t2d = spec["d2t"], spec["t2d"]
    assert t2d.dtype == torch.bool and int(t2d.sum()) == 1000
    assert torch.equal(t2d.nonzero().flatten(), torch.arange(1000) + d2t)
    config = json.loads((spec_dir / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2] and config["sample_from_anchor"] is True
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    full_vocab = load_file(save_drafter(dspark, tmp_path / "spec_full", "speculators") / "model.safetensors")
    assert "lm_head.weight" not in full_vocab and "d2t" not in full_vocab  # taken from the target


def test_gguf_metadata_and_tensor_types(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, "dspark").half()
    directory = save_drafter(drafter, tmp_path / "f16", "deepspec")
    reader = open_gguf(convert_to_gguf(directory, tmp_path / "f16.gguf"))
    meta = read_gguf_metadata(reader)
    assert meta["general.architecture"] == "dspark-draft"
    assert meta["dflash.block_size"] == 5 and meta["dflash.mask_token_id"] == 48000
    assert meta["dflash.target_layer_ids"] == [0, 1] and meta["dflash.n_target_layers"] == 2
    assert meta["dflash.slot_convention"] == "dspark" and meta["dflash.dspark.markov_rank"] == 16
    assert meta["dflash.dspark.markov_head_type"] == "vanilla" and meta["dflash.dspark.confidence.enabled"]
    assert meta["dflash.dspark.confidence.with_markov"] and meta["dflash.dspark.confidence.pre_norm"]
    assert meta["dflash.dspark.confidence.temperatures"] == [1.0, 1.5, 2.0]
    assert meta["dspark-draft.rope.scaling.type"] == "yarn" and meta["dspark-draft.rope.scaling.factor"] == 4.0
    assert meta["dspark-draft.rope.scaling.original_context_length"] == 256
    assert meta["dspark-draft.attention.sliding_window_pattern"] == [False, True]
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert types["dflash.fc.weight"] == types["blk.0.attn_q.weight"] == types["dflash.dspark.markov.w1"] == "F16"
    assert types["output_norm.weight"] == types["dflash.dspark.confidence.bias"] == "F32"
    assert "output.weight" not in types  # tied to token_embd: the tiny target ties its embeddings
    loaded = load_drafter(tmp_path / "f16.gguf", dtype=torch.float16)
    assert_same_drafter(loaded, drafter)
    drafter = make_drafter(tiny_target, "dspark").to(torch.bfloat16)
    bf16 = convert_to_gguf(save_drafter(drafter, tmp_path / "bf16", "deepspec"), tmp_path / "bf16.gguf")
    types = {t.name: gguf.GGMLQuantizationType(t.tensor_type).name for t in open_gguf(bf16).tensors}
    assert types["blk.1.ffn_down.weight"] == "BF16" and types["blk.1.ffn_norm.weight"] == "F32"
    assert_same_drafter(load_drafter(bf16, dtype=torch.bfloat16), drafter)


def test_saving_a_drafter_a_layout_cannot_hold(tiny_target, tmp_path):
    dspark, dflash, reduced = (make_drafter(tiny_target, k) for k in ("dspark", "dflash", "reduced_vocab"))
    with pytest.raises(ValueError, match="z-lab layout"):
        save_drafter(dspark, tmp_path / "a", "zlab")
    with pytest.raises(ValueError, match="DeepSpec layout"):
        save_drafter(dflash, tmp_path / "b", "deepspec")
    with pytest.raises(ValueError, match="DeepSpec layout"):
        save_drafter(reduced, tmp_path / "c", "deepspec")
    with pytest.raises(ValueError, match="layout must be"):
        save_drafter(dspark, tmp_path / "d", "eagle3")


def test_load_errors(tiny_target, tmp_path):
    with pytest.raises(FileNotFoundError, match="no drafter"):
        load_drafter(tmp_path / "missing")
    drafter = make_drafter(tiny_target, "dflash")
    zlab = save_drafter(drafter, tmp_path / "zlab", "zlab")

    config = json.loads((zlab / "config.json").read_text())
    (tmp_path / "other_vocab").mkdir()
    (tmp_path / "other_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 50000}))
    (tmp_path / "other_vocab" / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="own target model"):
        load_drafter(tmp_path / "other_vocab", target_path=tiny_target.path)
    with pytest.raises(FileNotFoundError):
        load_drafter(zlab, target_path=tmp_path / "no_target.gguf")

    tensors = load_file(zlab / "model.safetensors")
    save_file({**tensors, "candidate_selector.hidden_projection.weight": torch.zeros(2, 2)}, zlab / "model.safetensors")
    with pytest.raises(ValueError, match="not part of a DFlash/DSpark drafter"):
        load_drafter(zlab, target_path=tiny_target.path)
    save_file({k: v for k, v in tensors.items() if k != "norm.weight"}, zlab / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_drafter(zlab, target_path=tiny_target.path)
    (zlab / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(zlab, target_path=tiny_target.path)

    spec = save_drafter(make_drafter(tiny_target, "reduced_vocab"), tmp_path / "spec", "speculators")
    tensors = load_file(spec / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, spec / "model.safetensors")
    with pytest.raises(ValueError, match="no d2t"):
        load_drafter(spec, target_path=tiny_target.path)

    writer = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a drafter GGUF"):
        load_drafter(tmp_path / "llama.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="neither"):
        load_drafter(tmp_path / "weights.bin")


def test_dspark_convert_cli(tiny_target, tmp_path, capsys):
    directory = save_drafter(make_drafter(tiny_target, "dflash"), tmp_path / "zlab", "zlab")
    out = tmp_path / "out" / "drafter.gguf"
    assert main([str(directory), str(out), "--target", str(tiny_target.path)]) == 0
    assert "wrote" in capsys.readouterr().out and out.is_file()
    assert main([str(tmp_path / "nothing"), str(Path(tmp_path / "x.gguf"))]) == 2
    assert "dspark-convert:" in capsys.readouterr().err
