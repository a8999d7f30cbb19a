"""The `.spark` container: a checksummed preamble, JSON metadata and a (compressed) safetensors section.

Layout of format v2 (all integers little-endian):

    offset  size  field
    0       6     magic b"SPARK\\x00"
    6       2     format version (u16)
    8       2     flags (u16): bits 0-7 the tensor section's codec, 0 none | 1 zlib | 2 lzma; bit 8 the
                  decompressed bytes are byte planes (see `shuffle`); other bits 0
    10      2     reserved, 0
    12      8     M, metadata length (u64)
    20      8     T, tensor section length as stored (u64)
    28      8     R, tensor section length once decompressed (u64; == T when not compressed)
    36      32    SHA-256 over bytes [0, 36) + metadata + tensor section
    68      M     metadata: one UTF-8 JSON object (engine.session.schema checks its fields)
    68+M    T     tensors: safetensors bytes (possibly compressed); never pickle

Older layouts stay readable: each has a preamble reader (`PREAMBLES`); engine.session.file migrates their metadata.

- v1: 56-byte preamble (magic, version, M, T, SHA-256 over metadata + tensors), no compression.
- v2: the layout above.

Compression pays for real KV once the fp16 bytes are split into planes (low bytes, then high bytes: sign and
exponent repeat a lot). Measured per 1k tokens (FullAttentionMemory, CPU): a small trained checkpoint (6 layers,
3 KB/token) 3.10 MB raw, 2.07 MB shuffled zlib level 1 (plain zlib would be 2.53); random SmolLM-135M-shaped
weights 23.07 MB raw, 19.51 MB shuffled zlib. So writers shuffle + zlib by default.

Reading checks, in this order, before anything is parsed: a non-empty regular file, the magic, a version this
build knows, lengths within limits and adding up to the file's size, and the SHA-256. The tensor table is then
validated against its section (engine.fileio) before safetensors decodes it. Every failure is one
`SessionFileError` sentence.
"""

from __future__ import annotations

import hashlib
import hmac
import lzma
import stat
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from engine.errors import SessionFileError
from engine.fileio import (
    HeaderError,
    HeaderFault,
    HeaderLimits,
    TensorSpan,
    read_header,
)

MAGIC = b"SPARK\x00"
FORMAT_VERSION = 2
SESSION_SUFFIX = ".spark"

# Limits: a file may be large (KV), but no header field may make the reader allocate more than the file holds.
MAX_FILE_BYTES = 16 * 1024**3  # read whole into memory: far above any cascade's working + episodic budget
MAX_META_BYTES = 64 * 1024 * 1024  # ~1M token ids + transcript + sampler state fit with room to spare
MAX_TENSORS = 4096
MAX_TENSOR_HEADER_BYTES = 16 * 1024 * 1024
_READ_CHUNK = 1 << 20
MAX_COMPRESSION_RATIO = 64  # writers store uncompressed above this, so a higher claim is a corrupt (or hostile) file
MIN_COMPRESSION_SAVING = 0.05

# What a memory's state may hold (KV is canonical fp16): every dtype of the one table, tiling the section exactly.
TENSOR_LIMITS = HeaderLimits(MAX_TENSOR_HEADER_BYTES, max_tensors=MAX_TENSORS, max_dim=2**40, exact=True)

_V2_PREAMBLE = struct.Struct("<6sHHHQQQ32s")  # 68 bytes
_V2_HASHED = struct.Struct("<6sHHHQQQ")  # its first 36 bytes: what the digest covers with the rest of the file
_V1_PREAMBLE = struct.Struct("<6sHQQ32s")  # 56 bytes
COMPRESSION_FLAGS: dict[str, int] = {"none": 0, "zlib": 1, "lzma": 2}
_COMPRESSION_NAMES = {v: k for k, v in COMPRESSION_FLAGS.items()}
_SHUFFLED = 0x100


@dataclass(frozen=True)
class Preamble:
    version: int
    compression: str
    shuffled: bool
    meta_len: int
    tensor_len: int
    raw_tensor_len: int
    digest: bytes
    size: int  # bytes of preamble
    hashed: bytes  # the preamble bytes the digest covers (none in v1)


def bad(path: Path, what: str) -> SessionFileError:
    return SessionFileError(f"The session file {path.name} {what}; nothing was restored.")


# -- reading -------------------------------------------------------------------------------------------------------


def _read_preamble_v1(path: Path, head: bytes) -> Preamble:
    _, version, meta_len, tensor_len, digest = _V1_PREAMBLE.unpack_from(head)
    return Preamble(version, "none", False, meta_len, tensor_len, tensor_len, digest, _V1_PREAMBLE.size, b"")


