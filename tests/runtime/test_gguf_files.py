"""Our GGUF reader against gguf.GGUFReader, dequantization per tensor type, and tiny GGUF models written the way
llama.cpp's converter does."""

from __future__ import annotations

import math
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from block_quants import quantize_blocks
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.formats.gguf_reader import GGUFFile, dequantize_tensor, open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.safetensors_reader import read_hf_config, read_safetensors
from dspark_grpc.runtime.models.transformer import Transformer
from runtime_helpers import forward_all, random_tokens
from tolerance import logits_tolerance

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
OUT, IN = 6, 512  # two 256-element super-blocks per row for the K-quants
QUANTIZABLE = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0]  # gguf.quants.quantize supports these
K_QUANTS = [Q.Q4_K, Q.Q6_K]


def _k_quant_bytes(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks [OUT, bytes] with sane f16 super-block scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(OUT * IN // block_size, type_size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # d (f16), dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
        blocks[:, 0:2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
        blocks[:, 2:4] = np.full((len(blocks), 1), 0.005, np.float16).view(np.uint8)
    else:  # Q6_K: 128 bytes low bits, 64 bytes high bits, 16 int8 scales, d (f16) last
        blocks[:, -2:] = np.full((len(blocks), 1), 0.002, np.float16).view(np.uint8)
    return blocks.reshape(OUT, -1)


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory) -> tuple[Path, dict[str, tuple[Q, np.ndarray, np.ndarray]]]:
    """A GGUF with one [OUT, IN] tensor per type: name -> (type, stored data, float source or None)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("gguf") / "quants.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    expected = {}
    for qtype in QUANTIZABLE + K_QUANTS:
        name = f"t_{qtype.name.lower()}.weight"
        source = rng.normal(0, 1, size=(OUT, IN)).astype(np.float32)
        data = gguf.quants.quantize(source, qtype) if qtype in QUANTIZABLE else _k_quant_bytes(qtype, rng)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
        expected[name] = (qtype, data, source if qtype in QUANTIZABLE else None)
    writer.add_tensor("t_i32.weight", np.arange(OUT * 8, dtype=np.int32).reshape(OUT, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


# -- our reader against gguf.GGUFReader --------------------------------------------------------------------


def _types(value: object) -> object:
    return [type(x) for x in value] if isinstance(value, list) else type(value)


def assert_reads_like_gguf(ours: GGUFFile, ref: gguf.GGUFReader) -> None:
    """Every key/value equal to ReaderField.contents() (types too), every tensor's name/type/shape/data equal."""
    expected = {key: field.contents() for key, field in ref.fields.items() if not key.startswith("GGUF.")}
    got = read_gguf_metadata(ours)
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key] == value and _types(got[key]) == _types(value), key
    assert (ours.alignment, ours.data_offset) == (ref.alignment, ref.data_offset)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert type(a.tensor_type) is type(b.tensor_type) and a.tensor_type == b.tensor_type, a.name
        assert a.shape.dtype == np.uint64 and a.shape.tolist() == b.shape.tolist(), a.name  # native, also big-endian
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data.tobytes() == b.data.tobytes() and not a.data.flags.writeable, a.name


def test_reader_matches_gguf_on_default_model(smollm2_path):
    t0 = time.perf_counter()
    ours = open_gguf(smollm2_path)
    read_gguf_metadata(ours)
    t1 = time.perf_counter()
    ref = gguf.GGUFReader(smollm2_path)
    {key: field.contents() for key, field in ref.fields.items()}
    t2 = time.perf_counter()
    print(f"open + metadata of {smollm2_path.name}: ours {t1 - t0:.3f} s, gguf.GGUFReader {t2 - t1:.3f} s")
    assert_reads_like_gguf(ours, ref)
    assert len(read_gguf_metadata(ours)["tokenizer.ggml.tokens"]) == 49152
    for tensor in ours.tensors[::25]:  # the real file's blocks (Q4_1, Q8_0, F32) decode as the gguf package's do
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        np.testing.assert_array_equal(dequantize_tensor(tensor).numpy(), reference.reshape(reference.shape))
    assert {Q(t.tensor_type) for t in ours.tensors[::25]} >= {Q.Q4_1, Q.F32}


_SCALARS = {
    V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768, V.UINT32: 2**32 - 1, V.INT32: -(2**31),
    V.UINT64: 2**64 - 1, V.INT64: -(2**63), V.FLOAT32: 0.1, V.FLOAT64: 0.1, V.BOOL: True,
}  # fmt: skip


def _write_every_type(path: Path, endianess: gguf.GGUFEndian) -> None:
    """Every value type as a scalar and as an array (strings incl. non-ASCII and empty, nested arrays), tensors of
    the element types in 1-3 dims, a block-quantized one, and alignment 64."""
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    w.add_custom_alignment(64)
    for vtype, value in _SCALARS.items():
        w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
        w.add_key_value(f"test.{vtype.name.lower()}s", [value, 0, value], V.ARRAY, sub_type=vtype)
    w.add_key_value("test.string", "h\u00e9llo \u2713 \u4e16\u754c", V.STRING)
    w.add_key_value("test.empty_string", "", V.STRING)
    w.add_key_value("test.strings", ["a", "", "\u00fcber", "\U0001f600" * 3], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY)
    w.add_key_value("test.nested_strings", [["x", "y"], ["z"]], V.ARRAY)
    rng = np.random.default_rng(1)
    for dtype in (np.float32, np.float16, np.float64, np.int8, np.int16, np.int32, np.int64):
        w.add_tensor(f"t.{np.dtype(dtype).name}", (rng.normal(0, 50, size=(3, 5, 7))).astype(dtype))
    w.add_tensor("t.vector", rng.normal(size=11).astype(np.float32))
    q8 = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("t.q8_0", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def every_type_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "every_type.gguf"
    _write_every_type(path, gguf.GGUFEndian.LITTLE)
    return path


def test_reader_matches_gguf_on_every_type(every_type_file):
    ours = open_gguf(every_type_file)
    assert_reads_like_gguf(ours, gguf.GGUFReader(every_type_file))
    meta = read_gguf_metadata(ours)
    assert meta["test.nested"] == [1, 2, 3] and meta["test.nested_strings"] == ["x", "y", "z"]  # flattened as gguf
    assert meta["test.bools"] == [True, False, True] and ours.alignment == 64 and ours.data_offset % 64 == 0


def test_reader_matches_gguf_on_big_endian_file(tmp_path):
    path = tmp_path / "big.gguf"
    _write_every_type(path, gguf.GGUFEndian.BIG)
    ours = open_gguf(path)
    assert_reads_like_gguf(ours, gguf.GGUFReader(path))
    assert read_gguf_metadata(ours)["test.uint32"] == 2**32 - 1 and ours.tensors[0].data.dtype == np.dtype(">f4")


def test_reader_reads_empty_arrays(tmp_path):
    """gguf's writer refuses empty arrays, so this file is written by hand."""

    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    def empty_array(key: str, item_type: gguf.GGUFValueType) -> bytes:
        return string(key) + struct.pack("<IIQ", V.ARRAY, item_type, 0)

    path = tmp_path / "empty_arrays.gguf"
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + empty_array("a.ints", V.INT32) + empty_array("a.strs", V.STRING)
    )
    ours = open_gguf(path)
    assert read_gguf_metadata(ours) == {"a.ints": [], "a.strs": []} and ours.tensors == []
    assert_reads_like_gguf(ours, gguf.GGUFReader(path))


def test_reader_matches_gguf_on_quant_file(quant_file):
    path, _ = quant_file
    assert_reads_like_gguf(open_gguf(path), gguf.GGUFReader(path))


def test_truncated_file_is_a_value_error(every_type_file, tmp_path):
    """Cut anywhere in the header (or in the first tensor's data): a ValueError naming the file, never another error."""
    raw = every_type_file.read_bytes()
    data_offset = open_gguf(every_type_file).data_offset
    path = tmp_path / "cut.gguf"
    for cut in range(data_offset + 2):
        path.write_bytes(raw[:cut])
        with pytest.raises(ValueError) as e:
            open_gguf(path)
        message = str(e.value)
        assert message.startswith(f"{path}: ") and ("truncated" in message if cut >= 4 else "GGUF" in message), cut


@pytest.mark.parametrize(
    ("offset", "patch", "message"),
    [(0, b"GGML", r"not a GGUF file \(magic b'GGML'"), (4, struct.pack("<I", 1), "version 1 is not supported")],
    ids=["magic", "version"],
)
def test_bad_header_is_a_value_error(every_type_file, tmp_path, offset, patch, message):
    raw = bytearray(every_type_file.read_bytes())
    raw[offset : offset + len(patch)] = patch
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=message):
        open_gguf(path)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_QUANTS, ids=lambda q: q.name)
