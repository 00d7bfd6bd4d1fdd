"""GGUF blocks of every type runtime/kernels/gguf_matmul.cpp multiplies, made for the tests.

The gguf package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 as llama.cpp's reference quantizer does, but only
dequantizes the K-quants, so `quantize_blocks` writes Q4_K, Q5_K and Q6_K blocks itself, from the format
(ggml-common.h's block_q4_K / block_q5_K / block_q6_K, the gguf package's dequantize as the reader of record): a plain
min/max quantizer, not llama.cpp's search for the best scales (any valid blocks test the kernels; this one gives a
weight near the float it came from, which test_cpu_kernels.py checks through the package's dequantize):
  Q4_K / Q5_K (n = 15 / 31): per sub-block s of 32, step_s = (max(w, 0) - min(w, 0)) / n and offset_s = -min(w, 0);
    per super-block d = max step / 63, dmin = max offset / 63 (fp16), 6-bit sc_s = round(step_s / d),
    mn_s = round(offset_s / dmin), q = round((w + dmin mn_s) / (d sc_s)) in 0..n; bytes d, dmin, scales[12] (j < 4:
    sc_j and mn_j in the low 6 bits of bytes j and j + 4; j >= 4: the low nibbles of byte j + 4, sc's then mn's, the
    top 2 bits in the top bits of bytes j - 4 and j), Q5_K's qh[32] (bit s of byte l = bit 4 of element 32 s + l),
    qs[128] (byte 32 c + l: element 64 c + l low nibble, 64 c + 32 + l high);
  Q6_K: per sub-block of 16, step_s = max|w| / 31; d = max step / 127 (fp16), int8 sc_s = round(step_s / d),
    q = round(w / (d sc_s)) + 32 in 0..63; bytes ql[128] (per half of 128: byte l low/high nibble = element l / l + 64,
    byte 32 + l = element 32 + l / 96 + l), qh[64] (per half, bits 2k, 2k + 1 of byte l = bits 4, 5 of element
    32 k + l), scales[16], d.
`random_blocks` draws every byte (every code, scale and min value) but d and dmin; `extreme_blocks` sets every code to
its largest or smallest value and every scale and min to its largest (the largest integer sums the kernels form).
`wide_tiny_models` makes the tiny HF models 256 wide (their matrices can be K-quants), `llama_cpp_mix` picks each
matrix's type as llama.cpp's quantizer does for a Q4_K_M or Q5_K_M file, falling back to a block-of-32 type where a
row is not a multiple of 256, and `fast_block_model` loads a tiny model with its matrices as such blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.kernels.quant import K_TYPES, QuantBlocks
from dspark_grpc.runtime.models.transformer import Transformer

Q = gguf.GGMLQuantizationType
QK_K = 256


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _q4_k_or_q5_k(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    n, top = w.shape[0], 15 if qtype == Q.Q4_K else 31
    sub = w.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    step, offset = (hi - lo) / top, -lo
    d, dmin = (step.max(-1) / 63).astype(np.float16), (offset.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(step / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(offset / dminf), 0).clip(0, 63).astype(np.uint8)
        grid = (df * sc)[..., None]
        q = np.where(grid > 0, np.rint((sub + (dminf * mn)[..., None]) / grid), 0).clip(0, top).astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    chunks = q.reshape(n, 4, 2, 32)  # [64-element chunk, low/high nibble, l]
    qs = ((chunks[:, :, 0] & 0xF) | ((chunks[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    parts = [_fp16_bytes(d), _fp16_bytes(dmin), scales]
    if qtype == Q.Q5_K:
        parts.append(((q.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=-1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    n = w.shape[0]
    sub = w.reshape(n, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(step / df), 0).clip(-128, 127).astype(np.int8)
        grid = (df * sc)[..., None]
        q = (np.where(grid != 0, np.rint(sub / grid), 0) + 32).clip(0, 63).astype(np.uint8)
    halves = q.reshape(n, 2, 4, 32)  # [half, k, l]: element 128 half + 32 k + l
    ql = np.concatenate([(halves[:, :, 0] & 0xF) | (halves[:, :, 2] << 4),
                         (halves[:, :, 1] & 0xF) | (halves[:, :, 3] << 4)], axis=-1)  # [n, 2, 64]
    qh = ((halves >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(2).astype(np.uint8)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128) & 0xFF, qh.reshape(n, 64), sc.view(np.uint8), _fp16_bytes(d)], axis=-1)


def quantize_blocks(weight: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantBlocks:
    """A float [out, in] weight as `qtype` blocks (the module docstring says how)."""
    w = weight.detach().float().numpy()
    if qtype not in K_TYPES:
        data = gguf.quants.quantize(w, qtype)
    else:
        rows = w.reshape(-1, QK_K)
        raw = _q6_k(rows) if qtype == Q.Q6_K else _q4_k_or_q5_k(rows, qtype)
        data = raw.reshape(w.shape[0], -1)
    return QuantBlocks(qtype, torch.from_numpy(np.ascontiguousarray(data)), (int(w.shape[0]), int(w.shape[1])))


def _scale_offsets(qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
    """Where a block keeps its fp16 d (and dmin or m)."""
    return (208,) if qtype == Q.Q6_K else (0, 2) if qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K) else (0,)


def random_blocks(shape: tuple[int, int], qtype: gguf.GGMLQuantizationType, seed: int,
                  magnitude: float = 0.1) -> QuantBlocks:
    """Every byte drawn at random (all codes, scales, mins, Q6_K's negative scales) except d, dmin and m: positive,
    with the largest weights about `magnitude`."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out, inp = shape
    raw = rng.integers(0, 256, (out, inp // block, size), dtype=np.uint8)
    largest = {Q.Q4_K: 63 * 15, Q.Q5_K: 63 * 31, Q.Q6_K: 128 * 32, Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 128}.get(qtype, 31)
    for offset in _scale_offsets(qtype):
        d = rng.uniform(0.5, 1.0, (out, inp // block)) * magnitude / largest
        raw[..., offset : offset + 2] = _fp16_bytes(d).reshape(out, inp // block, 2)
    return QuantBlocks(qtype, torch.from_numpy(raw.reshape(out, -1)), shape)


def extreme_blocks(shape: tuple[int, int], qtype: gguf.GGMLQuantizationType, high: bool = True,
                   d: float = 1e-3) -> QuantBlocks:
    """Every code at its largest (`high`: 2^bits - 1) or smallest (0), every scale and min at its largest (6-bit 63;
    Q6_K's int8 127, or -128 with the smallest codes: q - 32 = -32), d = dmin = m = `d`: the integer sums of largest
    magnitude the kernels form."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out, inp = shape
    raw = np.full((out, inp // block, size), 0xFF if high else 0, np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):
        raw[..., 4:16] = 0xFF
    elif qtype == Q.Q6_K:
        raw[..., 192:208] = np.int8(127 if high else -128).view(np.uint8)
    for offset in _scale_offsets(qtype):
        raw[..., offset : offset + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    return QuantBlocks(qtype, torch.from_numpy(raw.reshape(out, -1)), shape)


# llama.cpp's quantizer (llama-quant.cpp): a Q4_K_M / Q5_K_M file keeps attn_v, ffn_down and the output at Q6_K (here
# in every layer; llama.cpp does so in some), the rest at Q4_K / Q5_K; a row that is not a multiple of 256 falls back
# to Q5_0 (for Q4_K), Q5_1 (for Q5_K) or Q8_0 (for Q6_K).
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def llama_cpp_mix(base: gguf.GGMLQuantizationType) -> Callable[[str, tuple[int, int]], gguf.GGMLQuantizationType]:
    """name, (out, in) -> the matrix's type in a file of `base` (Q4_K or Q5_K) as llama.cpp's _M mixes write it."""

    def qtype_of(name: str, shape: tuple[int, int]) -> gguf.GGMLQuantizationType:  # our names or GGUF's
        qtype = Q.Q6_K if name.endswith(("wv.weight", "w2.weight", "attn_v.weight", "ffn_down.weight",
                                         "output.weight")) else base
        return qtype if shape[1] % QK_K == 0 else _FALLBACK[qtype]

    return qtype_of


def wide_tiny_models(tiny_dirs: dict[str, Path], root: Path, names: tuple[str, ...] = ("llama3", "qwen3")
                     ) -> dict[str, Path]:
    """The tiny HF models of tests/conftest.py (tiny_hf_models) at hidden size 256, intermediate 512 and head_dim 64
    (every projection's input a multiple of 256), random as there: name -> directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = {}
    for i, name in enumerate(names):
        config = AutoConfig.from_pretrained(tiny_dirs[name])
        config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
        torch.manual_seed(2000 + i)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "norm" in pname:
                    param.uniform_(0.5, 1.5)
                elif pname.endswith(".bias"):
                    param.normal_(0, 0.5)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
    return dirs


def fast_block_model(directory: str | Path, qtype) -> Transformer:
    """A tiny random HF checkpoint with every projection quantized, loaded as the fast path. `qtype`: one type for all,
    or (name, shape) -> type for a mixed file (a tied embedding then gets the head's blocks too, as llama.cpp keeps
    token_embd as blocks and the loader keeps them: the lookup dequantizes its rows, the lm_head multiplies them)."""
    ckpt = load_checkpoint(directory, progress=False)
    type_of = qtype if callable(qtype) else (lambda name, shape: qtype)
    for name, w in list(ckpt.weights.items()):
        if w.ndim == 2 and name != "tok_embeddings.weight":
            ckpt.blocks[name] = quantize_blocks(w, type_of(name, tuple(w.shape)))
            ckpt.weights[name] = torch.empty(w.shape, device="meta")
    if callable(qtype) and ckpt.config.tie_word_embeddings:
        embedding = ckpt.weights["tok_embeddings.weight"]
        ckpt.head_blocks = quantize_blocks(embedding, type_of("output.weight", tuple(embedding.shape)))
        ckpt.blocks["tok_embeddings.weight"] = ckpt.head_blocks
        ckpt.weights["tok_embeddings.weight"] = torch.empty(embedding.shape, device="meta")
    return inference_model(ckpt, "fast")
