"""What a measurement ran on, recorded beside its figures: the code's commit and the machine (CPU model, widest
vector extension, count)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def git_commit() -> str | None:
    """The short commit of the checkout this code runs from ("-dirty" added when tracked files differ from it);
    None for an installed copy or without git."""
    root = Path(__file__).resolve().parents[1]  # bench/ sits in the repository root
    try:
        top, commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "--short", "HEAD"],
                                     capture_output=True, text=True, timeout=10, check=True).stdout.split()
        if Path(top).resolve() != root:  # an installed copy inside some other repository
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "")


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "machine": platform.machine(), "processor": platform.processor(), **_cpu_model()}


def _cpu_model() -> dict:
    """The CPU's model name and its widest vector extension (AVX-512 or not changes the kernels and the speed)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return {}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    vector = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"cpu_model": name, "cpu_vector": vector}