def _read_preamble_v2(path: Path, head: bytes) -> Preamble:
    _, version, flags, reserved, meta_len, tensor_len, raw_len, digest = _V2_PREAMBLE.unpack_from(head)
    codec, shuffled = flags & 0xFF, bool(flags & _SHUFFLED)
    if codec not in _COMPRESSION_NAMES or flags & ~(0xFF | _SHUFFLED) or (shuffled and not codec):
        raise bad(path, f"uses an unknown compression (flags 0x{flags:04x}), so its header is corrupt")
    if reserved:
        raise bad(path, "has a corrupt header (a reserved field is set)")
    return Preamble(
        version,
        _COMPRESSION_NAMES[codec],
        shuffled,
        meta_len,
        tensor_len,
        raw_len,
        digest,
        _V2_PREAMBLE.size,
        head[:36],
    )


PREAMBLES: dict[int, tuple[int, Callable[[Path, bytes], Preamble]]] = {
    1: (_V1_PREAMBLE.size, _read_preamble_v1),
    2: (_V2_PREAMBLE.size, _read_preamble_v2),
}


def read_layout(f: BinaryIO, path: Path, size: int) -> Preamble:
    """The preamble of the open file `f` (of `size` bytes), with every check before the SHA-256: the magic, a known
    version, lengths within limits and adding up to the file's size. Raises SessionFileError; OSError propagates."""
    f.seek(0)
    head = f.read(max(n for n, _ in PREAMBLES.values()))
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise SessionFileError(
            f"{path.name} is not an MLoT Spark session file (it does not start with the {SESSION_SUFFIX} signature)."
        )
    if len(head) < 8:
        raise bad(path, f"is truncated ({size} bytes)")
    (version,) = struct.unpack_from("<H", head, 6)
    if version not in PREAMBLES:
        if FORMAT_VERSION < version <= 255:
            raise SessionFileError(
                f"{path.name} was saved by a newer MLoT Spark (session format v{version}; this build reads up to "
                f"v{FORMAT_VERSION}); update the app to open it."
            )
        raise bad(path, f"has an unknown format version ({version}), so its header is corrupt")
    pre_size, reader = PREAMBLES[version]
    if len(head) < pre_size:
        raise bad(path, f"is truncated ({size} bytes, shorter than its {pre_size}-byte header)")
    pre = reader(path, head)
    if pre.meta_len > MAX_META_BYTES:
        raise bad(
            path,
            f"has a corrupt header (it claims {pre.meta_len} bytes of metadata, over the {MAX_META_BYTES}-byte limit)",
        )
    total = pre.size + pre.meta_len + pre.tensor_len
    if total > size:
        raise bad(path, f"is truncated or its header is corrupt (the header needs {total} bytes, the file has {size})")
    if total < size:
        raise bad(path, f"has {size - total} unexpected bytes after its end, so it is corrupt")
    if pre.compression == "none" and pre.raw_tensor_len != pre.tensor_len:
        raise bad(path, "has a corrupt header (tensor lengths disagree)")
    if pre.raw_tensor_len > MAX_COMPRESSION_RATIO * pre.tensor_len:
        raise bad(
            path,
            f"has a corrupt header (it claims {pre.raw_tensor_len} bytes of tensors from {pre.tensor_len} stored)",
        )
    return pre


def read_checked(path: Path) -> tuple[Preamble, bytes, bytes, int]:
    """(preamble, metadata bytes, stored tensor section, file size), after every check up to the SHA-256."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SessionFileError(f"The session file {path} does not exist.") from None
    except OSError as exc:
        raise SessionFileError(f"Cannot read the session file {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionFileError(f"{path} is a folder, not a session file; choose a {SESSION_SUFFIX} file.")
    if not stat.S_ISREG(st.st_mode):
        raise SessionFileError(f"{path} is not a regular file, so it cannot be a session file.")
    size = st.st_size
    if size == 0:
        raise bad(path, "is empty (0 bytes), so it was never completely written")
    if size > MAX_FILE_BYTES:
        raise bad(path, f"is {size} bytes, larger than any session this build writes ({MAX_FILE_BYTES})")
    try:
        with open(path, "rb") as f:
            pre = read_layout(f, path, size)
            # First pass: the checksum, streamed, so a large damaged (or sparse) file costs no memory. Only a
            # sound file is read into memory, and hashed again as it is, in case it changed in between.
            f.seek(pre.size)
            h = hashlib.sha256(pre.hashed)
            left = pre.meta_len + pre.tensor_len
            while left:
                chunk = f.read(min(_READ_CHUNK, left))
                if not chunk:
                    raise bad(path, "changed while it was being read")
                h.update(chunk)
                left -= len(chunk)
            if not hmac.compare_digest(h.digest(), pre.digest):
                raise bad(
                    path, "is corrupt: its checksum does not match its contents (it was damaged on disk or in transfer)"
                )
            f.seek(pre.size)
            meta = f.read(pre.meta_len)
            tensors = f.read(pre.tensor_len)
            if len(meta) != pre.meta_len or len(tensors) != pre.tensor_len or f.read(1):
                raise bad(path, "changed while it was being read")
    except OSError as exc:
        raise SessionFileError(f"Cannot read the session file {path}: {exc.strerror or exc}.") from None
    h = hashlib.sha256(pre.hashed)
    h.update(meta)
    h.update(tensors)  # updates, not a concatenation: no second copy of a large file
    if not hmac.compare_digest(h.digest(), pre.digest):
        raise bad(path, "changed while it was being read")
    return pre, meta, tensors, size


def decompress(path: Path, pre: Preamble, stored: bytes) -> bytes:
    if pre.compression == "none":
        return stored
    # Bounded: never inflate past the declared length, so a hostile stream cannot exhaust memory.
    try:
        if pre.compression == "zlib":
            d = zlib.decompressobj()
            raw = d.decompress(stored, pre.raw_tensor_len + 1)
            complete = d.eof and not d.unconsumed_tail and not d.unused_data
        else:
            dl = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
            raw = dl.decompress(stored, pre.raw_tensor_len + 1)
            complete = dl.eof and not dl.unused_data
    except (zlib.error, lzma.LZMAError):
        raise bad(path, "has a corrupt compressed tensor section") from None
    if not complete or len(raw) != pre.raw_tensor_len:
        raise bad(path, "has a compressed tensor section of the wrong length")
    return unshuffle(raw) if pre.shuffled else raw


def shuffle(raw: bytes) -> bytes:
    """Byte planes of 2-byte words: every low byte, then every high byte (an odd last byte stays last).

    fp16 KV's high bytes (sign, exponent) take few values, so grouped together they compress well."""
    even = len(raw) // 2 * 2
    return np.frombuffer(raw, np.uint8, count=even).reshape(-1, 2).T.tobytes() + raw[even:]


