"""Files on disk, one way: durable atomic writes, and safetensors-style headers checked before anything is allocated.

Writes: a temp file in the target's folder, written, flushed, fsynced (`F_FULLFSYNC` on macOS, which plain fsync
does not reach past the drive's cache), `os.replace`d over the target, then the folder fsynced so the rename
itself survives a power cut. Any failure removes the temp file and leaves the previous file as it was. The os
calls go through a `FileSystem` passed in, so tests can fail or record each one without monkeypatching.

Headers (safetensors: an 8-byte little-endian length, a JSON object, then the tensors' bytes): the length is
bounded before it is read, every entry's dtype comes from one table, its shape times its dtype's size must equal
its byte span, spans may not overlap nor pass the data's end, and no size the file states is ever allocated.
A problem is a `HeaderError` carrying a `HeaderFault`; each caller turns that into its own sentence.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import stat
import struct
import sys
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

# safetensors dtype name -> torch dtype: every dtype any of our files may hold (callers narrow it).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
METADATA_KEY = "__metadata__"

# -- atomic writes -------------------------------------------------------------------------------------------------


class FileSystem:
    """The os calls a durable write makes. Subclass (in tests) to fail or record one of them."""

    def mkstemp(self, folder: Path, prefix: str, suffix: str) -> tuple[int, str]:
        return tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=folder)

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        # On macOS fsync only reaches the drive's cache; F_FULLFSYNC asks the drive to persist it.
        if sys.platform == "darwin":
            import fcntl

            try:
                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
                return
            except OSError:
                pass  # not supported by this file system: plain fsync below
        os.fsync(fd)

    def open(self, path: str | Path, flags: int) -> int:
        return os.open(path, flags)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str | Path, dst: str | Path) -> None:
        os.replace(src, dst)

    def rename(self, src: str | Path, dst: str | Path) -> None:
        os.rename(src, dst)

    def unlink(self, path: str | Path) -> None:
        os.unlink(path)


SYSTEM = FileSystem()


def _write_all(fs: FileSystem, fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[fs.write(fd, view) :]


def sync_file(path: str | Path, fs: FileSystem = SYSTEM) -> None:
    """fsync a file written by someone else (a compiler, a library) before it is renamed into place."""
    fd = fs.open(path, os.O_RDONLY)
    try:
        fs.fsync(fd)
    finally:
        fs.close(fd)


def sync_folder(folder: Path, fs: FileSystem = SYSTEM) -> None:
    """fsync a folder so a rename inside it is durable. Best effort: some platforms cannot open a folder and some
    file systems refuse to fsync one; the rename has happened either way."""
    try:
        fd = fs.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        fs.fsync(fd)
    except OSError:
        pass
    finally:
        fs.close(fd)


@contextmanager
def atomic_path(path: Path, *, prefix: str = ".tmp-", suffix: str = ".tmp", fs: FileSystem = SYSTEM) -> Iterator[Path]:
    """Yield an empty temp file beside `path` for the body to fill (by name: a compiler's output, a library's
    writer); when the body returns, fsync it, replace `path` with it and fsync the folder. If the body or any step
    raises, the temp file is removed and `path` is as it was. OSError propagates for the caller to word."""
    folder = path.parent
    fd, tmp = fs.mkstemp(folder, prefix, suffix)
    fs.close(fd)
    try:
        yield Path(tmp)
        sync_file(tmp, fs)
        fs.replace(tmp, path)
    except BaseException:
        _remove(tmp, fs)
        raise
    sync_folder(folder, fs)


def atomic_write(
    path: Path, chunks: Iterable[bytes], *, prefix: str = ".tmp-", suffix: str = ".tmp", fs: FileSystem = SYSTEM
) -> int:
    """Write `chunks` in order to `path`: old or new, never half. Returns the bytes written.
    OSError (full disk, no permission, missing folder) propagates for the caller to word; the previous file stays."""
    folder = path.parent
    fd, tmp = fs.mkstemp(folder, prefix, suffix)
    total = 0
    try:
        try:
            for chunk in chunks:
                _write_all(fs, fd, chunk)
                total += len(chunk)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        fs.replace(tmp, path)
    except BaseException:
        _remove(tmp, fs)
        raise
    sync_folder(folder, fs)
    return total


@contextmanager
def atomic_dir(final: Path, fs: FileSystem = SYSTEM) -> Iterator[Path]:
    """Yield a path (not yet created) for the body to build a folder at; on success every file in it is fsynced
    and it is renamed to `final`, on any error (or cancel) it is removed.

    The temp folder lives inside a hidden '.partial-*' folder next to `final` (same file system, so the rename is
    atomic), so a reader opening exactly `final` finds it absent, the old folder, or the complete new one. A folder
    cannot be replaced in one rename: the old one is first moved into the '.partial-*' folder, then deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".partial-{final.name}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        tmp = work / "bundle"
        yield tmp
        _sync_tree(tmp, fs)
        if final.exists():
            fs.rename(final, work / "replaced")
        fs.rename(tmp, final)
        sync_folder(final.parent, fs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sync_tree(root: Path, fs: FileSystem) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            p = Path(folder) / name
            if stat.S_ISREG(os.lstat(p).st_mode):
                sync_file(p, fs)
        sync_folder(Path(folder), fs)


def _remove(tmp: str | Path, fs: FileSystem) -> None:
    with contextlib.suppress(OSError):  # already renamed or never created: nothing left behind either way
        fs.unlink(tmp)


# -- safetensors-style headers -------------------------------------------------------------------------------------


class HeaderFault(Enum):
    """What is wrong with a header; each caller words it in its own sentence."""

    TRUNCATED = "shorter than the 8-byte length that starts it"
    HEADER_SIZE = "its length field claims more bytes than the limit or the file allows"
    UNREADABLE = "not a JSON object (or its metadata is not one of strings)"
    TOO_MANY = "lists more tensors than the limit"
    MALFORMED = "an entry lacks a dtype, shape or offsets, or has a size that is not a whole number in range"
    DTYPE = "an entry's dtype is not one this file may hold"
    SIZE = "an entry's byte span is not its shape times its dtype's size"
    PAST_END = "an entry's data lies past the end of the file"
    OVERLAP = "entries' data overlap, or (where the data must tile exactly) leave gaps"


class HeaderError(ValueError):
    def __init__(self, fault: HeaderFault, tensor: str | None = None, detail: str = "") -> None:
        super().__init__(
            f"{fault.value}"
            + (f" (tensor {tensor!r})" if tensor is not None else "")
            + (f": {detail}" if detail else "")
        )
        self.fault = fault
        self.tensor = tensor
        self.detail = detail


@dataclass(frozen=True)
class HeaderLimits:
    """What a caller accepts. `exact`: the tensors' data tile the bytes after the header exactly (no gap, nothing
    after), as safetensors itself requires; without it only overlaps and data past the end are refused."""

    max_header_bytes: int
    max_tensors: int = 65536
    max_rank: int = 8
    max_dim: int = 1 << 48  # any size or offset: beyond this it cannot describe a real file
    dtypes: frozenset[str] = frozenset(DTYPES)
    exact: bool = False


@dataclass(frozen=True)
class TensorSpan:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    start: int  # absolute byte offset from the start of the file (or buffer)
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorSpan]  # in the header's order
    metadata: dict[str, str] | None  # the "__metadata__" object, when present
    data_start: int  # 8 + the JSON's length


