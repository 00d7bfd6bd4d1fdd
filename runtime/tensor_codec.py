"""dspark.v1.Tensor <-> torch: raw little-endian row-major bytes with an explicit dtype and shape."""

from __future__ import annotations

import math
import sys

import torch
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.runtime.errors import InvalidArgument

_TORCH_DTYPE = {
    common_pb2.D_TYPE_FLOAT32: torch.float32,
    common_pb2.D_TYPE_FLOAT16: torch.float16,
    common_pb2.D_TYPE_BFLOAT16: torch.bfloat16,
    common_pb2.D_TYPE_INT32: torch.int32,
    common_pb2.D_TYPE_INT64: torch.int64,
    common_pb2.D_TYPE_UINT8: torch.uint8,
    common_pb2.D_TYPE_BOOL: torch.bool,
}
_PROTO_DTYPE = {v: k for k, v in _TORCH_DTYPE.items()}
MAX_DIMS = 8
MAX_EXTENT = 1 << 40  # product of the non-zero dimensions: even an empty tensor's shape must be a sane one
assert sys.byteorder == "little", "tensor bytes are little-endian on the wire"


def proto_dtype(dtype: torch.dtype) -> int:
    return _PROTO_DTYPE[dtype]


def to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    t = t.detach().to("cpu").contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return common_pb2.Tensor(dtype=_PROTO_DTYPE[t.dtype], shape=list(t.shape), data=data)


def from_proto(msg: common_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Decode and validate; any inconsistency is an InvalidArgument naming `what`."""
    if msg.dtype not in _TORCH_DTYPE:
        raise InvalidArgument(f"{what}: unsupported dtype {msg.dtype}; use one of "
                              f"{[common_pb2.DType.Name(d) for d in _TORCH_DTYPE]}")
    if any(d < 0 for d in msg.shape):
        raise InvalidArgument(f"{what}: negative dimension in shape {list(msg.shape)}")
    if len(msg.shape) > MAX_DIMS or math.prod(max(d, 1) for d in msg.shape) > MAX_EXTENT:
        raise InvalidArgument(f"{what}: shape {list(msg.shape)} is too large (at most {MAX_DIMS} dimensions, "
                              f"{MAX_EXTENT} elements)")
    dtype = _TORCH_DTYPE[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(msg.shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(f"{what}: {len(msg.data)} bytes but shape {list(msg.shape)} of "
                              f"{common_pb2.DType.Name(msg.dtype)} needs {expected}")
    if expected == 0:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(msg.shape))
