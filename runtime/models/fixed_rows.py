"""Row-wise ops on a CUDA device run in chunks of one fixed row count, so that a row's result never depends on how
many rows ran beside it (a verify row equals its 1-row AR step bitwise, as on the CPU:
runtime/models/batch_invariant.py).

cuBLAS picks its GEMM kernel (tile, split-K) from the problem's shape, and a kernel with another reduction order
rounds a row differently: a 1-row step and a 5-row verify of the same row could disagree in their last bits, and
greedy speculation would then drift from greedy AR. Padding every call to chunks of ROWS rows makes every call the
same shape: one kernel, one reduction order per row, whatever the rest of the chunk holds. On a GPU a matmul of
ROWS rows costs about what one row costs (the weights' read dominates), so the padding is nearly free there; the
CPU paths never come here (their kernels are row-count invariant as they are).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

ROWS = 64
_off = 0  # > 0 inside `off()`


def applies(x: torch.Tensor) -> bool:
    """Inference on a CUDA device (training, which needs gradients, and the CPU run as they are), outside `off()`."""
    return x.device.type == "cuda" and not _off and not (torch.is_grad_enabled() and x.requires_grad)


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Row-wise ops as they are, whatever the device: for work whose rows need not equal a 1-row step's bitwise
    (a drafter's training data, written in large padded batches). Not for serving."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def by_fixed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """fn over x [..., d] row by row in effect: fn applied to [rows, d] chunks (the last one zero-padded), its rows
    put back as [..., d_out]. fn must treat rows independently (a matmul, a norm)."""
    lead, flat = x.shape[:-1], x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    padded = -(-max(n, 1) // rows) * rows
    if padded != n:
        flat = F.pad(flat, (0, 0, 0, padded - n))
    out = torch.cat([fn(chunk) for chunk in flat.split(rows)]) if padded > rows else fn(flat)
    assert out.shape[0] == padded, (out.shape, padded)
    return out[:n].view(*lead, out.shape[-1])
