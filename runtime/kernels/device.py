"""The device a service runs its model on (`--device auto|cpu|cuda[:N]`), and what falls back off the CPU.

The fast precision's GGUF block kernels (runtime/kernels/gguf_matmul.cpp) and the compiled step
(runtime/kernels/compiled_step.py)
are CPU-only: on another device the target runs the same precision on torch's matmuls, eagerly (no CUDA graphs yet),
its row-wise ops in fixed-size chunks (runtime/models/fixed_rows.py). The CUDA paths are written device-clean
(tests/runtime/test_device.py runs the forwards with the model on the meta device) and `make gpu-check` runs them on
a GPU (figures: docs/bench/gpu-check.md).
"""

from __future__ import annotations

import torch


class DeviceUnavailable(ValueError):
    """--device names a device this torch cannot use."""


def resolve_device(requested: str) -> torch.device:
    """"auto": cuda:0 where torch sees a CUDA device, else the CPU; "cuda[:N]" only where that device exists."""
    if requested == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
                 f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but finds no GPU or driver")
        raise DeviceUnavailable(f"--device {requested}: torch sees no CUDA device ({build}); use --device cpu or auto")
    index, count = device.index or 0, torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"--device {requested}: torch sees {count} CUDA device(s), cuda:0..cuda:{count - 1}")
    return torch.device("cuda", index)


def cpu_only_note(device: torch.device, precision: str, compile: str) -> str | None:
    """The one start-up line saying what runs otherwise on `device` than on the CPU (None on the CPU, or where
    nothing does)."""
    if device.type == "cpu":
        return None
    changed = []
    if precision == "fast":
        changed.append("precision fast runs its matrices dequantized to bf16 on torch's matmuls (the GGUF block "
                       "kernels are CPU-only)")
    if compile != "off":
        changed.append(f"compile {compile} is off (the compiled step is CPU-only)")
    if not changed:
        return None
    return f"{device}: {'; '.join(changed)}; eager (no CUDA graphs yet)"
