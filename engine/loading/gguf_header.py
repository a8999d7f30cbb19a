"""A GGUF file's header read under bounds, before the `gguf` package's reader or anything else allocates for it.

The `gguf` reader trusts the file: an array count of 2^40 makes it loop, a tensor offset near 2^64 wraps into the
header, an unaligned offset is read shifted. This reader walks the same layout (magic, version, counts, key/value
pairs, tensor infos) with every count, length and offset checked against the bytes that remain and against limits
far beyond any real model, and returns the metadata and tensor table, or raises one `ModelLoadError` sentence
naming the key or tensor at fault. It reads from a read-only mapping of the file; a value is only materialised once its
size has been checked against the file.

Layout (little-endian; GGUF v2/v3): "GGUF", u32 version, u64 tensor count, u64 key/value count; each pair a string
key, a u32 value type and the value (an array is a u32 item type, a u64 count and the items); each tensor a string
name, u32 n_dims, n_dims u64 dims (innermost first), u32 ggml type, u64 offset into the data section, which starts
at the next multiple of `general.alignment` (default 32) after the last tensor info.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Limits far beyond any real model (the largest vocabularies are ~260k tokens, merges ~300k, tensors ~3k).
MAX_TENSORS = 1 << 16
MAX_KEYS = 1 << 16
MAX_KEY_BYTES = 256  # real keys are under 64 bytes (the spec allows 65,535); a key is named in our sentences
MAX_NAME_BYTES = 256  # llama.cpp's own is 64
MAX_STRING_BYTES = 1 << 26
MAX_ARRAY_ITEMS = 1 << 22
MAX_ARRAY_DEPTH = 2
MAX_DIMS = 4
MAX_DIM = 1 << 32
MAX_ALIGNMENT = 1 << 20

# GGUF value types: (struct format, item size); 8 = string, 9 = array.
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY: dict[int, str] = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
STRING, ARRAY, BOOL = 8, 9, 7


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (contiguous) first
    ggml_type: int
    type_name: str
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # numbers as int/float/bool, strings as str, arrays as lists
    value_types: dict[str, tuple[int, ...]]  # key -> (GGUF value type,) or (ARRAY, item type)
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int  # absolute
    file_size: int


class _Bounded:
    """Reads from a file's bytes (a read-only mapping), refusing any read past its end before making it."""

    def __init__(self, data: mmap.mmap | bytes, name: str) -> None:
        self.data = data
        self.size = len(data)
        self.pos = 0
        self.name = name

    def left(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.left():
            raise ModelLoadError(f"{self.name} is truncated or corrupt: {what} runs past the end of the file.")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.data[self.pos : self.pos + n]
        self.pos += n
        return data

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> str:
        n = self.unpack("<Q", what)
        if n > limit:
            raise ModelLoadError(f"{self.name} is corrupt: {what} claims {n:,} bytes, over the {limit:,} limit.")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.name} is corrupt: {what} is not UTF-8 text.") from None


def _value(r: _Bounded, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype in _SCALARS:
        fmt, _ = _SCALARS[vtype]
        return r.unpack(fmt, f"the value of {key}")
    if vtype == STRING:
        return r.string(f"the value of {key}")
    if vtype != ARRAY:
        raise ModelLoadError(f"{r.name} is corrupt: {key} has an unknown value type {vtype}.")
    item_type = r.unpack("<I", f"the item type of {key}")
    count = r.unpack("<Q", f"the length of {key}")
    if count > MAX_ARRAY_ITEMS:
        raise ModelLoadError(f"{r.name} is corrupt: {key} claims {count:,} items, over the {MAX_ARRAY_ITEMS:,} limit.")
    if item_type in _NUMPY:
        size = _SCALARS[item_type][1]
        raw = r.take(count * size, f"the {count:,} items of {key}")  # checked against the bytes left first
        return np.frombuffer(raw, dtype=_NUMPY[item_type]).tolist()
    if item_type == BOOL:
        return [bool(b) for b in r.take(count, f"the {count:,} items of {key}")]
    if item_type == STRING:
        r.need(count * 8, f"the {count:,} items of {key}")  # each at least its 8-byte length
        return [r.string(f"item {i} of {key}") for i in range(count)]
    if item_type == ARRAY:
        if depth + 1 >= MAX_ARRAY_DEPTH:
            raise ModelLoadError(f"{r.name} is corrupt: {key} nests arrays deeper than any model's metadata.")
        r.need(count * 12, f"the {count:,} items of {key}")
        return [_value(r, ARRAY, f"item {i} of {key}", depth + 1) for i in range(count)]
    raise ModelLoadError(f"{r.name} is corrupt: {key} holds items of an unknown type {item_type}.")


def _type_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type id -> (name, weights per block, bytes per block), from the `gguf` package's table."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


def read_header(path: Path) -> GGUFHeader:
    """The header of the GGUF at `path`, every size checked against the file (one `ModelLoadError` sentence)."""
    name = Path(path).name
    try:
        with open(path, "rb") as f:
            if f.seek(0, 2) == 0:
                return _read(_Bounded(b"", name))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _read(_Bounded(data, name))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"{name} cannot be read ({getattr(exc, 'strerror', None) or exc.__class__.__name__})."
        ) from None


