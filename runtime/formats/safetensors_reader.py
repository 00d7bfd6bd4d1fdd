"""HF checkpoint directories: config.json plus model.safetensors or a sharded model.safetensors.index.json."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_hf_dir(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    with open(Path(path) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(path: str | os.PathLike[str]) -> list[Path]:
    """The weight files of an HF directory, in a fixed order."""
    p = Path(path)
    if (p / INDEX_FILE).is_file():
        with open(p / INDEX_FILE, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{p / INDEX_FILE} names shards that are missing: {missing}")
        return [p / s for s in shards]
    if (p / SINGLE_FILE).is_file():
        return [p / SINGLE_FILE]
    raise FileNotFoundError(f"{p} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory by its HF name, in its stored dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        for name, tensor in load_file(file).items():
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {path}")
            tensors[name] = tensor
    return tensors
