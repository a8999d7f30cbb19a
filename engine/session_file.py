"""`.spark` session files: one conversation and its memory in one self-checking file (DESIGN.md, "Session files").

Layout of format v2 (all integers little-endian):

    offset  size  field
    0       6     magic b"SPARK\\x00"
    6       2     format version (u16)
    8       2     flags (u16): bits 0-7 the tensor section's codec, 0 none | 1 zlib | 2 lzma; bit 8 the
                  decompressed bytes are byte planes (see `_shuffle`); other bits 0
    10      2     reserved, 0
    12      8     M, metadata length (u64)
    20      8     T, tensor section length as stored (u64)
    28      8     R, tensor section length once decompressed (u64; == T when not compressed)
    36      32    SHA-256 over bytes [0, 36) + metadata + tensor section
    68      M     metadata: one UTF-8 JSON object (see `_validate` for its fields)
    68+M    T     tensors: safetensors bytes (possibly compressed); never pickle

Older layouts stay readable: each has a preamble reader (`_PREAMBLES`) and a metadata migration to the next
version (`_MIGRATIONS`), applied in a chain up to `FORMAT_VERSION`.

- v1: 56-byte preamble (magic, version, M, T, SHA-256 over metadata + tensors), no compression; its metadata had
  no tokenizer hash, no `saved` time and no `extra`, messages carried no timestamps, and the sampler state was
  called `rng`.
- v2: the layout above.

Compression pays for real KV once the fp16 bytes are split into planes (low bytes, then high bytes: sign and
exponent repeat a lot). Measured per 1k tokens (FullAttentionMemory, CPU): a small trained checkpoint (6 layers,
3 KB/token) 3.10 MB raw, 2.07 MB shuffled zlib level 1 (plain zlib would be 2.53); random SmolLM-135M-shaped
weights 23.07 MB raw, 19.51 MB shuffled zlib. So writers shuffle + zlib by default.

Reading checks, in this order, before anything is parsed into engine objects: a non-empty regular file, the
magic, a version this build knows, lengths within limits and adding up to the file's size, and the SHA-256.
Only then is the JSON parsed, migrated and checked field by field, and the tensor table validated against its
section before safetensors decodes it. Every failure is one `SessionFileError` sentence; nothing is applied.

Writes are atomic: a temp file in the same folder, fsync, `os.replace`, fsync of the folder — a crash or a full
disk mid-save leaves the previous file as it was.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import lzma
import math
import os
import stat
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import engine
from engine.backends.base import Backend
from engine.errors import SessionFileError, SparkError
from engine.memory import Memory
from engine.session_schema import (
    SchemaError,
    StateTarget,
    check_memory_state,
    check_session_meta,
    check_vocab,
    target_from_state,
)

MAGIC = b"SPARK\x00"
FORMAT_VERSION = 2
SUFFIX = ".spark"

# Limits: a file may be large (KV), but no header field may make the reader allocate more than the file holds.
MAX_FILE_BYTES = 16 * 1024**3  # read whole into memory: far above any cascade's working + episodic budget
MAX_META_BYTES = 64 * 1024 * 1024  # ~1M token ids + transcript + sampler state fit with room to spare
STALE_TEMP_S = 3600.0  # a temp file older than this belongs to no running save
MAX_TENSORS = 4096
MAX_TENSOR_HEADER_BYTES = 16 * 1024 * 1024
_READ_CHUNK = 1 << 20
MAX_COMPRESSION_RATIO = 64  # writers store uncompressed above this, so a higher claim is a corrupt (or hostile) file
MIN_COMPRESSION_SAVING = 0.05

_V2_PREAMBLE = struct.Struct("<6sHHHQQQ32s")  # 68 bytes
_V1_PREAMBLE = struct.Struct("<6sHQQ32s")  # 56 bytes
_COMPRESSION_FLAGS: dict[str, int] = {"none": 0, "zlib": 1, "lzma": 2}
_COMPRESSION_NAMES = {v: k for k, v in _COMPRESSION_FLAGS.items()}
_SHUFFLED = 0x100

# safetensors dtype name -> bytes per element: what a memory's state may hold (KV is canonical fp16).
_DTYPE_SIZES: dict[str, int] = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

RECOMPUTE_KIND = "recompute"  # memory meta of a compact file: no KV stored, rebuilt on open (engine.replay)
TRANSCRIPT_KIND = "transcript"  # memory meta of a file with no memory at all (a remote server's conversation)

JSONValue = Any  # None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" (kept as written; the chat template decides what it accepts)
    content: str
    timestamp: float | None = None  # seconds since the epoch; None when the file's format version did not keep it


@dataclass
class SessionData:
    """Everything a `.spark` file holds, migrated to the current format version."""

    format_version: int  # the version the file was written in (before migration)
    app_version: str
    fingerprint: str  # the model's (engine.weights.fingerprint)
    tokenizer_hash: str | None
    created: float
    saved: float
    system_prompt: str | None
    messages: list[Message]
    settings: dict[str, JSONValue]
    token_ids: list[int]  # every token fed to the memory, in order
    pending_token: int | None  # sampled last and not yet fed: a continuation feeds it first
    sampler_state: JSONValue  # the sampler's get_state() (RNG), or None
    memory_meta: dict[str, JSONValue]  # Memory.state()[0]: slot table, tier stats
    tensors: dict[str, torch.Tensor]  # Memory.state()[1]: canonical fp16 KV per tier, on the host
    extra: dict[str, JSONValue]
    compression: str
    file_bytes: int

    @property
    def memory_state(self) -> tuple[dict[str, JSONValue], dict[str, torch.Tensor]]:
        return self.memory_meta, self.tensors


@dataclass
class RestoredSession:
    """A session whose memory was written back into a backend: continue by feeding `pending_token` first."""

    data: SessionData
    memory: Memory


@dataclass
class ForeignModelSession:
    """A sound file made with another model (or tokenizer): its KV must not be applied; the transcript may be
    restored and re-read (re-prefilled) after telling the user `reason`."""

    data: SessionData
    reason: str  # one sentence for the user


@dataclass(frozen=True)
class _Preamble:
    version: int
    compression: str
    shuffled: bool
    meta_len: int
    tensor_len: int
    raw_tensor_len: int
    digest: bytes
    size: int  # bytes of preamble
    hashed: bytes  # the preamble bytes the digest covers (none in v1)


@dataclass(frozen=True)
class _TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


# -- reading -------------------------------------------------------------------------------------------------------


def _bad(path: Path, what: str) -> SessionFileError:
    return SessionFileError(f"The session file {path.name} {what}; nothing was restored.")


def _read_preamble_v1(path: Path, head: bytes) -> _Preamble:
    _, version, meta_len, tensor_len, digest = _V1_PREAMBLE.unpack_from(head)
    return _Preamble(version, "none", False, meta_len, tensor_len, tensor_len, digest, _V1_PREAMBLE.size, b"")


def _read_preamble_v2(path: Path, head: bytes) -> _Preamble:
    _, version, flags, reserved, meta_len, tensor_len, raw_len, digest = _V2_PREAMBLE.unpack_from(head)
    codec, shuffled = flags & 0xFF, bool(flags & _SHUFFLED)
    if codec not in _COMPRESSION_NAMES or flags & ~(0xFF | _SHUFFLED) or (shuffled and not codec):
        raise _bad(path, f"uses an unknown compression (flags 0x{flags:04x}), so its header is corrupt")
    if reserved:
        raise _bad(path, "has a corrupt header (a reserved field is set)")
    return _Preamble(version, _COMPRESSION_NAMES[codec], shuffled, meta_len, tensor_len, raw_len, digest, _V2_PREAMBLE.size, head[:36])


_PREAMBLES: dict[int, tuple[int, Callable[[Path, bytes], _Preamble]]] = {
    1: (_V1_PREAMBLE.size, _read_preamble_v1),
    2: (_V2_PREAMBLE.size, _read_preamble_v2),
}


def _read_checked(path: Path) -> tuple[_Preamble, bytes, bytes, int]:
    """(preamble, metadata bytes, stored tensor section, file size), after every check up to the SHA-256."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SessionFileError(f"The session file {path} does not exist.") from None
    except OSError as exc:
        raise SessionFileError(f"Cannot read the session file {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionFileError(f"{path} is a folder, not a session file; choose a {SUFFIX} file.")
    if not stat.S_ISREG(st.st_mode):
        raise SessionFileError(f"{path} is not a regular file, so it cannot be a session file.")
    size = st.st_size
    if size == 0:
        raise _bad(path, "is empty (0 bytes), so it was never completely written")
    if size > MAX_FILE_BYTES:
        raise _bad(path, f"is {size} bytes, larger than any session this build writes ({MAX_FILE_BYTES})")
    try:
        with open(path, "rb") as f:
            head = f.read(max(n for n, _ in _PREAMBLES.values()))
            if head[: len(MAGIC)] != MAGIC[: len(head)]:
                raise SessionFileError(f"{path.name} is not an MLoT Spark session file (it does not start with the {SUFFIX} signature).")
            if len(head) < 8:
                raise _bad(path, f"is truncated ({size} bytes)")
            (version,) = struct.unpack_from("<H", head, 6)
            if version not in _PREAMBLES:
                if FORMAT_VERSION < version <= 255:
                    raise SessionFileError(
                        f"{path.name} was saved by a newer MLoT Spark (session format v{version}; this build reads up to "
                        f"v{FORMAT_VERSION}); update the app to open it."
                    )
                raise _bad(path, f"has an unknown format version ({version}), so its header is corrupt")
            pre_size, reader = _PREAMBLES[version]
            if len(head) < pre_size:
                raise _bad(path, f"is truncated ({size} bytes, shorter than its {pre_size}-byte header)")
            pre = reader(path, head)
            if pre.meta_len > MAX_META_BYTES:
                raise _bad(path, f"has a corrupt header (it claims {pre.meta_len} bytes of metadata, over the {MAX_META_BYTES}-byte limit)")
            total = pre.size + pre.meta_len + pre.tensor_len
            if total > size:
                raise _bad(path, f"is truncated or its header is corrupt (the header needs {total} bytes, the file has {size})")
            if total < size:
                raise _bad(path, f"has {size - total} unexpected bytes after its end, so it is corrupt")
            if pre.compression == "none" and pre.raw_tensor_len != pre.tensor_len:
                raise _bad(path, "has a corrupt header (tensor lengths disagree)")
            if pre.raw_tensor_len > MAX_COMPRESSION_RATIO * pre.tensor_len:
                raise _bad(path, f"has a corrupt header (it claims {pre.raw_tensor_len} bytes of tensors from {pre.tensor_len} stored)")
            # First pass: the checksum, streamed, so a large damaged (or sparse) file costs no memory. Only a
            # sound file is read into memory, and hashed again as it is, in case it changed in between.
            f.seek(pre.size)
            h = hashlib.sha256(pre.hashed)
            left = pre.meta_len + pre.tensor_len
            while left:
                chunk = f.read(min(_READ_CHUNK, left))
                if not chunk:
                    raise _bad(path, "changed while it was being read")
                h.update(chunk)
                left -= len(chunk)
            if not hmac.compare_digest(h.digest(), pre.digest):
                raise _bad(path, "is corrupt: its checksum does not match its contents (it was damaged on disk or in transfer)")
            f.seek(pre.size)
            meta = f.read(pre.meta_len)
            tensors = f.read(pre.tensor_len)
            if len(meta) != pre.meta_len or len(tensors) != pre.tensor_len or f.read(1):
                raise _bad(path, "changed while it was being read")
    except OSError as exc:
        raise SessionFileError(f"Cannot read the session file {path}: {exc.strerror or exc}.") from None
    h = hashlib.sha256(pre.hashed)
    h.update(meta)
    h.update(tensors)  # updates, not a concatenation: no second copy of a large file
    if not hmac.compare_digest(h.digest(), pre.digest):
        raise _bad(path, "changed while it was being read")
    return pre, meta, tensors, size


def _migrate_v1_to_v2(meta: dict[str, JSONValue]) -> dict[str, JSONValue]:
    # Written so it cannot raise on any JSON object: whatever it leaves malformed, `_validate` names.
    out = dict(meta)
    out["format_version"] = 2
    out["sampler_state"] = out.pop("rng", None)
    out["tokenizer_hash"] = None
    out["saved"] = out.get("created")
    out["extra"] = {}
    messages = out.get("messages")
    if isinstance(messages, list):
        out["messages"] = [{**m, "timestamp": None} if isinstance(m, dict) else m for m in messages]
    return out


_MIGRATIONS: dict[int, Callable[[dict[str, JSONValue]], dict[str, JSONValue]]] = {1: _migrate_v1_to_v2}


def _parse_meta(path: Path, pre: _Preamble, raw: bytes) -> dict[str, Any]:
    try:
        meta = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad(path, "has unreadable metadata (not strict JSON)") from None
    if not isinstance(meta, dict) or meta.get("format_version") != pre.version:
        raise _bad(path, "has metadata that does not match its header")
    version = pre.version
    while version < FORMAT_VERSION:
        meta = _MIGRATIONS[version](meta)
        version += 1
    try:
        fields = check_session_meta(meta)
    except SchemaError as exc:
        raise _bad(path, str(exc)) from None
    fields["messages"] = [Message(*m) for m in fields["messages"]]
    return fields


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity, -Infinity: Python's parser accepts them by default


def _decompress(path: Path, pre: _Preamble, stored: bytes) -> bytes:
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
        raise _bad(path, "has a corrupt compressed tensor section") from None
    if not complete or len(raw) != pre.raw_tensor_len:
        raise _bad(path, "has a compressed tensor section of the wrong length")
    return _unshuffle(raw) if pre.shuffled else raw


def _shuffle(raw: bytes) -> bytes:
    """Byte planes of 2-byte words: every low byte, then every high byte (an odd last byte stays last).

    fp16 KV's high bytes (sign, exponent) take few values, so grouped together they compress well."""
    even = len(raw) // 2 * 2
    return np.frombuffer(raw, np.uint8, count=even).reshape(-1, 2).T.tobytes() + raw[even:]


def _unshuffle(planes: bytes) -> bytes:
    even = len(planes) // 2 * 2
    return np.frombuffer(planes, np.uint8, count=even).reshape(2, -1).T.tobytes() + planes[even:]


def _tensor_table(path: Path, section: bytes) -> dict[str, _TensorEntry]:
    """Validate the safetensors header against its section (count, dtypes, shapes, exact tiling of the data)."""
    if len(section) < 8:
        raise _bad(path, "has a truncated tensor section")
    (n,) = struct.unpack_from("<Q", section)
    if n > min(MAX_TENSOR_HEADER_BYTES, len(section) - 8):
        raise _bad(path, f"has a corrupt tensor table (it claims {n} bytes)")
    try:
        header = json.loads(section[8 : 8 + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _bad(path, "has an unreadable tensor table") from None
    if not isinstance(header, dict):
        raise _bad(path, "has an unreadable tensor table")
    header.pop("__metadata__", None)
    if len(header) > MAX_TENSORS:
        raise _bad(path, f"lists {len(header)} tensors, over the {MAX_TENSORS} limit")
    table: dict[str, _TensorEntry] = {}
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (a, b) = entry["dtype"], entry["shape"], entry["data_offsets"]
            ok = (
                name
                and dtype in _DTYPE_SIZES
                and isinstance(shape, list)
                and all(type(s) is int and 0 <= s < 2**40 for s in shape)
                and type(a) is int
                and type(b) is int
                and 0 <= a <= b
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise _bad(path, f"has a malformed entry for tensor {name!r}")
        nbytes = math.prod(shape) * _DTYPE_SIZES[dtype]
        if b - a != nbytes:
            raise _bad(path, f"has inconsistent sizes for tensor {name!r}")
        table[name] = _TensorEntry(dtype, tuple(shape), nbytes)
        spans.append((a, b))
    at = 0
    for a, b in sorted(spans):  # safetensors data is the tensors back to back, nothing more or less
        if a != at:
            raise _bad(path, "has overlapping or missing tensor data")
        at = b
    if 8 + n + at != len(section):
        raise _bad(path, "has a tensor section of the wrong size")
    return table


def _decode_tensors(path: Path, section: bytes) -> dict[str, torch.Tensor]:
    _tensor_table(path, section)
    try:
        return st_load(section)
    except (SafetensorError, ValueError, RuntimeError, TypeError, AssertionError):
        raise _bad(path, "has tensors that safetensors cannot decode") from None


def _open(path: Path) -> tuple[_Preamble, dict[str, Any], bytes, int]:
    """Checked preamble, validated metadata fields, the decompressed tensor section, the file size."""
    pre, meta_raw, stored, size = _read_checked(path)
    fields = _parse_meta(path, pre, meta_raw)
    section = _decompress(path, pre, stored)
    return pre, fields, section, size


def load_session(path: str | Path, target: StateTarget | None = None) -> SessionData:
    """Read, verify and migrate a `.spark` file; raises SessionFileError naming the problem.

    The memory state is checked against `target` (the model's: exactly what `restore` checks), or without one
    against the file's own geometry (every check that does not need the model)."""
    path = Path(path).expanduser()
    pre, fields, section, size = _open(path)
    tensors = _decode_tensors(path, section)
    try:
        if target is not None:
            check_vocab(fields["token_ids"], fields["pending_token"], target.vocab_size)
        kind = fields["memory_meta"].get("kind")
        if kind == RECOMPUTE_KIND:
            _check_recipe(fields, tensors)
        elif kind == TRANSCRIPT_KIND:
            if tensors or fields["token_ids"] or fields["pending_token"] is not None:
                raise SchemaError("is a transcript-only file yet holds memory (tensors or token ids)")
        else:
            check_memory_state(fields["memory_meta"], tensors, target or target_from_state(fields["memory_meta"], tensors))
    except SchemaError as exc:
        raise _bad(path, str(exc)) from None
    return SessionData(format_version=pre.version, tensors=tensors, compression=pre.compression, file_bytes=size, **fields)


def _check_recipe(fields: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """A compact file (engine.replay): no tensors, and a feed recipe that accounts for exactly its tokens."""
    from engine.replay import check_schedule  # the recipe's one checker; replay imports generation code

    if tensors:
        raise SchemaError("is compact (memory recomputed on open) yet holds memory tensors")
    extra = fields.get("extra")
    try:
        check_schedule(extra.get("feed_schedule") if isinstance(extra, dict) else None, len(fields["token_ids"]))
    except SessionFileError:
        raise SchemaError("has a malformed memory recipe (its feed schedule does not account for its tokens)") from None


def verify_session(path: str | Path, target: StateTarget | None = None, fingerprint: str | None = None) -> SessionData:
    """`restore`'s checks without restoring: with the model's `target` and `fingerprint`, passing means restore
    succeeds. A file of another model (fingerprint differs) is checked as restore treats it: transcript only."""
    if target is not None and fingerprint is not None and load_session(path).fingerprint != fingerprint:
        target = None
    return load_session(path, target)


# Tensor-name prefixes of the memories' state() (engine.cascade: "wk.k", "ep.12.v", "route.prompt_sum").
_TIER_PREFIXES = {"wk": "working", "working": "working", "ep": "episodic", "episodic": "episodic"}


def tier_of(tensor_name: str) -> str:
    """The tier a state tensor belongs to, by name prefix; bare names (FullAttentionMemory's "k", "v") are working
    memory, unknown prefixes are reported under their own name."""
    if "." not in tensor_name:
        return "working"
    prefix = tensor_name.split(".", 1)[0]
    return _TIER_PREFIXES.get(prefix, prefix)


def inspect_session(path: str | Path) -> dict[str, JSONValue]:
    """A verified summary for `session inspect` (JSON-able): version, model, messages, tokens, sizes per tier."""
    path = Path(path).expanduser()
    pre, fields, section, size = _open(path)
    table = _tensor_table(path, section)
    tiers: dict[str, int] = {}
    for name, entry in table.items():
        tiers[tier_of(name)] = tiers.get(tier_of(name), 0) + entry.nbytes
    return {
        "path": str(path),
        "format_version": pre.version,
        "current_format_version": FORMAT_VERSION,
        "app_version": fields["app_version"],
        "model_fingerprint": fields["fingerprint"],
        "tokenizer_hash": fields["tokenizer_hash"],
        "created": fields["created"],
        "saved": fields["saved"],
        "system_prompt": fields["system_prompt"],
        "messages": [{"role": m.role, "content": m.content, "timestamp": m.timestamp} for m in fields["messages"]],
        "token_count": len(fields["token_ids"]) + (fields["pending_token"] is not None),
        "pending_token": fields["pending_token"],
        "memory_kind": fields["memory_meta"].get("kind"),
        "settings": fields["settings"],
        "compression": pre.compression,
        "file_bytes": size,
        "tensor_bytes": sum(tiers.values()),
        "tier_bytes": tiers,
    }


# -- writing -------------------------------------------------------------------------------------------------------


def _message_json(m: Message | Mapping[str, Any] | Any) -> dict[str, JSONValue]:
    # Accepts this module's Message, engine.session.ChatMessage (same attributes) or a plain mapping.
    get = m.get if isinstance(m, Mapping) else lambda k, d=None: getattr(m, k, d)
    ts = get("timestamp")
    return {"role": str(get("role")), "content": str(get("content")), "timestamp": None if ts is None else float(ts)}


def _compress(raw: bytes, method: str) -> tuple[int, bytes]:
    """-> (preamble flags, stored section)."""
    if method == "none":
        return 0, raw
    if method == "zlib":
        packed = zlib.compress(_shuffle(raw), 1)  # level 1: ~the ratio of level 6 at twice the speed, on KV
    elif method == "lzma":
        packed = lzma.compress(_shuffle(raw), format=lzma.FORMAT_XZ, preset=1)
    else:
        raise ValueError(f"unknown session compression {method!r}; use one of {', '.join(_COMPRESSION_FLAGS)}")
    # Store raw when compression saves under MIN_COMPRESSION_SAVING (not worth inflating on every load), or
    # beyond the ratio a reader accepts.
    if len(packed) > (1 - MIN_COMPRESSION_SAVING) * len(raw) or len(raw) > MAX_COMPRESSION_RATIO * len(packed):
        return 0, raw
    return _COMPRESSION_FLAGS[method] | _SHUFFLED, packed


def _encode(
    *,
    fingerprint: str,
    tokenizer_hash: str | None,
    messages: Sequence[Message | Mapping[str, Any] | Any],
    system_prompt: str | None,
    settings: Mapping[str, JSONValue],
    memory_state: tuple[Mapping[str, JSONValue], Mapping[str, torch.Tensor]],
    pending_token: int | None,
    sampler_state: JSONValue,
    extra: Mapping[str, JSONValue] | None = None,
    token_ids: Sequence[int] | None = None,
    created: float | None = None,
    saved: float | None = None,
    compression: str = "zlib",
) -> list[bytes]:
    """The current-version `.spark` file as chunks to write in order (see `save_session`)."""
    memory_meta, tensors = memory_state
    if token_ids is None:
        token_ids = memory_meta.get("tokens", [])  # Memory.tokens, as FullAttentionMemory's state records it
    saved = time.time() if saved is None else saved
    meta = {
        "format_version": FORMAT_VERSION,
        "app_version": engine.__version__,
        "model_fingerprint": fingerprint,
        "tokenizer_hash": tokenizer_hash,
        "created": saved if created is None else created,
        "saved": saved,
        "system_prompt": system_prompt,
        "messages": [_message_json(m) for m in messages],
        "settings": dict(settings),
        "token_ids": [int(t) for t in token_ids],
        "pending_token": None if pending_token is None else int(pending_token),
        "sampler_state": sampler_state,
        "memory": dict(memory_meta),
        "extra": dict(extra or {}),
    }
    # allow_nan=False: NaN/Infinity are not JSON, and other readers of the file would choke on them.
    try:
        meta_bytes = json.dumps(meta, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        raise SessionFileError("The conversation holds text that is not valid Unicode (a lone surrogate), so it cannot be saved.") from None
    if len(meta_bytes) > MAX_META_BYTES:
        raise SessionFileError(
            f"The conversation's metadata is {len(meta_bytes)} bytes, over the {MAX_META_BYTES}-byte session limit, so it cannot be saved."
        )
    if len(tensors) > MAX_TENSORS:
        raise SessionFileError(
            f"The memory has {len(tensors)} tensors, over the {MAX_TENSORS} a session file holds, so it cannot be saved."
        )
    host: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in storages:
            t = t.clone()  # safetensors refuses tensors sharing memory (e.g. one zero tensor used twice)
        storages.add(t.untyped_storage().data_ptr())
        host[name] = t
    raw = st_save(host)
    flags, section = _compress(raw, compression)
    head = struct.pack("<6sHHHQQQ", MAGIC, FORMAT_VERSION, flags, 0, len(meta_bytes), len(section), len(raw))
    h = hashlib.sha256(head)
    h.update(meta_bytes)
    h.update(section)
    chunks = [head, h.digest(), meta_bytes, section]
    if sum(map(len, chunks)) > MAX_FILE_BYTES:
        raise SessionFileError(f"The session is over the {MAX_FILE_BYTES}-byte limit of a session file, so it cannot be saved.")
    return chunks


def save_session(
    path: str | Path,
    *,
    fingerprint: str,
    tokenizer_hash: str | None,
    messages: Sequence[Message | Mapping[str, Any] | Any],
    system_prompt: str | None,
    settings: Mapping[str, JSONValue],
    memory_state: tuple[Mapping[str, JSONValue], Mapping[str, torch.Tensor]],
    pending_token: int | None,
    sampler_state: JSONValue,
    extra: Mapping[str, JSONValue] | None = None,
    token_ids: Sequence[int] | None = None,
    created: float | None = None,
    compression: str = "zlib",
) -> int:
    """Atomically write a session file; returns its size in bytes.

    memory_state is `Memory.state()`; token_ids defaults to its meta's "tokens" (every token fed so far);
    pending_token is the last sampled token not yet fed; sampler_state the sampler's JSON-able RNG state;
    created is the conversation's first save time (kept across autosaves; now when None). compression: "zlib"
    (byte-shuffled, level 1: about a third smaller for real KV, fast), "lzma" (a little smaller, ~10x slower) or
    "none"; a codec that saves under 5% is dropped and the tensors stored raw.
    On failure (full disk, no permission) raises SessionFileError and the previous file is untouched.
    """
    chunks = _encode(
        fingerprint=fingerprint,
        tokenizer_hash=tokenizer_hash,
        messages=messages,
        system_prompt=system_prompt,
        settings=settings,
        memory_state=memory_state,
        pending_token=pending_token,
        sampler_state=sampler_state,
        extra=extra,
        token_ids=token_ids,
        created=created,
        compression=compression,
    )
    atomic_write(Path(path).expanduser(), chunks)
    return sum(map(len, chunks))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync(fd: int) -> None:
    # On macOS fsync only reaches the drive's cache; F_FULLFSYNC asks the drive to persist it.
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # not supported by this file system: plain fsync below
    os.fsync(fd)


def _check_target(path: Path) -> None:
    """Saving replaces the file at `path`: only ever a regular file (or nothing), never what a link points at."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SessionFileError(f"Could not save the session to {path}: {exc.strerror or exc}.") from None
    if stat.S_ISDIR(st.st_mode):
        raise SessionFileError(f"{path} is a folder; choose a file name to save the session to.")
    kinds = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))
    for test, kind in kinds:
        if test(st.st_mode):
            raise SessionFileError(f"{path} is {kind}, not a regular file, so the session was not saved there; choose another file name.")


def _temp_prefix(name: str, pid: int | None = None) -> str:
    return f".{name}.{os.getpid() if pid is None else pid}."


def remove_stale_temps(path: Path) -> int:
    """Delete temp files that killed saves of `path` left behind: their writer is gone (same machine) or they are
    older than STALE_TEMP_S (a writer elsewhere). Returns how many were removed."""
    removed = 0
    try:
        candidates = list(path.parent.glob(f".{glob_escape(path.name)}.*.tmp"))
    except OSError:
        return 0
    for tmp in candidates:
        pid_text = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        try:
            st = os.lstat(tmp)
            dead = pid_text.isdigit() and not _alive(int(pid_text))
            if stat.S_ISREG(st.st_mode) and (dead or time.time() - st.st_mtime > STALE_TEMP_S):
                os.unlink(tmp)
                removed += 1
        except OSError:
            pass  # renamed or removed by its writer meanwhile
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process, or not a pid we can ask about: leave its file to the age rule
    return True


def atomic_write(path: Path, chunks: Sequence[bytes]) -> None:
    """Temp file in the same folder, write, fsync, os.replace, fsync the folder: old or new, never half.
    Refuses a target that is not a regular file; first removes temp files of earlier saves that were killed."""
    _check_target(path)
    remove_stale_temps(path)
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=folder)
    except OSError as exc:
        raise SessionFileError(f"Could not save the session to {path}: {exc.strerror or exc}.") from None
    try:
        try:
            for chunk in chunks:
                _write_all(fd, chunk)
            _fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already renamed or never created: nothing left behind either way
        if isinstance(exc, OSError):
            raise SessionFileError(
                f"Could not save the session to {path}: {exc.strerror or exc}; the previous file (if any) is unchanged."
            ) from None
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # folders cannot be opened on this platform; the rename itself has happened
    try:
        os.fsync(dfd)  # makes the rename itself durable
    except OSError:
        pass  # some file systems refuse fsync on a folder; the data is already safely in place
    finally:
        os.close(dfd)


# -- restoring -----------------------------------------------------------------------------------------------------


def restore(
    path: str | Path,
    backend: Backend,
    memory_factory: Callable[[Backend], Memory],
    *,
    tokenizer_hash: str | None = None,
    recompute: Callable[[Memory, SessionData], None] | None = None,
) -> RestoredSession | ForeignModelSession:
    """Verify `path`, then write its memory back through a new `memory_factory(backend)`.

    Returns ForeignModelSession (applying nothing) when the file was made with another model or tokenizer.
    Every check (session_schema, against the new memory's `state_target()`) runs before anything is written, so
    on any SessionFileError the backend is untouched.
    Give a factory over a row (or forked backend) the current conversation does not use to keep it intact.
    A compact file (memory kind "recompute": no KV, see engine.replay) is rebuilt by `recompute(memory, data)`.
    """
    path = Path(path).expanduser()
    data = load_session(path)
    if data.fingerprint != backend.fingerprint:
        return ForeignModelSession(
            data,
            f"{path.name} was saved with a different model ({data.fingerprint[:12]}, this one is {backend.fingerprint[:12]}); "
            "its transcript can be restored and re-read, but not its memory.",
        )
    if tokenizer_hash is not None and data.tokenizer_hash is not None and data.tokenizer_hash != tokenizer_hash:
        return ForeignModelSession(
            data, f"{path.name} was saved with a different tokenizer; its transcript can be restored and re-read, but not its memory."
        )
    memory = memory_factory(backend)
    if data.memory_meta.get("kind") == RECOMPUTE_KIND:
        # Checked by load_session (no tensors, a recipe for exactly its tokens); the tokens against the vocabulary here.
        try:
            check_vocab(data.token_ids, data.pending_token, memory.state_target().vocab_size)
        except SchemaError as exc:
            raise _bad(path, str(exc)) from None
        if recompute is None:
            raise SessionFileError(f"The session {path.name} is compact and must be opened by the app or the engine, which recompute its memory.")
        try:
            recompute(memory, data)
        except BaseException:
            memory.reset()
            raise
        return RestoredSession(data, memory)
    # The memory is made (sized by the model, never by the file) only to learn its geometry; it is checked against
    # before anything is written, so a refused file leaves it and the backend untouched.
    try:
        target = memory.state_target()
        check_vocab(data.token_ids, data.pending_token, target.vocab_size)
        check_memory_state(data.memory_meta, data.tensors, target)
    except SchemaError as exc:
        raise _bad(path, str(exc)) from None
    try:
        memory.load_state(data.memory_meta, data.tensors)
    except SparkError as exc:
        memory.reset()
        raise SessionFileError(f"The session {path.name} cannot be restored here: {exc}") from None
    return RestoredSession(data, memory)
