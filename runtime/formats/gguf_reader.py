"""GGUF files: our own header parser over one memory map; tensors dequantized to torch through the `gguf` package.

The layout (v2/v3): magic "GGUF", version u32, tensor count u64, kv count u64, the key/values (key string, value
type u32, value), the tensor infos (name, n_dims u32, ne u64[n_dims], type u32, offset u64), then the tensor data
from the next multiple of `general.alignment` (default 32). Strings are u64 length + UTF-8 bytes. All integers are
little-endian unless the whole file is big-endian (its version then reads as 0 in the low 16 bits).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch
from dspark_grpc.runtime.kernels.quant import blocks_of, dequantize_blocks

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# struct format characters, which are also numpy's dtype characters for these types
_SCALAR_FORMATS = {
    V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
    V.UINT64: "Q", V.INT64: "q", V.FLOAT32: "f", V.FLOAT64: "d", V.BOOL: "?",
}  # fmt: skip
# tensor types the gguf package reads as elements; every other type is read as uint8 bytes per row
_ELEMENT_DTYPES = {Q.F32: "f4", Q.F16: "f2", Q.F64: "f8", Q.I8: "i1", Q.I16: "i2", Q.I32: "i4", Q.I64: "i8"}


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    """One tensor as gguf.GGUFReader gives it: shape uint64 in GGUF's ne order (innermost first); data a read-only
    view of the file, shaped reversed(ne) with the element dtype for F16/F32/F64/I*, else uint8 [..., row bytes]."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


@dataclass(frozen=True, eq=False)
class GGUFFile:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    alignment: int
    data_offset: int