def test_dequantize_matches_gguf(quant_file, qtype):
    path, expected = quant_file
    name = f"t_{qtype.name.lower()}.weight"
    (tensor,) = [t for t in open_gguf(path).tensors if t.name == name]
    assert tensor.tensor_type == qtype
    got = dequantize_tensor(tensor)
    _, data, source = expected[name]
    assert got.dtype == torch.float32 and got.shape == (OUT, IN)  # nn.Linear (out, in)
    reference = gguf.quants.dequantize(data, qtype).reshape(OUT, IN)
    np.testing.assert_array_equal(got.numpy(), reference)
    assert np.isfinite(reference).all() and reference.std() > 0
    if source is not None:  # and the round trip is close to the float data that was quantized
        rel = np.abs(got.numpy() - source).max() / np.abs(source).max()
        assert rel < {Q.Q4_0: 0.2, Q.Q4_1: 0.2, Q.Q8_0: 0.01}.get(qtype, 0.01)
    got.add_(1)  # writable, not a view of the read-only memory map


def test_unsupported_type_names_the_tensor(quant_file):
    path, _ = quant_file
    (tensor,) = [t for t in open_gguf(path).tensors if t.name == "t_i32.weight"]
    with pytest.raises(ValueError, match=r"t_i32\.weight.*I32"):
        dequantize_tensor(tensor)