def unshuffle(planes: bytes) -> bytes:
    even = len(planes) // 2 * 2
    return np.frombuffer(planes, np.uint8, count=even).reshape(2, -1).T.tobytes() + planes[even:]


_TABLE_FAULTS = {
    HeaderFault.TRUNCATED: "has a truncated tensor section",
    HeaderFault.UNREADABLE: "has an unreadable tensor table",
    HeaderFault.PAST_END: "has a tensor section of the wrong size",
}


def tensor_table(path: Path, section: bytes) -> dict[str, TensorSpan]:
    """Validate the safetensors header against its section (count, dtypes, shapes, exact tiling of the data)."""
    try:
        return read_header(section, TENSOR_LIMITS).tensors
    except HeaderError as exc:
        raise bad(path, _table_sentence(exc)) from None


def _table_sentence(exc: HeaderError) -> str:
    if exc.fault is HeaderFault.HEADER_SIZE:
        return f"has a corrupt tensor table (it claims {exc.detail})"
    if exc.fault is HeaderFault.TOO_MANY:
        return f"lists {exc.detail}"
    if exc.fault in (HeaderFault.MALFORMED, HeaderFault.DTYPE):
        return f"has a malformed entry for tensor {exc.tensor!r}"
    if exc.fault is HeaderFault.SIZE:
        return f"has inconsistent sizes for tensor {exc.tensor!r}"
    if exc.fault is HeaderFault.OVERLAP:
        return (
            "has overlapping or missing tensor data"
            if exc.tensor is not None
            else "has a tensor section of the wrong size"
        )
    return _TABLE_FAULTS[exc.fault]


def decode_tensors(path: Path, section: bytes) -> dict[str, torch.Tensor]:
    tensor_table(path, section)
    try:
        return st_load(section)
    except (SafetensorError, ValueError, RuntimeError, TypeError, AssertionError):
        raise bad(path, "has tensors that safetensors cannot decode") from None


# -- writing -------------------------------------------------------------------------------------------------------


def compress(raw: bytes, method: str) -> tuple[int, bytes]:
    """-> (preamble flags, stored section)."""
    if method == "none":
        return 0, raw
    if method == "zlib":
        packed = zlib.compress(shuffle(raw), 1)  # level 1: ~the ratio of level 6 at twice the speed, on KV
    elif method == "lzma":
        packed = lzma.compress(shuffle(raw), format=lzma.FORMAT_XZ, preset=1)
    else:
        raise ValueError(f"unknown session compression {method!r}; use one of {', '.join(COMPRESSION_FLAGS)}")
    # Store raw when compression saves under MIN_COMPRESSION_SAVING (not worth inflating on every load), or
    # beyond the ratio a reader accepts.
    if len(packed) > (1 - MIN_COMPRESSION_SAVING) * len(raw) or len(raw) > MAX_COMPRESSION_RATIO * len(packed):
        return 0, raw
    return COMPRESSION_FLAGS[method] | _SHUFFLED, packed


def pack(meta_bytes: bytes, raw_tensors: bytes, compression: str) -> list[bytes]:
    """The current-version file as chunks to write in order: preamble, digest, metadata, tensor section."""
    flags, section = compress(raw_tensors, compression)
    head = _V2_HASHED.pack(MAGIC, FORMAT_VERSION, flags, 0, len(meta_bytes), len(section), len(raw_tensors))
    h = hashlib.sha256(head)
    h.update(meta_bytes)
    h.update(section)
    chunks = [head, h.digest(), meta_bytes, section]
    if sum(map(len, chunks)) > MAX_FILE_BYTES:
        raise SessionFileError(
            f"The session is over the {MAX_FILE_BYTES}-byte limit of a session file, so it cannot be saved."
        )
    return chunks
