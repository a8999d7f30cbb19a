"""Persistent memory (L3): content-addressed KV blocks on disk, shared across requests, sessions and restarts.

Layout under the cache dir: `blocks/<key>.safetensors` (one block: k, v (L, Hkv, n, D) fp16) and `index.json`
(key -> bytes, last use, uses) for LRU accounting. The key is sha256 of (model fingerprint, backend numerics,
dtype, context tag, digest of the full token prefix up to and including the block), so a block is only ever
found by the model, arithmetic and token history that produced it.

Crash safety: every file is written to a temp name, fsynced, then renamed, so a reader sees a whole file or
none. The safetensors header also carries the identity and a CRC32 per tensor; an entry whose identity
differs, whose size is wrong or whose bytes fail the CRC is deleted with a warning and never loaded. The index is
advisory: on open it is reconciled with the files actually present (another process may have added some).

Two kinds of entry share the directory, the identity checks and the byte budget (header `kind`): "kv" (one block:
k, v) and "state" (a cascade snapshot, engine.memory.cascade.prefix: named tensors of fp16/fp32/fp64 plus the memory's
JSON meta, itself covered by a CRC). Entries written before kinds existed are "kv".

Paths: a key is a sha256 hex string or it is refused; every entry's path is checked to resolve inside `blocks/`,
so nothing read from a session file or a snapshot (an episodic block's l3_key) can name a file elsewhere.

A cache is an optimisation, never a reason to lose a reply: any I/O error (full disk, read-only or vanished
folder, a file where the folder should be) turns the store off for the rest of the run with one warning, and it
then behaves as an empty cache that stores nothing.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save

from engine.backends.base import CANONICAL_KV_DTYPE
from engine.fileio import (
    HeaderError,
    HeaderFault,
    HeaderLimits,
    atomic_write,
    read_header,
)
from engine.memory.cascade.stats import Counters, TierStats

FORMAT = "mlot-spark-kv/1"
KV_TENSORS = ("k", "v")
STALE_TEMP_S = 3600.0
HEADER_LIMITS = HeaderLimits(100 * 1024 * 1024, dtypes=frozenset({"F16", "F32", "F64"}))  # what entries may hold
_HEADER_FAULTS = {
    HeaderFault.TRUNCATED: "it is truncated",
    HeaderFault.HEADER_SIZE: "its header is truncated",
    HeaderFault.UNREADABLE: "its header is unreadable",
}  # every other fault: "its data is truncated or inconsistent"


def _is_key(name: object) -> bool:
    return isinstance(name, str) and len(name) == 64 and all(c in "0123456789abcdef" for c in name)


def _crc(t: torch.Tensor) -> str:
    return f"{zlib.crc32(t.contiguous().view(torch.uint8).numpy().data):08x}"


def _atomic_write(path: Path, data: bytes) -> None:
    atomic_write(path, [data], prefix=".tmp-", suffix=path.suffix)


@dataclass
class _Entry:
    bytes: int
    last_used: float
    uses: int


class PersistentStore:
    """Blocks of one model + backend numerics under `root`; entries of any other model/numerics are never used."""

    def __init__(self, root: str | Path, fingerprint: str, numerics: str, budget_bytes: int = 4 * 1024**3) -> None:
        self.root = Path(root).expanduser()
        self.blocks = self.root / "blocks"
        self.fingerprint = fingerprint
        self.numerics = numerics
        self.dtype = str(CANONICAL_KV_DTYPE).removeprefix("torch.")
        self.budget_bytes = budget_bytes
        self.counters = Counters()
        self._index: dict[str, _Entry] = {}
        self.disabled: str | None = None  # why the store turned itself off (an I/O error), or None
        try:
            self.blocks.mkdir(parents=True, exist_ok=True)
            self._blocks_resolved = self.blocks.resolve(strict=True)
            self._load_index()
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        """Turn the store off for this run after an I/O error, with one warning; it then acts as an empty cache."""
        if self.disabled is None:
            self.disabled = exc.strerror or str(exc)
            warnings.warn(
                f"The persistent KV cache at {self.root} is off for this run ({self.disabled}); replies are unaffected, only slower to repeat.",
                RuntimeWarning,
                stacklevel=3,
            )
        self._index = {}

    # -- keys ---------------------------------------------------------------------------------------------------

    def key(self, prefix_digest: str, tag: str = "exact") -> str:
        """The content address of a block: identity of the arithmetic + what the KV was computed from."""
        ident = f"{self.fingerprint}|{self.numerics}|{self.dtype}|{tag}|{prefix_digest}"
        return hashlib.sha256(ident.encode()).hexdigest()

    def _path(self, key: str) -> Path:
        """The entry's file; refuses anything but a content hash, and any path that resolves outside `blocks/`."""
        if not _is_key(key):
            raise ValueError("a persistent cache key must be a sha256 hex digest")
        path = self.blocks / f"{key}.safetensors"
        if path.resolve().parent != self._blocks_resolved:  # e.g. a symlink planted in the cache folder
            raise ValueError("a persistent cache entry resolves outside the cache folder")
        return path

    # -- index --------------------------------------------------------------------------------------------------

    def _load_index(self) -> None:
        try:
            raw = json.loads((self.root / "index.json").read_text(encoding="utf-8"))
            entries = {
                k: _Entry(int(e["bytes"]), float(e["last_used"]), int(e["uses"])) for k, e in raw["entries"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = {}
        present = {p.stem: p for p in self.blocks.glob("*.safetensors") if _is_key(p.stem)}
        for tmp in self.blocks.glob(".tmp-*"):  # left by a killed writer; young ones may still be mid-write
            try:
                if time.time() - tmp.stat().st_mtime > STALE_TEMP_S:
                    tmp.unlink()
            except OSError:  # renamed or removed by its writer meanwhile
                pass
        self._index = {k: e for k, e in entries.items() if k in present}
        for k, p in present.items():  # files another process wrote since (or an index that was lost)
            if k not in self._index:
                st = p.stat()
                self._index[k] = _Entry(st.st_size, st.st_mtime, 0)

    def flush(self) -> None:
        """Write the LRU index (atomically); called after every put/eviction and by `close()`."""
        if self.disabled:
            return
        data = {"format": FORMAT, "entries": {k: vars(e) for k, e in self._index.items()}}
        try:
            _atomic_write(self.root / "index.json", json.dumps(data).encode())
        except OSError as exc:
            self._fail(exc)

    close = flush

    # -- blocks -------------------------------------------------------------------------------------------------

    def __contains__(self, key: str) -> bool:
        return not self.disabled and key in self._index

    def entry_bytes(self, key: str) -> int:
        """What the entry takes on disk (0 when absent)."""
        e = self._index.get(key)
        return e.bytes if e is not None and not self.disabled else 0

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor, tokens: int) -> None:
        """k, v (L, Hkv, n, D) canonical fp16 -> one entry (when the key is already stored: only marks it used now,
        since whoever puts it again, e.g. a new snapshot referencing the block, still needs it)."""
        if self.disabled or not _is_key(key):
            return
        if key in self._index:
            self._index[key].last_used = time.time()
            return
        self._write(key, "kv", {"k": k.to(CANONICAL_KV_DTYPE), "v": v.to(CANONICAL_KV_DTYPE)}, {"tokens": str(tokens)})

    def put_state(self, key: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """A memory snapshot: JSON-able meta + named tensors (fp16, fp32 or fp64) -> one entry (no-op when stored)."""
        if self.disabled or not _is_key(key) or key in self._index:
            return
        state = json.dumps(meta)
        self._write(key, "state", tensors, {"state": state, "crc_state": f"{zlib.crc32(state.encode()):08x}"})

    def _write(self, key: str, kind: str, tensors: dict[str, torch.Tensor], extra: dict[str, str]) -> None:
        tensors = {n: t.contiguous() for n, t in tensors.items()}
        meta = {
            "format": FORMAT,
            "kind": kind,
            "key": key,
            "fingerprint": self.fingerprint,
            "numerics": self.numerics,
            "dtype": self.dtype,
            **extra,
            **{f"crc_{n}": _crc(t) for n, t in tensors.items()},
        }
        data = save(tensors, metadata=meta)
        try:
            _atomic_write(self._path(key), data)
        except OSError as exc:
            self._fail(exc)
            return
        self._index[key] = _Entry(len(data), time.time(), 0)
        self._enforce_budget(keep=key)
        self.flush()

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block's k, v (L, Hkv, n, D) fp16, or None when absent; a broken entry is deleted with a warning."""
        got = self._get(key, "kv")
        return None if got is None else (got[1]["k"], got[1]["v"])

    def get_state(self, key: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """A snapshot's (meta, tensors), or None when absent; a broken entry is deleted with a warning."""
        return self._get(key, "state")

    def _get(self, key: str, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        if self.disabled or not _is_key(key) or key not in self._index:
            self.counters.misses += 1
            return None
        try:
            got = self._read(self._path(key), key, kind)
        except FileNotFoundError:  # removed by another process meanwhile: a plain miss
            self._index.pop(key, None)
            got = None
        except OSError as exc:
            self._fail(exc)
            got = None
        except (ValueError, RuntimeError):  # a path outside the folder, or bytes torch cannot view
            self._drop(key, "it cannot be read as an entry")
            got = None
        if got is None:
            self.counters.misses += 1
            return None
        e = self._index[key]
        e.last_used, e.uses = time.time(), e.uses + 1
        self.counters.hits += 1
        return got

    def _read(self, path: Path, key: str, kind: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        # Non-blocking and no symlinks: a FIFO or link planted under a key's name is refused, never waited on.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                self._drop(key, "it is not a regular file")
                return None
            size = st.st_size
            if size < 8:
                self._drop(key, "it is truncated")
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            header = read_header(mm, HEADER_LIMITS)
        except HeaderError as exc:
            self._drop(key, _HEADER_FAULTS.get(exc.fault, "its data is truncated or inconsistent"))
            return None
        meta = header.metadata
        if meta is None:
            self._drop(key, "its header is unreadable")
            return None
        ident = (
            meta.get("format"),
            meta.get("kind", "kv"),
            meta.get("key"),
            meta.get("fingerprint"),
            meta.get("numerics"),
            meta.get("dtype"),
        )
        if ident != (FORMAT, kind, key, self.fingerprint, self.numerics, self.dtype):
            self._drop(key, "it belongs to another model, backend or format")
            return None
        infos = header.tensors
        if kind == "kv" and (set(infos) != set(KV_TENSORS) or any(i.dtype != "F16" for i in infos.values())):
            self._drop(key, "its data is truncated or inconsistent")
            return None
        out: dict[str, torch.Tensor] = {}
        for name, info in infos.items():
            count = info.nbytes // info.torch_dtype.itemsize
            t = (
                torch.frombuffer(mm, dtype=info.torch_dtype, count=count, offset=info.start).view(info.shape)
                if count
                else torch.zeros(info.shape, dtype=info.torch_dtype)
            )
            if _crc(t) != meta.get(f"crc_{name}"):
                self._drop(key, "its data fails the checksum")
                return None
            out[name] = t
        state: dict[str, Any] = {}
        if kind == "state":
            text = meta.get("state", "")
            if f"{zlib.crc32(text.encode()):08x}" != meta.get("crc_state"):
                self._drop(key, "its data fails the checksum")
                return None
            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError):
                parsed = None
            if not isinstance(parsed, dict):
                self._drop(key, "its state is unreadable")
                return None
            state = parsed
        return state, out

    def discard(self, key: str, why: str | None = None) -> None:
        """Delete an entry that read back intact but cannot be used; with a warning when `why` (completing
        "because ...") says it should not have happened."""
        if why is not None:
            self._drop(key, why)
            return
        self._remove(key)
        self.counters.evictions += 1
        self.flush()

    def _drop(self, key: str, why: str) -> None:
        warnings.warn(
            f"Dropped a persistent KV cache entry because {why}; it will be recomputed.", RuntimeWarning, stacklevel=3
        )
        self._remove(key)
        self.counters.evictions += 1
        self.flush()

    def _remove(self, key: str) -> None:
        self._index.pop(key, None)
        if self.disabled or not _is_key(key):
            return
        try:
            self._path(key).unlink(missing_ok=True)
        except ValueError:
            pass  # resolves outside the folder: never deleted through the cache
        except OSError as exc:
            self._fail(exc)

    def _enforce_budget(self, keep: str | None = None) -> None:
        total = self.bytes
        if total <= self.budget_bytes:
            return
        for key in sorted(self._index, key=lambda k: self._index[k].last_used):  # least recently used first
            if total <= self.budget_bytes:
                break
            if key == keep:
                continue
            total -= self._index[key].bytes
            self._remove(key)
            self.counters.evictions += 1

    def clear(self) -> None:
        """Delete every entry of this store's directory (all models: the directory is one cache)."""
        for key in list(self._index):
            self._remove(key)
        self.flush()

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self._index.values())

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats.make(
            "persistent", len(self._index), self.bytes, self.budget_bytes, c.hits, c.misses, c.evictions
        )