def header_length(first8: bytes, size: int, limits: HeaderLimits) -> int:
    """The JSON's length from the first 8 bytes of a file (or buffer) of `size` bytes, bounded before it is read."""
    if len(first8) < 8 or size < 8:
        raise HeaderError(HeaderFault.TRUNCATED)
    (n,) = struct.unpack_from("<Q", first8)
    if n > min(limits.max_header_bytes, size - 8):
        raise HeaderError(HeaderFault.HEADER_SIZE, detail=f"{n} bytes")
    return int(n)


def parse_header(raw: bytes, size: int, limits: HeaderLimits) -> Header:
    """Validate the header JSON `raw` (the bytes after the length) of a file (or buffer) of `size` bytes."""
    try:
        header = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise HeaderError(HeaderFault.UNREADABLE) from None
    if not isinstance(header, dict):
        raise HeaderError(HeaderFault.UNREADABLE)
    metadata = header.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise HeaderError(HeaderFault.UNREADABLE)
    if len(header) > limits.max_tensors:
        raise HeaderError(HeaderFault.TOO_MANY, detail=f"{len(header)} tensors, over the {limits.max_tensors} limit")
    base = 8 + len(raw)
    spans: dict[str, TensorSpan] = {}
    for name, entry in header.items():
        span = _entry(name, entry, limits)
        if base + span.end > size:
            raise HeaderError(HeaderFault.PAST_END, name, f"needs {base + span.end} bytes, the file has {size}")
        spans[name] = TensorSpan(name, span.dtype, span.shape, base + span.start, base + span.end)
    at = base
    for s in sorted(spans.values(), key=lambda s: (s.start, s.end)):
        if s.start < at or (limits.exact and s.start != at):
            raise HeaderError(HeaderFault.OVERLAP, s.name)
        at = max(at, s.end)
    if limits.exact and at != size:
        raise HeaderError(HeaderFault.OVERLAP, detail=f"{size - at} bytes after the last tensor")
    return Header(spans, metadata, base)


def _entry(name: str, entry: Any, limits: HeaderLimits) -> TensorSpan:
    try:
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        a, b = offsets
    except (KeyError, TypeError, ValueError):
        raise HeaderError(HeaderFault.MALFORMED, name) from None
    # Whole numbers only: a float, bool, string or negative size is a damaged (or hostile) header.
    if not (
        name
        and isinstance(dtype, str)
        and isinstance(shape, list)
        and len(shape) <= limits.max_rank
        and all(type(x) is int and 0 <= x < limits.max_dim for x in (*shape, a, b))
    ):
        raise HeaderError(HeaderFault.MALFORMED, name)
    if dtype not in DTYPES or dtype not in limits.dtypes:
        raise HeaderError(HeaderFault.DTYPE, name, dtype[:16])
    if a > b or b - a != math.prod(shape) * DTYPES[dtype].itemsize:
        raise HeaderError(HeaderFault.SIZE, name)
    return TensorSpan(name, dtype, tuple(shape), a, b)


def read_header(buf: bytes | memoryview | mmap.mmap, limits: HeaderLimits) -> Header:
    """The header of a safetensors image held in memory (bytes, a memoryview or an mmap's view)."""
    size = len(buf)
    n = header_length(bytes(buf[:8]), size, limits)
    return parse_header(bytes(buf[8 : 8 + n]), size, limits)


def read_header_file(path: Path, limits: HeaderLimits) -> Header:
    """The header of a safetensors file, reading only its header. OSError propagates for the caller to word."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, limits)
        raw = f.read(n)
    if len(raw) != n:
        raise HeaderError(HeaderFault.TRUNCATED)
    return parse_header(raw, size, limits)


def reject_constant(name: str) -> None:
    """For `json.loads(parse_constant=...)`: strict JSON, as every file here is read."""
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity, -Infinity: Python's parser accepts them by default
