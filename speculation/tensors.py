"""dspark.v1.Tensor, torch-free: raw little-endian row-major bytes with an explicit dtype and shape.

One home for the wire format: the sizes, the checks, the float32 values a planner reads and the leading rows a
cut keeps. serving/tensor_codec.py converts to and from torch on top of it."""

from __future__ import annotations

import math
import struct
import sys

from dspark_grpc.protos.dspark.v1 import common_pb2

ITEM_SIZE = {common_pb2.D_TYPE_FLOAT32: 4, common_pb2.D_TYPE_FLOAT16: 2, common_pb2.D_TYPE_BFLOAT16: 2,
             common_pb2.D_TYPE_INT32: 4, common_pb2.D_TYPE_INT64: 8, common_pb2.D_TYPE_UINT8: 1,
             common_pb2.D_TYPE_BOOL: 1}
MAX_DIMS = 8
MAX_EXTENT = 1 << 40  # product of the non-zero dimensions: even an empty tensor's shape must be a sane one
assert sys.byteorder == "little", "tensor bytes are little-endian on the wire"


def tensor_problem(msg: common_pb2.Tensor) -> str | None:
    """What is wrong with a tensor message (its dtype, shape or byte count), or None."""
    if msg.dtype not in ITEM_SIZE:
        return f"unsupported dtype {msg.dtype}; use one of {[common_pb2.DType.Name(d) for d in ITEM_SIZE]}"
    if any(d < 0 for d in msg.shape):
        return f"negative dimension in shape {list(msg.shape)}"
    if len(msg.shape) > MAX_DIMS or math.prod(max(d, 1) for d in msg.shape) > MAX_EXTENT:
        return f"shape {list(msg.shape)} is too large (at most {MAX_DIMS} dimensions, {MAX_EXTENT} elements)"
    expected = math.prod(msg.shape) * ITEM_SIZE[msg.dtype]
    if len(msg.data) != expected:
        dtype = common_pb2.DType.Name(msg.dtype)
        return f"{len(msg.data)} bytes but shape {list(msg.shape)} of {dtype} needs {expected}"
    return None


def float32_values(msg: common_pb2.Tensor) -> list[float]:
    """The values of a float32 tensor, flat (empty for an empty or malformed one)."""
    if msg.dtype != common_pb2.D_TYPE_FLOAT32 or tensor_problem(msg) is not None:
        return []
    return list(struct.unpack(f"<{len(msg.data) // 4}f", msg.data))


def float32_tensor(values: list[float]) -> common_pb2.Tensor:
    """A 1-d float32 tensor message."""
    return common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[len(values)],
                             data=struct.pack(f"<{len(values)}f", *values))


def first_rows(msg: common_pb2.Tensor, rows: int) -> common_pb2.Tensor:
    """The first `rows` rows (along the first dimension) of a tensor message."""
    assert msg.shape and 0 <= rows <= msg.shape[0], (list(msg.shape), rows)
    row_bytes = len(msg.data) // msg.shape[0] if msg.shape[0] else 0
    return common_pb2.Tensor(dtype=msg.dtype, shape=[rows, *msg.shape[1:]], data=msg.data[: rows * row_bytes])


def concat_rows(msgs: list[common_pb2.Tensor]) -> common_pb2.Tensor:
    """Tensor messages of one dtype and row shape, joined along the first dimension."""
    first = msgs[0]
    assert all(m.dtype == first.dtype and list(m.shape[1:]) == list(first.shape[1:]) for m in msgs)
    return common_pb2.Tensor(dtype=first.dtype, shape=[sum(m.shape[0] for m in msgs), *first.shape[1:]],
                             data=b"".join(m.data for m in msgs))
