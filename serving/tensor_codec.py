"""dspark.v1.Tensor <-> torch, on the wire format of speculation/tensors.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.speculation.errors import InvalidArgument
from dspark_grpc.speculation.tensors import tensor_problem

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


def proto_dtype(dtype: torch.dtype) -> int:
    return _PROTO_DTYPE[dtype]


def to_proto(t: torch.Tensor) -> common_pb2.Tensor:
    return rows_to_proto([t])


def rows_to_proto(parts: Sequence[torch.Tensor]) -> common_pb2.Tensor:
    """Tensors of one dtype and row shape as one message, joined along the first dimension (their bytes joined: no
    torch.cat, whose parallel copy would give the calling request thread an OpenMP team of its own)."""
    first = parts[0]
    assert all(p.dtype == first.dtype and p.shape[1:] == first.shape[1:] for p in parts)
    data = b"".join(_raw_bytes(p) for p in parts)
    shape = [sum(p.shape[0] for p in parts), *first.shape[1:]] if first.dim() else []
    return common_pb2.Tensor(dtype=_PROTO_DTYPE[first.dtype], shape=shape, data=data)


def _raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def from_proto(msg: common_pb2.Tensor, what: str = "tensor") -> torch.Tensor:
    """Decode and validate; any inconsistency is an InvalidArgument naming `what`."""
    problem = tensor_problem(msg)
    if problem is not None:
        raise InvalidArgument(f"{what}: {problem}")
    dtype = _TORCH_DTYPE[msg.dtype]
    if not msg.data:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(msg.shape))