def _read(r: _Bounded) -> GGUFHeader:
    name = r.name
    magic = r.take(4, "the signature") if r.left() >= 4 else b""
    if magic != MAGIC:
        raise ModelLoadError(f"{name} is not a GGUF file (it does not start with GGUF's signature).")
    version = r.unpack("<I", "the version")
    if version not in VERSIONS:
        if struct.unpack(">I", struct.pack("<I", version))[0] in VERSIONS:
            raise ModelLoadError(f"{name} is a big-endian GGUF; MLoT Spark reads little-endian GGUF files.")
        raise ModelLoadError(f"{name} is GGUF version {version}; MLoT Spark reads versions 2 and 3.")
    n_tensors = r.unpack("<Q", "the tensor count")
    n_keys = r.unpack("<Q", "the metadata count")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > r.left():
        raise ModelLoadError(f"{name} is corrupt: it claims {n_tensors:,} tensors, more than the file can hold.")
    if n_keys > MAX_KEYS or n_keys * 13 > r.left():
        raise ModelLoadError(f"{name} is corrupt: it claims {n_keys:,} metadata keys, more than the file can hold.")

    metadata: dict[str, Any] = {}
    value_types: dict[str, tuple[int, ...]] = {}
    for i in range(n_keys):
        key = r.string(f"metadata key {i}", MAX_KEY_BYTES)
        if key in metadata:
            raise ModelLoadError(f"{name} is corrupt: the metadata key {key!r} appears twice.")
        vtype = r.unpack("<I", f"the type of {key}")
        start = r.pos
        metadata[key] = _value(r, vtype, key)
        value_types[key] = (vtype,)
        if vtype == ARRAY:
            value_types[key] = (vtype, struct.unpack_from("<I", r.data, start)[0])

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or not 1 <= alignment <= MAX_ALIGNMENT
        or alignment & (alignment - 1)
    ):
        raise ModelLoadError(f"{name} is corrupt: general.alignment is {str(alignment)[:40]}, not a power of two.")

    sizes = _type_sizes()
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        tname = r.string(f"the name of tensor {i}", MAX_NAME_BYTES)
        if tname in seen:
            raise ModelLoadError(f"{name} is corrupt: the tensor {tname!r} appears twice.")
        seen.add(tname)
        n_dims = r.unpack("<I", f"the rank of tensor {tname}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelLoadError(f"{name} is corrupt: tensor {tname} has {n_dims} dimensions.")
        dims = tuple(r.unpack("<Q", f"the shape of tensor {tname}") for _ in range(n_dims))
        if any(not 1 <= d <= MAX_DIM for d in dims):
            raise ModelLoadError(f"{name} is corrupt: tensor {tname} has the shape {list(dims)}.")
        ggml_type = r.unpack("<I", f"the type of tensor {tname}")
        offset = r.unpack("<Q", f"the offset of tensor {tname}")
        infos.append((tname, dims, ggml_type, offset))

    data_offset = -(-r.pos // alignment) * alignment
    if data_offset > r.size:
        raise ModelLoadError(f"{name} is truncated: its tensor data is missing.")
    data_size = r.size - data_offset
    tensors: list[TensorInfo] = []
    for tname, dims, ggml_type, offset in infos:
        if ggml_type not in sizes:
            raise ModelLoadError(f"{name} is corrupt: tensor {tname} has an unknown type {ggml_type}.")
        type_name, block, block_bytes = sizes[ggml_type]
        if dims[0] % block:
            raise ModelLoadError(
                f"{name} is corrupt: tensor {tname} has rows of {dims[0]} values, not whole {type_name} blocks of {block}."
            )
        nbytes = math.prod(dims) // block * block_bytes  # Python integers: no overflow
        if offset % alignment:
            raise ModelLoadError(
                f"{name} is corrupt: tensor {tname} starts at offset {offset}, not a multiple of the alignment {alignment}."
            )
        if offset + nbytes > data_size:
            raise ModelLoadError(
                f"{name} is truncated or corrupt: tensor {tname} ({nbytes:,} bytes at offset {offset:,}) runs past the end of the file."
            )
        tensors.append(TensorInfo(tname, dims, ggml_type, type_name, offset, nbytes))
    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in itertools.pairwise(ordered):
        if a.offset + a.nbytes > b.offset:
            raise ModelLoadError(f"{name} is corrupt: tensors {a.name} and {b.name} overlap.")
    return GGUFHeader(version, metadata, value_types, tuple(tensors), alignment, data_offset, r.size)


def tensor_view(mapping: np.ndarray, header: GGUFHeader, t: TensorInfo) -> np.ndarray:
    """The tensor's bytes in `mapping` (the whole file as uint8), as the `gguf` reader shapes them: F32/F16 as
    their dtype in torch order, every other type as (rows..., bytes per row) uint8."""
    start = header.data_offset + t.offset
    raw = mapping[start : start + t.nbytes]
    shape = tuple(reversed(t.dims))
    if t.type_name == "F32":
        return raw.view(np.float32).reshape(shape)
    if t.type_name == "F16":
        return raw.view(np.float16).reshape(shape)
    return raw.reshape(*shape[:-1], t.nbytes // max(1, math.prod(shape[:-1])))