# -- tiny models converted to GGUF as llama.cpp does -----------------------------------------------------

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute: rotate_half rows -> GGML interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp writes as rope_freqs.weight for rope_type llama3 (it has no GGUF scaling keys)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf_like_llama_cpp(hf_dir: Path, out: Path, arch: str, type_of=None) -> None:
    """`type_of`: (GGUF name, (out, in)) -> the type each matrix is quantized to (tests/runtime/block_quants.py), as
    llama.cpp's quantizer then writes the file; None keeps float32."""
    cfg = read_hf_config(hf_dir)
    tensors = {k: v.float().numpy() for k, v in read_safetensors(hf_dir).items()}
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    rope = cfg["rope_parameters"]
    w = gguf.GGUFWriter(out, arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))

    def add(name: str, value: np.ndarray, typed_as: str | None = None) -> None:
        if type_of is None or value.ndim != 2:
            return w.add_tensor(name, value)
        qtype = type_of(typed_as or name, value.shape)
        w.add_tensor(name, quantize_blocks(torch.from_numpy(value), qtype).data.numpy(), raw_dtype=qtype)

    tied = "lm_head.weight" not in tensors  # a tied embedding is the head: llama.cpp quantizes it as the output
    add("token_embd.weight", tensors.pop("model.embed_tokens.weight"), "output.weight" if tied else None)
    w.add_tensor("output_norm.weight", tensors.pop("model.norm.weight"))
    if "lm_head.weight" in tensors:
        add("output.weight", tensors.pop("lm_head.weight"))
    for name, value in tensors.items():
        _, _, layer, rest = name.split(".", 3)
        if arch == "llama" and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
            value = _llama_cpp_permute(value, n_head if "q_proj" in rest else n_kv)
        add(f"blk.{layer}.{_LAYER_NAMES[rest]}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["llama_yarn", "llama3", "qwen2", "qwen3"])
def test_tiny_gguf_equals_safetensors(tiny_hf_models, tmp_path, name):
    """The same weights as GGUF (llama Q/K permuted, qwen not) and as safetensors load to the same model."""
    arch = "llama" if name.startswith("llama") else name
    path = tmp_path / f"{name}.gguf"
    write_gguf_like_llama_cpp(tiny_hf_models[name], path, arch)
    from_gguf = load_checkpoint(path, progress=False)
    from_hf = load_checkpoint(tiny_hf_models[name], progress=False)
    if name == "llama3":  # GGUF keeps only per-frequency factors, not the llama3 parameters
        assert from_gguf.config.rope_freq_factors is not None and from_gguf.config.rope_scaling is None
        assert from_gguf.config.fingerprint() != from_hf.config.fingerprint()
    else:
        assert from_gguf.config.fingerprint() == from_hf.config.fingerprint()
        assert from_gguf.config.rope_scaling == from_hf.config.rope_scaling
    assert from_gguf.config.tie_word_embeddings == from_hf.config.tie_word_embeddings
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for key, value in from_hf.weights.items():
        torch.testing.assert_close(from_gguf.weights[key], value, atol=0, rtol=0, msg=key)
    tokens = random_tokens(24, seed=5)
    expected = forward_all(Transformer.from_checkpoint(from_hf), tokens).logits
    model = Transformer.from_checkpoint(from_gguf)
    got = forward_all(model, tokens).logits
    torch.testing.assert_close(got, expected, atol=logits_tolerance(model, len(tokens)), rtol=0)


def test_tiny_qwen2_gguf_matches_hf_gguf_loader(tiny_hf_models, tmp_path):
    """transformers reads qwen GGUF Q/K rows as they are (no un-permute), as we do.

    The llama un-permute is checked against transformers by the SmolLM2 tests. transformers 5.24 cannot
    check the others: it ignores qwen3.attention.key_length (head_dim != hidden/heads), rope_freqs and yarn.
    """
    from transformers import AutoModelForCausalLM

    path = tmp_path / "qwen2.gguf"
    write_gguf_like_llama_cpp(tiny_hf_models["qwen2"], path, "qwen2")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours = Transformer.from_checkpoint(load_checkpoint(path, progress=False))
    tokens = random_tokens(24, seed=6)
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(forward_all(ours, tokens).logits, expected, atol=logits_tolerance(ours, len(tokens)),
                               rtol=0)


@pytest.mark.parametrize("name", ["llama_yarn", "llama3", "qwen3"])
def test_reader_matches_gguf_on_tiny_models(tiny_hf_models, tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    write_gguf_like_llama_cpp(tiny_hf_models[name], path, "qwen3" if name == "qwen3" else "llama")
    assert_reads_like_gguf(open_gguf(path), gguf.GGUFReader(path))
