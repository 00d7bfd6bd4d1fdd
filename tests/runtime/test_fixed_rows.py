"""runtime/models/fixed_rows.py: every call fn sees has exactly ROWS rows, and the rows come back as fn gives them for
each row alone (a CPU check of the chunking; tests/runtime/test_cuda.py checks the invariance it buys on a GPU)."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.models.fixed_rows import applies, by_fixed_rows
from tolerance import assert_within, matmul_error_bound


@pytest.mark.parametrize("lead", [(1,), (5,), (8,), (9,), (2, 7), (0,)], ids=str)
def test_chunks_of_fixed_rows_give_each_row_its_own_result(lead):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*lead, 6, generator=g), torch.randn(3, 6, generator=g)
    shapes = []

    def fn(rows: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(rows.shape))
        return rows @ w.T

    out = by_fixed_rows(fn, x, rows=4)
    assert out.shape == (*lead, 3)
    assert shapes and all(s == (4, 6) for s in shapes)
    flat = x.reshape(-1, 6)
    alone = [fn(torch.cat([r[None], r.new_zeros(3, 6)]))[0] for r in flat]  # each row as the first of a chunk
    if alone:  # the same 6-long dot products in two 4-row matmuls: each within gamma_6 |x| |w|^T
        assert_within(out.reshape(-1, 3), torch.stack(alone), 2 * matmul_error_bound(flat, w.T))


def test_only_cuda_inference_is_chunked():
    assert not applies(torch.ones(2, 3))
    assert not applies(torch.ones(2, 3, device="meta"))
