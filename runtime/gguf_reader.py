"""GGUF files: metadata as plain Python values, tensors dequantized to torch through the `gguf` package."""

from __future__ import annotations

import os
from typing import Any

import gguf
import numpy as np
import torch
from gguf.gguf_reader import ReaderTensor


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    return gguf.GGUFReader(os.fspath(path))


def read_gguf_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """All key/value fields: strings as str, scalars as int/float/bool, arrays as lists."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """One tensor as float32 in torch (nn.Linear) order: the reverse of GGUF's ne order, e.g. (out, in)."""
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantized: {e}") from e
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if array.shape != shape:
        raise ValueError(f"tensor {tensor.name!r} ({qtype.name}) dequantized to {array.shape}, expected {shape}")
    if array.dtype != np.float32 or not array.flags.writeable:
        array = array.astype(np.float32)  # F32 tensors come back as read-only views of the memory map
    return torch.from_numpy(array)


def read_gguf_tensors(reader: gguf.GGUFReader) -> dict[str, torch.Tensor]:
    """Every tensor of the file by its GGUF name, dequantized to float32."""
    return {t.name: dequantize_tensor(t) for t in reader.tensors}
