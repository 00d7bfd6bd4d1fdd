"""GGUF files: metadata as plain Python values, tensors dequantized to torch through the `gguf` package."""

from __future__ import annotations

import os
from typing import Any

import gguf


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
