"""The fast precision's own CPU kernels, as torch ops (torch.ops.dspark.*):

- `gguf_matmul` (runtime/kernels/gguf_matmul.cpp): GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q4_K/Q5_K/Q6_K blocks multiplied
  as llama.cpp multiplies them. The weights keep the file's bits (0.58-1.06 bytes per weight, read once per step);
  each activation row is quantized to int8 per block of 32 (per 256 for K-quants, llama.cpp's Q8_K) and the block
  dots are exact integer sums. Another precision than torch's int4
  kernel (bf16 activations), within the fast precision's tolerance.
- `row_attention` (runtime/kernels/row_attention.cpp): the compiled step's attention, each row against its own slot's
keys.

Both compute every output row the same way whatever the other rows (batch invariance, by construction). They are
compiled once per machine with the system's g++ against torch's headers and kept beside the compiled step graphs;
`available()` is False, with the reason in `unavailable_reason()`, when they cannot be built or loaded (no compiler,
another CPU, or DSPARK_CPU_KERNELS=0): the fast precision then uses torch's int4 kernel and attention matmuls.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch
from dspark_grpc.runtime.progress import still_working
from dspark_grpc.speculation.cost_table import default_cache_dir

SOURCES = tuple(Path(__file__).with_name(name) for name in ("gguf_matmul.cpp", "row_attention.cpp"))
# attention's float sums may fuse a multiply and an add (one instruction sequence for every row all the same); the
# matmul's float steps stay as written (llama.cpp's arithmetic)
SOURCE_FLAGS = {"gguf_matmul.cpp": ("-ffp-contract=off",), "row_attention.cpp": ("-ffp-contract=fast",)}
# DSPARK_CPU_MARCH: the -march to build for (default native; x86-64-v3 builds the AVX2 path on an AVX-512 CPU)
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-shared", f"-march={os.environ.get('DSPARK_CPU_MARCH', 'native')}",
         "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-DNDEBUG")
ROWS = 16  # gguf_matmul's output rows side by side (runtime/kernels/quant.py: interleave_rows lays the weights out)


def _cpu_flags() -> str:
    """The CPU's instruction sets (the kernels are built for this CPU: -march=native)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in info.splitlines() if line.startswith("flags")), "")


def _library_path(cache_dir: Path) -> Path:
    h = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    for part in (torch.__version__, sys.version, " ".join(FLAGS), repr(SOURCE_FLAGS), _cpu_flags()):
        h.update(part.encode())
    return cache_dir / f"cpu_kernels-{h.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = library_paths()
    compile_flags = [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in include_paths()),
                     f"-I{sysconfig.get_paths()['include']}"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        print("[dspark] building the CPU kernels (once per machine)...", file=sys.stderr, flush=True)
        # one g++ per source, side by side (torch's headers are most of each one's time)
        builds = [subprocess.Popen(["g++", *compile_flags, *SOURCE_FLAGS[source.name], "-c", str(source), "-o",
                                    str(obj)], text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                  for source, obj in zip(SOURCES, objects, strict=True)]
        with still_working("building the CPU kernels", every_s=15.0):
            for build in builds:
                output, _ = build.communicate()
                if build.returncode:
                    raise subprocess.CalledProcessError(build.returncode, build.args, stderr=output)
        subprocess.run(["g++", *FLAGS, *(str(o) for o in objects), *(f"-L{p}" for p in lib_dirs),
                        *(f"-Wl,-rpath,{p}" for p in lib_dirs), "-lc10", "-ltorch_cpu", "-o", str(out)],
                       check=True, capture_output=True, text=True)
        os.replace(out, target)


_loading = threading.Lock()


@functools.cache
def _load() -> str | None:
    """Build (if needed) and load the kernels; the reason they are unavailable, or None."""
    with _loading:  # two threads' first calls: one loads, the other then finds the ops
        return _load_once()


def default_compile_cache() -> Path:
    """$DSPARK_COMPILE_CACHE, else ~/.cache/dspark-grpc/compiled: where the target and the engine bench keep the
    compiled steps (runtime/kernels/compiled_step.py) and this module its built library."""
    return default_cache_dir("compiled", "DSPARK_COMPILE_CACHE")


def _load_once() -> str | None:
    if os.environ.get("DSPARK_CPU_KERNELS", "1") == "0":
        return "turned off by DSPARK_CPU_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64") or torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return "the kernels need an x86 CPU with AVX2"
    if hasattr(torch.ops.dspark, "gguf_matmul"):
        return None
    path = _library_path(default_compile_cache())
    if not path.exists() and shutil.which("g++") is None:
        return "no g++ on PATH to build them"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:  # another process building it: wait for its library
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                _build(path)
        torch.ops.load_library(str(path))
        torch.library.register_fake("dspark::gguf_matmul")(_gguf_matmul_fake)
        torch.library.register_fake("dspark::row_attention")(_row_attention_fake)
    except subprocess.CalledProcessError as e:
        return f"g++ failed: {e.stderr.strip()[-2000:]}"
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


def unavailable_reason() -> str | None:
    return _load()


def available() -> bool:
    return _load() is None


def _gguf_matmul_fake(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None, qtype: int,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], codes.shape[0] * ROWS), dtype=out_dtype)


def gguf_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor | None, m: torch.Tensor | None, qtype: int,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] (float32 or bf16) @ W^T for W as runtime/kernels/quant.py's `interleave_rows` lays it out; [..., out]
    in `out_dtype` (default: x's dtype), out = 16 * codes.shape[0] (bias [out] float32 or None)."""
    return torch.ops.dspark.gguf_matmul(x, codes, d, m, qtype, bias, out_dtype or x.dtype)


def kernel_isa() -> str:
    """The instruction sets the built kernels use, e.g. "blocks avx512-vnni, bf16 avx512-bf16, attention avx512-bf16"
    (each is batch invariant on its own; they round differently), or why there are none."""
    reason = _load()
    return f"unavailable: {reason}" if reason else torch.ops.dspark.kernel_isa()


def _row_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
                        v_store: torch.Tensor, slots: torch.Tensor, write_rows: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                  slots: torch.Tensor, write_rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Writes k, v [R, KV, D] into one layer's K/V store [slots, KV, capacity, D] at (slots[r], write_rows[r]),
    then attends: q [R, H, D] bf16 against each row's slot's first C rows, mask [R, C] bool. Returns [R, H, D] bf16
    (runtime/kernels/row_attention.cpp)."""
    return torch.ops.dspark.row_attention(q, k, v, k_store, v_store, slots, write_rows, mask)
