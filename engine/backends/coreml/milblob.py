"""Reading values out of an ML Program: the weight blob file and immediate (inline) tensor values.

weights/weight.bin (coremltools' MIL blob storage, version 2), little-endian:
    file header, 64 bytes:  u32 count, u32 version (=2), 56 reserved bytes
    per blob, at the offset a const's `blobFileValue` names, a 64-byte metadata record:
        u32 sentinel 0xDEADBEEF, u32 data type, u64 size in bytes, u64 data offset (absolute, 64-byte aligned),
        u64 padding in bits (sub-byte types), 32 reserved bytes
Sub-byte types (int4, uint1..uint6) are bit-packed, element 0 in the lowest bits of the first byte.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np
from coremltools.proto import MIL_pb2

from engine.backends.coreml.errors import PackageError

BLOB_SENTINEL = 0xDEADBEEF
BLOB_VERSION = 2
# blob storage data-type codes -> MIL DataType names (coremltools BlobDataType)
BLOB_DTYPES: dict[int, str] = {
    1: "FLOAT16",
    2: "FLOAT32",
    3: "UINT8",
    4: "INT8",
    5: "BFLOAT16",
    6: "INT16",
    7: "UINT16",
    8: "INT4",
    9: "UINT1",
    10: "UINT2",
    11: "UINT4",
    12: "UINT3",
    13: "UINT6",
    14: "INT32",
    15: "UINT32",
}
NUMPY_DTYPES: dict[str, np.dtype] = {
    "FLOAT16": np.dtype(np.float16),
    "FLOAT32": np.dtype(np.float32),
    "FLOAT64": np.dtype(np.float64),
    "INT8": np.dtype(np.int8),
    "UINT8": np.dtype(np.uint8),
    "INT16": np.dtype(np.int16),
    "UINT16": np.dtype(np.uint16),
    "INT32": np.dtype(np.int32),
    "UINT32": np.dtype(np.uint32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(bool),
}
SUB_BYTE_BITS: dict[str, tuple[int, bool]] = {  # name -> (bits, signed)
    "INT4": (4, True),
    "UINT4": (4, False),
    "UINT1": (1, False),
    "UINT2": (2, False),
    "UINT3": (3, False),
    "UINT6": (6, False),
}


def dtype_name(code: int) -> str:
    return str(MIL_pb2.DataType.Name(code))


def unpack_bits(raw: bytes | np.ndarray, bits: int, signed: bool, count: int) -> np.ndarray:
    """Bit-packed little-endian integers -> int8/uint8 array of `count` elements."""
    b = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), bitorder="little")[: count * bits]
    if b.size < count * bits:
        raise PackageError(
            f"A {bits}-bit weight holds {b.size} bits, fewer than its {count} elements need; the package is corrupt."
        )
    vals: np.ndarray = (b.reshape(count, bits).astype(np.uint8) << np.arange(bits, dtype=np.uint8)).sum(
        axis=1, dtype=np.uint8
    )
    if signed:
        return np.where(vals >= 1 << (bits - 1), vals.astype(np.int16) - (1 << bits), vals).astype(np.int8)
    return vals


class BlobFile:
    """A memory-mapped weight.bin; `read(offset, dtype, shape)` returns a copy of one blob as numpy."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise PackageError(f"Cannot read the weight file {path.name} ({exc}); the package is incomplete.") from None
        if len(self._mm) < 64:
            raise PackageError(f"The weight file {path.name} is truncated; the package is incomplete.")
        count, version = struct.unpack_from("<II", self._mm, 0)
        if version != BLOB_VERSION:
            raise PackageError(
                f"The weight file {path.name} has storage version {version}; only version {BLOB_VERSION} is understood."
            )
        self.count = count

    def read(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        raw = self.raw(offset, dtype)
        n = int(np.prod(shape, dtype=np.int64))
        if dtype in SUB_BYTE_BITS:
            bits, signed = SUB_BYTE_BITS[dtype]
            return unpack_bits(raw, bits, signed, n).reshape(shape)
        if raw.size != n:
            raise PackageError(
                f"A weight in {self.path.name} holds {raw.size} values, not the {n} its shape {shape} needs."
            )
        return raw.reshape(shape).copy()

    def raw(self, offset: int, dtype: str) -> np.ndarray:
        """One blob's data as a read-only view of the mapped file (no copy): typed values, or the packed bytes
        (uint8) of a sub-byte type."""
        if offset + 64 > len(self._mm):
            raise PackageError(f"A weight points past the end of {self.path.name}; the package is corrupt.")
        sentinel, code, size, data_offset, _pad_bits = struct.unpack_from("<IIQQQ", self._mm, offset)
        if sentinel != BLOB_SENTINEL:
            raise PackageError(f"No weight record at offset {offset} of {self.path.name}; the package is corrupt.")
        stored = BLOB_DTYPES.get(code)
        if stored is None:
            raise PackageError(f"A weight in {self.path.name} has unknown storage type {code}.")
        if data_offset + size > len(self._mm):
            raise PackageError(f"A weight's data runs past the end of {self.path.name}; the package is corrupt.")
        # The program declares e.g. BOOL/INT4 where the blob may store the same bits under a sibling code.
        if stored != dtype and not (
            dtype in SUB_BYTE_BITS and stored in SUB_BYTE_BITS and SUB_BYTE_BITS[dtype][0] == SUB_BYTE_BITS[stored][0]
        ):
            raise PackageError(f"A weight in {self.path.name} is stored as {stored} but the program declares {dtype}.")
        if dtype in SUB_BYTE_BITS:
            return np.frombuffer(self._mm, dtype=np.uint8, count=size, offset=data_offset)
        if dtype not in NUMPY_DTYPES:
            raise PackageError(f"A weight in {self.path.name} has type {dtype}, which the interpreter does not read.")
        item = NUMPY_DTYPES[dtype].itemsize
        if size % item:
            raise PackageError(f"A weight in {self.path.name} has a size that is not a whole number of {dtype} values.")
        return np.frombuffer(self._mm, dtype=NUMPY_DTYPES[dtype], count=size // item, offset=data_offset)


def tensor_shape(tt: MIL_pb2.TensorType) -> tuple[int, ...]:
    """Static shape of a TensorType; a flexible (unknown) dimension is refused."""
    dims = []
    for d in tt.dimensions:
        if d.WhichOneof("dimension") != "constant":
            raise PackageError("The program has a flexible tensor shape; MLoT Spark packages are fully static.")
        dims.append(int(d.constant.size))
    return tuple(dims)


def immediate_value(tt: MIL_pb2.TensorType, tv: MIL_pb2.TensorValue) -> np.ndarray:
    """Decode an inline TensorValue of type `tt`."""
    name = dtype_name(tt.dataType)
    shape = tensor_shape(tt)
    n = int(np.prod(shape, dtype=np.int64))
    field = tv.WhichOneof("value")
    if field == "bytes":
        raw = tv.bytes.values
        if name in SUB_BYTE_BITS:
            bits, signed = SUB_BYTE_BITS[name]
            return unpack_bits(raw, bits, signed, n).reshape(shape)
        return np.frombuffer(raw, dtype=NUMPY_DTYPES[name]).reshape(shape).copy()
    if field == "strings":
        return np.array(list(tv.strings.values), dtype=object).reshape(shape)
    values = {
        "floats": lambda: tv.floats.values,
        "ints": lambda: tv.ints.values,
        "bools": lambda: tv.bools.values,
        "longInts": lambda: tv.longInts.values,
        "doubles": lambda: tv.doubles.values,
    }.get(field or "")
    if values is None:
        raise PackageError(f"An inline value of type {name} has no data; the program is malformed.")
    if name not in NUMPY_DTYPES:
        raise PackageError(f"An inline value has type {name}, which the interpreter does not read.")
    return np.array(list(values()), dtype=NUMPY_DTYPES[name]).reshape(shape)