class _Cursor:
    """Reads fields front to back from the mapped file, checking each read against the file's end."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.size, self.order, self.pos = buf, len(buf), order, 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise ValueError(f"truncated: {n} bytes needed at offset {self.pos}, the file has {self.size}")

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        s = struct.Struct(self.order + fmt)
        self.need(s.size)
        values = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return values

    def string(self) -> str:
        (n,) = self.unpack("Q")
        self.need(n)
        self.pos += n
        return str(self.buf[self.pos - n : self.pos], "utf-8")

    def strings(self, count: int) -> list[str]:
        buf, pos, size = self.buf, self.pos, self.size
        length = struct.Struct(self.order + "Q").unpack_from
        out = []
        for i in range(count):
            end = pos + 8
            if end <= size:
                end += length(buf, pos)[0]
            if end > size:
                raise ValueError(f"truncated: string {i} of {count} runs past the end of the file ({size} bytes)")
            out.append(str(buf[pos + 8 : end], "utf-8"))
            pos = end
        self.pos = pos
        return out

    def numbers(self, fmt: str, count: int) -> np.ndarray:
        dtype = np.dtype(self.order + fmt)
        self.need(count * dtype.itemsize)
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += count * dtype.itemsize
        return values


def _value_type(raw: int) -> gguf.GGUFValueType:
    try:
        return V(raw)
    except ValueError:
        raise ValueError(f"unknown value type {raw}") from None


def _read_array(cur: _Cursor) -> list[Any]:
    """An array's elements as a list; arrays of arrays flattened, as gguf's ReaderField.contents() does."""
    raw, count = cur.unpack("IQ")
    vtype = _value_type(raw)
    if vtype == V.STRING:
        return cur.strings(count)
    if vtype == V.ARRAY:
        return [x for _ in range(count) for x in _read_array(cur)]
    return cur.numbers(_SCALAR_FORMATS[vtype], count).tolist()


def _read_value(cur: _Cursor, vtype: gguf.GGUFValueType) -> Any:
    if vtype == V.STRING:
        return cur.string()
    if vtype == V.ARRAY:
        return _read_array(cur)
    return cur.unpack(_SCALAR_FORMATS[vtype])[0]


def _read_metadata(cur: _Cursor, count: int) -> tuple[dict[str, Any], dict[str, gguf.GGUFValueType]]:
    metadata: dict[str, Any] = {}
    types: dict[str, gguf.GGUFValueType] = {}
    for _ in range(count):
        key = cur.string()
        if key in metadata:
            raise ValueError(f"duplicate key {key!r}")
        types[key] = vtype = _value_type(cur.unpack("I")[0])
        try:
            metadata[key] = _read_value(cur, vtype)
        except ValueError as e:
            raise ValueError(f"key {key!r}: {e}") from e
    return metadata, types


def _read_tensor_infos(cur: _Cursor, count: int) -> list[tuple[str, np.ndarray, int, int]]:
    """(name, ne, raw type, offset from the data start) per tensor."""
    infos = []
    for _ in range(count):
        name = cur.string()
        (n_dims,) = cur.unpack("I")
        ne = cur.numbers("Q", n_dims).astype(np.uint64)
        raw_type, offset = cur.unpack("IQ")
        infos.append((name, ne, raw_type, offset))
    return infos


def _tensor(buf: mmap.mmap, order: str, name: str, ne: np.ndarray, raw_type: int, start: int) -> GGUFTensor:
    try:
        qtype = Q(raw_type)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
    n_elements = int(np.prod(ne))
    shape = tuple(reversed(ne.tolist()))
    if qtype in _ELEMENT_DTYPES:
        dtype, count = np.dtype(order + _ELEMENT_DTYPES[qtype]), n_elements
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if shape and shape[-1] % block_size:
            raise ValueError(
                f"tensor {name!r} ({qtype.name}): rows of {shape[-1]} are not whole blocks of {block_size}"
            )
        dtype, count = np.dtype(np.uint8), n_elements * type_size // block_size
        shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
    if start + count * dtype.itemsize > len(buf):
        raise ValueError(f"truncated: tensor {name!r} ends past the end of the file ({len(buf)} bytes)")
    data = np.frombuffer(buf, dtype, count, start).reshape(shape)
    return GGUFTensor(name, qtype, ne, data)


def _parse(buf: mmap.mmap, path: str) -> GGUFFile:
    if buf[:4] != b"GGUF":
        raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r}, expected b'GGUF')")
    cur = _Cursor(buf, "<")
    cur.pos = 4
    (version,) = cur.unpack("I")
    if version & 0xFFFF == 0:  # written for the other byte order
        cur.order, cur.pos = ">", 4
        (version,) = cur.unpack("I")
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (only {VERSIONS})")
    tensor_count, kv_count = cur.unpack("QQ")
    metadata, types = _read_metadata(cur, kv_count)
    infos = _read_tensor_infos(cur, tensor_count)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in types and types["general.alignment"] != V.UINT32:
        raise ValueError(f"general.alignment has type {types['general.alignment'].name}, expected UINT32")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, ne, raw_type, offset in infos:
        if name in names:
            raise ValueError(f"duplicate tensor {name!r}")
        names.add(name)
        tensors.append(_tensor(buf, cur.order, name, ne, raw_type, data_offset + offset))
    return GGUFFile(path, version, metadata, tensors, alignment, data_offset)


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """The file's header parsed; tensor data stays in the memory map until read. Bad files raise ValueError."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: empty file, not a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def read_gguf_metadata(reader: GGUFFile) -> dict[str, Any]:
    """All key/value fields: strings as str, scalars as int/float/bool, arrays as lists."""
    return dict(reader.metadata)


def dequantize_tensor(tensor: GGUFTensor) -> torch.Tensor:
    """One tensor as float32 in torch (nn.Linear) order: the reverse of GGUF's ne order, e.g. (out, in)."""
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    if (blocks := blocks_of(tensor)) is not None:  # Q4_0/Q4_1 matrices, the bulk of a 4-bit file: in torch
        return dequantize_blocks(blocks)
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as e:
        raise ValueError(f"tensor {tensor.name!r} has type {qtype.name}, which cannot be dequantized: {e}") from e
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if array.shape != shape:
        raise ValueError(f"tensor {tensor.name!r} ({qtype.name}) dequantized to {array.shape}, expected {shape}")
    if array.dtype != np.float32 or not array.flags.writeable:
        array = array.astype(np.float32)  # F32 tensors come back as read-only views of the memory map
    return torch.from_numpy(array)


def read_gguf_tensors(reader: GGUFFile) -> dict[str, torch.Tensor]:
    """Every tensor of the file by its GGUF name, dequantized to float32."""
    return {t.name: dequantize_tensor(t) for t in reader.tensors}
