"""Kept memory on disk: a conversation's whole memory, so reopening it (after a switch that left RAM, or a relaunch)
reads it back instead of recomputing it.

The compact `.spark` stays the durable record; an entry here is only an accelerator. It is a full `.spark` file
(engine.session.save's container: JSON + raw tensors, no compression, so reading costs a copy, not a codec) in the
cache folder, one per conversation, named by a hash of the conversation's file path (a name we choose; nothing read
from a file becomes a path). Before its memory is used it must match the compact record exactly: model fingerprint,
tokenizer, keys/values type, the backend's numerics and every token id (and the pending token). A damaged,
mismatched or stale entry is ignored (a damaged one deleted) and the caller recomputes as before.

An entry is read in part (`EntryFile`), so a long conversation reopens as fast as a short one: the state's small
part (sinks, window, the block index, routing) at once, checked against the entry's state digest; each episodic
block by offset when retrieval first asks for it, checked against its own digest (engine.memory.cascade.episodic's
paged blocks). The file stays open meanwhile, so evicting or rewriting the entry changes nothing for the open
conversation. Keeping that memory again reads its unchanged blocks on the writer thread, not the worker's.

The folder has a byte budget (the user's, in Settings): room is made before an entry is written by deleting the
least recently used whole entries; an entry that alone exceeds the budget is not written. Clearing it loses no
conversation (they recompute).

`write_later` writes on one background thread (one write at a time; a newer snapshot of a conversation replaces its
queued one), so the caller never waits for the disk. The bytes of the write in flight count against the budget
until it lands. `close` waits a bounded time for the queue and otherwise abandons it: queued writes are dropped and
the one in flight stops at its next chunk, its temp file removed at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.backends.base import Backend
from engine.errors import SessionFileError, SparkError
from engine.fileio import SYSTEM, FileSystem, HeaderError, TensorSpan, header_length, parse_header
from engine.memory.base import Memory
from engine.memory.cascade import CascadeMemory
from engine.memory.cascade.episodic import PagedBlocks
from engine.memory.states import SchemaError, check_memory_state
from engine.session.container import MAX_FILE_BYTES, TENSOR_LIMITS, bad, read_layout
from engine.session.file import RECOMPUTE_KIND, TRANSCRIPT_KIND, SessionData, session_fields

log = logging.getLogger(__name__)

DEFAULT_KEPT_BUDGET_BYTES = 4 * 1024**3  # "a few GB": room for tens of long conversations of the default model
ENTRY_SUFFIX = ".kept"
WRITE_SLICE = 8 * 1024**2  # an abandoned write stops within this many bytes

Save = Callable[[Path, FileSystem], int]  # writes the full `.spark` at the path through the file system given


def entry_estimate(state_bytes: int, tokens: int) -> int:
    """An entry's size before it is written: its tensors, and its JSON (token ids twice, a few bytes each)."""
    return state_bytes + 65536 + 32 * tokens


@dataclass(frozen=True)
class KeptUsage:
    entries: int
    bytes: int
    budget_bytes: int


class WriteAbandoned(OSError):
    """The kept-memory writer was closed while this write was in flight."""


class _AbandonableFs(FileSystem):
    """The writer's file system: records the temp files it makes, and fails every call once abandoned (so the
    durable write removes its temp file and stops), writing at most WRITE_SLICE bytes a call."""

    def __init__(self, inner: FileSystem, lock: threading.Lock) -> None:
        self._inner = inner
        self._lock = lock
        self.abandoned = False
        self.temps: set[str] = set()

    def _check(self) -> None:
        if self.abandoned:
            raise WriteAbandoned("the kept-memory write was abandoned at quit")

    def mkstemp(self, folder: Path, prefix: str, suffix: str) -> tuple[int, str]:
        with self._lock:  # abandoning removes the temps recorded so far: none may appear after it
            self._check()
            fd, tmp = self._inner.mkstemp(folder, prefix, suffix)
            self.temps.add(tmp)
            return fd, tmp

    def write(self, fd: int, data: memoryview) -> int:
        self._check()
        return self._inner.write(fd, data[:WRITE_SLICE])

    def fsync(self, fd: int) -> None:
        self._check()
        self._inner.fsync(fd)

    def open(self, path: str | Path, flags: int) -> int:
        return self._inner.open(path, flags)

    def close(self, fd: int) -> None:
        self._inner.close(fd)

    def replace(self, src: str | Path, dst: str | Path) -> None:
        self._check()
        self._inner.replace(src, dst)

    def rename(self, src: str | Path, dst: str | Path) -> None:
        self._check()
        self._inner.rename(src, dst)

    def unlink(self, path: str | Path) -> None:
        self._inner.unlink(path)


@dataclass
class _Job:
    conversation: Path
    estimate: int
    save: Save
    discarded: bool = False  # the conversation was deleted meanwhile: what lands is removed
    done: threading.Event = field(default_factory=threading.Event)


class KeptMemory:
    """The kept-memory folder under `budget_bytes` (changeable: `set_budget` trims at once). `fs` is the file system
    the writes go through (tests slow or fail it)."""

    def __init__(self, folder: Path, budget_bytes: int = DEFAULT_KEPT_BUDGET_BYTES, fs: FileSystem = SYSTEM) -> None:
        self.folder = folder
        self.budget_bytes = max(0, budget_bytes)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._fs = _AbandonableFs(fs, self._lock)
        self._queue: OrderedDict[Path, _Job] = OrderedDict()  # entry path -> newest snapshot waiting to be written
        self._writing: _Job | None = None
        self._reserved = 0  # bytes of the write in flight, counted against the budget until it lands
        self._room = threading.RLock()  # one eviction pass at a time (writer thread and GUI's set_budget/clear)
        self._thread: threading.Thread | None = None
        self._closed = False

    def entry_path(self, conversation: Path) -> Path:
        """Where `conversation`'s (a `.spark` path's) memory is kept: a hash of its absolute path."""
        key = hashlib.sha256(str(conversation.expanduser().absolute()).encode("utf-8")).hexdigest()[:32]
        return self.folder / f"{key}{ENTRY_SUFFIX}"

    # -- budget ------------------------------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry, least recently used first."""
        rows: list[tuple[float, int, Path]] = []
        try:
            names = list(self.folder.iterdir())
        except OSError:
            return rows
        for p in names:
            if p.suffix != ENTRY_SUFFIX:
                continue
            try:
                st = p.stat()
            except OSError:
                continue
            rows.append((st.st_mtime, st.st_size, p))
        rows.sort()
        return rows

    def usage(self) -> KeptUsage:
        rows = self._entries()
        return KeptUsage(len(rows), sum(size for _, size, _ in rows), self.budget_bytes)

    def set_budget(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, budget_bytes)
        self._make_room(0, keep=None)

    def clear(self) -> int:
        """Delete every entry (and drop the queued writes); returns the bytes freed."""
        with self._lock:
            for job in self._queue.values():
                job.done.set()
            self._queue.clear()
            if self._writing is not None:
                self._writing.discarded = True
        freed = 0
        for _, size, p in self._entries():
            p.unlink(missing_ok=True)
            freed += size
        return freed

    def discard(self, conversation: Path) -> None:
        """Forget `conversation`'s kept memory (it was deleted, or it holds nothing): its entry, its queued write,
        and what its write in flight would leave."""
        entry = self.entry_path(conversation)
        with self._lock:
            job = self._queue.pop(entry, None)
            if job is not None:
                job.done.set()
            if self._writing is not None and self.entry_path(self._writing.conversation) == entry:
                self._writing.discarded = True
        entry.unlink(missing_ok=True)

    def _make_room(self, needed: int, keep: Path | None) -> bool:
        """Delete least recently used entries (never `keep`) until `needed` more bytes (beside the write in flight)
        fit the budget."""
        with self._room:
            if needed + self._reserved > self.budget_bytes:
                return False
            rows = [r for r in self._entries() if r[2] != keep]
            used = sum(size for _, size, _ in rows) + self._reserved
            for _, size, p in rows:
                if used + needed <= self.budget_bytes:
                    break
                p.unlink(missing_ok=True)
                used -= size
            return used + needed <= self.budget_bytes

    # -- entries -----------------------------------------------------------------------------------------------------
    def write(self, conversation: Path, estimate: int, save: Save) -> bool:
        """Keep a conversation's memory now: `save(path, fs)` writes the full `.spark` (Session.keep). Room is made
        first for `estimate` bytes (`entry_estimate`); False when it would not fit."""
        entry = self.entry_path(conversation)
        entry.unlink(missing_ok=True)  # the old version's bytes count for nothing while the new one is written
        with self._room:
            if not self._make_room(estimate, keep=None):
                return False
            self._reserved = estimate
        with self._lock:
            self._fs.temps.clear()  # only this write's temp files are left to remove if it is abandoned
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            save(entry, self._fs)
        except (SparkError, OSError) as exc:
            log.info("kept memory not written (%s)", exc)
            entry.unlink(missing_ok=True)
            return False
        finally:
            with self._room:
                self._reserved = 0
        if not self._make_room(0, keep=entry):  # larger than estimated and over: the new entry goes too
            entry.unlink(missing_ok=True)
            return False
        return True

    def write_later(self, conversation: Path, estimate: int, save: Save) -> bool:
        """Queue `write` for the background writer; a newer snapshot of the same conversation replaces a queued one.
        False once closed."""
        entry = self.entry_path(conversation)
        with self._lock:
            if self._closed:
                return False
            old = self._queue.pop(entry, None)
            if old is not None:
                old.done.set()
            self._queue[entry] = _Job(conversation, estimate, save)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kept-memory-writer", daemon=True)
                self._thread.start()
            self._wake.notify_all()
        return True

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                _, job = self._queue.popitem(last=False)
                self._writing = job
            try:
                self.write(job.conversation, job.estimate, job.save)
            except Exception:  # an accelerator only: a failed copy costs a recompute
                log.exception("keeping the memory on disk failed")
            finally:
                with self._lock:
                    self._writing = None
                    if job.discarded:
                        self.entry_path(job.conversation).unlink(missing_ok=True)
                    job.done.set()
                    self._wake.notify_all()

    def pending(self, conversation: Path) -> _Job | None:
        """The queued or in-flight write of `conversation`, if any."""
        entry = self.entry_path(conversation)
        with self._lock:
            if self._writing is not None and self.entry_path(self._writing.conversation) == entry:
                return self._writing
            return self._queue.get(entry)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has landed; False when `timeout` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._queue or self._writing is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """No more writes: wait up to `timeout` seconds for the queue, then abandon what is left (queued writes
        dropped, the one in flight stopped and its temp file removed). True when everything landed."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self.flush(timeout):
            return True
        with self._lock:
            self._fs.abandoned = True
            for job in self._queue.values():
                job.done.set()
            self._queue.clear()
            for tmp in self._fs.temps:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # the writer's next call fails; its data goes to an unlinked file
        log.info("kept-memory write abandoned at quit")
        return False

    def read_into(self, conversation: Path, record: SessionData, memory: Memory, backend: Backend) -> bool:
        """Restore `conversation`'s kept memory into the fresh `memory` when its entry matches the compact `record`
        exactly; False (memory untouched or reset) otherwise, and the caller recomputes. A cascade's episodic blocks
        stay in the entry, paged in when first needed (`EntryFile`)."""
        while (job := self.pending(conversation)) is not None:
            job.done.wait()  # its own copy is being written: reading it beats recomputing
        entry = self.entry_path(conversation)
        if not entry.is_file():
            return False
        try:
            opened = EntryFile.open(entry)
        except (SparkError, OSError) as exc:
            log.info("kept memory for %s ignored (%s)", conversation.name, exc)
            entry.unlink(missing_ok=True)
            return False
        try:
            if not _matches(opened.data, record, backend):
                return False  # stale (the conversation went on elsewhere) or another model: rewritten or evicted later
            target = memory.state_target()
            slots = None if target.cascade is None else target.cascade.num_slots
            try:  # names and shapes first, so nothing is read that the model would not hold
                check_memory_state(opened.data.memory_meta, _padded_shapes(opened.shapes(), slots), target)
            except SchemaError as exc:
                raise SessionFileError(f"its state {exc}") from None
            tensors = opened.state_tensors()  # checked against the entry's state digest
            if slots is not None and not pad_slots(tensors, slots):
                raise SessionFileError("its working memory holds more slots than this memory has")
            meta = opened.data.memory_meta
            # Every value of the state is checked before anything is written (blocks as shapes; each block's bytes
            # are checked when it is read).
            if isinstance(memory, CascadeMemory):
                memory.load_state(meta, tensors, paged=opened)
            else:
                memory.load_state(meta, tensors)
        except (SparkError, OSError) as exc:
            memory.reset()
            log.info("kept memory for %s ignored (%s)", conversation.name, exc)
            opened.discard()
            return False
        if list(memory.tokens) != record.token_ids:
            memory.reset()
            return False
        with contextlib.suppress(OSError):
            os.utime(entry)  # recently used: the last to be evicted
        return True


# What an entry holds beside its state so that it can be read in part (extra["kept"]): a digest over the state's
# metadata and every tensor but the episodic blocks, checked when the entry is opened, and one per block (the sha256
# of its k, v bytes: engine.memory.cascade.episodic.content_digest), checked when the block is first read.
DIGESTS_FORMAT = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")
_BLOCK_TENSOR = re.compile(r"ep\.(\d{1,15})\.([kv])")


class KeptEntryDamaged(SessionFileError):
    """A kept entry failed one of its checks."""


def _canonical(meta: Any) -> bytes:
    return json.dumps(meta, sort_keys=True, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


# The writer thread copies and hashes through numpy and hashlib, not torch: a daemon thread stopped inside torch's C++
# by the interpreter's exit (a write abandoned at quit) aborts the process.
def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A host tensor's values as one contiguous numpy array (a copy only when `t` is a strided view)."""
    return np.ascontiguousarray(t.detach().numpy())


def _kv_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """engine.memory.cascade.episodic.content_digest's sha256 of a block's k, v bytes."""
    h = hashlib.sha256(_host_bytes(k).reshape(-1).view(np.uint8).data)
    h.update(_host_bytes(v).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def state_digest(meta: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the state's metadata and every tensor but the episodic blocks (name, dtype, shape, bytes)."""
    h = hashlib.sha256(_canonical(meta))
    for name in sorted(tensors):
        if _BLOCK_TENSOR.fullmatch(name):
            continue
        t = tensors[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_host_bytes(t).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def entry_state(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor], paged: Mapping[int, PagedBlocks]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """On the writer's thread: the state's tensors with its paged blocks read in from the entry they were opened
    from (unchanged since, so not snapshotted again), and the digests the entry keeps (`extra["kept"]`)."""
    full = {name: torch.from_numpy(_host_bytes(t)) for name, t in tensors.items()}  # the trimmed views made whole
    blocks: dict[str, str] = {}
    for bid, source in paged.items():
        kv = source.read(bid)
        if kv is None:
            raise KeptEntryDamaged("a block of the kept memory it was opened from failed its check")
        full[f"ep.{bid}.k"], full[f"ep.{bid}.v"] = kv
        if isinstance(source, EntryFile):
            blocks[str(bid)] = source.digests[bid]
    for name in full:
        m = _BLOCK_TENSOR.fullmatch(name)
        if m and m.group(2) == "k" and m.group(1) not in blocks:
            blocks[m.group(1)] = _kv_digest(full[name], full[f"ep.{m.group(1)}.v"])
    digests = {"format": DIGESTS_FORMAT, "state": state_digest(meta, full), "blocks": blocks}
    return full, digests


class EntryFile:
    """A kept entry opened for reading in part (engine.memory.cascade.episodic.PagedBlocks): its metadata and the
    state's small tensors read and checked at once, its episodic blocks read by offset when first needed, each
    checked against its digest. The file stays open until no block is left paged in it, so an entry evicted or
    rewritten meanwhile (both remove or replace the name, never the bytes) still reads back the same."""

    def __init__(
        self,
        path: Path,
        fd: int,
        data: SessionData,
        spans: dict[str, TensorSpan],
        base: int,
        digests: dict[int, str],
        state: str,
    ) -> None:
        self.path = path
        self.data = data
        self.digests = digests
        self._fd = fd
        self._spans = spans  # offsets into the tensor section, checked to tile it exactly
        self._base = base  # where the tensor section starts in the file
        self._state = state
        self._inode = os.fstat(fd)[1:3]
        self._closer = weakref.finalize(self, os.close, fd)

    @classmethod
    def open(cls, path: Path) -> EntryFile:
        """Open and check everything but the blocks' bytes: the container's layout, the metadata (the session
        schema), the tensor table (every span inside the section, tiling it) and the digests' form."""
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if not 0 < size <= MAX_FILE_BYTES:
                    raise bad(path, f"is {size} bytes, not what this build writes")
                pre = read_layout(f, path, size)
                if pre.compression != "none":
                    raise bad(path, "is compressed, so it cannot be read in part")
                f.seek(pre.size)
                raw = f.read(pre.meta_len)
                if len(raw) != pre.meta_len:
                    raise bad(path, "changed while it was being read")
                fields = session_fields(path, pre, raw)
                base = pre.size + pre.meta_len
                first8 = f.read(8)
                n = header_length(first8, pre.tensor_len, TENSOR_LIMITS)
                table = f.read(n)
                if len(table) != n:
                    raise bad(path, "changed while it was being read")
            spans = parse_header(table, pre.tensor_len, TENSOR_LIMITS).tensors
            data = SessionData(
                format_version=pre.version, tensors={}, compression=pre.compression, file_bytes=size, **fields
            )
            digests, state = _entry_digests(path, data.extra.get("kept"), spans)
            return cls(path, fd, data, spans, base, digests, state)
        except HeaderError:
            os.close(fd)
            raise bad(path, "has an unreadable tensor table") from None
        except BaseException:
            os.close(fd)
            raise

    def _bytes(self, span: TensorSpan) -> bytearray:
        buf = bytearray(span.nbytes)
        view, at = memoryview(buf), 0
        while at < len(buf):
            got = os.preadv(self._fd, [view[at:]], self._base + span.start + at)
            if got <= 0:
                raise KeptEntryDamaged(f"The kept memory {self.path.name} is shorter than its table says.")
            at += got
        return buf

    def _read(self, span: TensorSpan) -> torch.Tensor:
        buf = self._bytes(span)
        if not buf:
            return torch.empty(span.shape, dtype=span.torch_dtype)
        return torch.frombuffer(buf, dtype=span.torch_dtype).reshape(span.shape)

    def where(self, name: str) -> range:
        """The bytes of tensor `name` in the file (for a reader that shows or checks them)."""
        span = self._spans[name]
        return range(self._base + span.start, self._base + span.end)

    @property
    def names(self) -> list[str]:
        return list(self._spans)

    def shapes(self) -> dict[str, torch.Tensor]:
        """Every tensor as its shape and dtype only ("meta" tensors, no values)."""
        return {n: torch.empty(s.shape, dtype=s.torch_dtype, device="meta") for n, s in self._spans.items()}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The state's tensors: read and checked against the state digest, the blocks' as shapes only ("meta")."""
        tensors: dict[str, torch.Tensor] = {}
        for name, span in self._spans.items():
            if _BLOCK_TENSOR.fullmatch(name):
                tensors[name] = torch.empty(span.shape, dtype=span.torch_dtype, device="meta")
            else:
                tensors[name] = self._read(span)
        if not hmac.compare_digest(state_digest(self.data.memory_meta, tensors), self._state):
            raise KeptEntryDamaged(f"The kept memory {self.path.name} does not match its digest.")
        return tensors

    def read(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block `block_id`'s k, v, checked against its digest and for finite values; None (the entry set aside
        and the next reopen recomputing) when they fail."""
        try:  # also on the writer's thread: numpy and hashlib, no torch operation (see _host_bytes)
            spans = self._spans[f"ep.{block_id}.k"], self._spans[f"ep.{block_id}.v"]
            k, v = (self._bytes(span) for span in spans)
        except (KeyError, OSError, SparkError) as exc:
            self._damaged(str(exc))
            return None
        h = hashlib.sha256(k)
        h.update(v)
        arrays = [np.frombuffer(b, dtype=np.float16).reshape(span.shape) for b, span in zip((k, v), spans, strict=True)]
        if h.hexdigest() != self.digests.get(block_id) or not all(bool(np.isfinite(a).all()) for a in arrays):
            self._damaged(f"episodic block {block_id} failed its check")
            return None
        return torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1])

    def _damaged(self, why: str) -> None:
        log.warning(
            "the kept memory %s is damaged (%s): its block is forgotten, the entry deleted", self.path.name, why
        )
        self.discard()

    def discard(self) -> None:
        """Delete the entry on disk, if it is still the one opened (not a newer copy written since)."""
        with contextlib.suppress(OSError):
            if os.stat(self.path)[1:3] == self._inode:
                self.path.unlink()


def _entry_digests(path: Path, value: Any, spans: Mapping[str, TensorSpan]) -> tuple[dict[int, str], str]:
    """The digests an entry keeps, in form and covering exactly its blocks (`extra["kept"]`)."""
    if not isinstance(value, dict) or value.get("format") != DIGESTS_FORMAT:
        raise bad(path, "was kept by another build (no digests to read it in part)")
    state, blocks = value.get("state"), value.get("blocks")
    if not isinstance(state, str) or not _HEX64.fullmatch(state) or not isinstance(blocks, dict):
        raise bad(path, "has malformed digests")
    ids = {int(m.group(1)) for name in spans if (m := _BLOCK_TENSOR.fullmatch(name))}
    digests: dict[int, str] = {}
    for key, digest in blocks.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 15) or not (
            isinstance(digest, str) and _HEX64.fullmatch(digest)
        ):
            raise bad(path, "has malformed digests")
        digests[int(key)] = digest
    if set(digests) != ids or any(f"ep.{i}.{p}" not in spans for i in ids for p in "kv"):
        raise bad(path, "has digests that do not cover its blocks")
    return digests, state


def _matches(kept: SessionData, record: SessionData, backend: Backend) -> bool:
    kind = kept.memory_meta.get("kind")
    return (
        kind not in (RECOMPUTE_KIND, TRANSCRIPT_KIND)
        and kept.fingerprint == record.fingerprint == backend.fingerprint
        and kept.kv_type == record.kv_type == backend.kv_type.value
        and kept.tokenizer_hash == record.tokenizer_hash
        and kept.extra.get("numerics") == backend.numerics
        and kept.token_ids == record.token_ids
        and kept.pending_token == record.pending_token
    )


# The working tier's slot table (engine.memory.cascade.core's state: "wk.k", "wk.v", (L, Hkv, S, D)) is kept without
# its trailing slots that hold nothing (all bits zero: never written), so a conversation shorter than the window
# keeps only what it wrote; reading pads them back, the same bits.
SLOT_TENSORS = ("wk.k", "wk.v")


@dataclass(frozen=True)
class Snapshot:
    """A memory's state taken on the worker to be written later: `meta` and `tensors` are the state's own (the
    working tensors trimmed of never-written slots), and `paged` the blocks still in the kept file they were
    opened from, read by the writer (`entry_state`)."""

    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    paged: dict[int, PagedBlocks]
    bytes: int


def take_snapshot(memory: Memory) -> Snapshot:
    """Memory.state() gives tensors of its own (read back from the slot table, copied, or a block's KV, which never
    changes once formed), so nothing is copied again here: the working tensors lose their trailing never-written
    slots (a view; the writer makes it contiguous) and paged blocks stay where they are."""
    paged: dict[int, PagedBlocks] = {}
    meta, tensors = memory.state(paged) if isinstance(memory, CascadeMemory) else memory.state()
    used = _used_slots(tensors)
    if used is not None:
        for name in SLOT_TENSORS:
            tensors[name] = tensors[name][:, :, :used]
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if isinstance(memory, CascadeMemory):
        size += len(paged) * memory.episodic.block_bytes
    return Snapshot(meta, tensors, paged, size)


def _used_slots(tensors: dict[str, torch.Tensor]) -> int | None:
    """How many leading slots of the working tensors were ever written (None: not a cascade state)."""
    if not all(name in tensors and tensors[name].ndim == 4 for name in SLOT_TENSORS):
        return None
    slots = min(tensors[name].shape[2] for name in SLOT_TENSORS)
    written = _written(tensors[SLOT_TENSORS[0]][:, :, :slots]) | _written(tensors[SLOT_TENSORS[1]][:, :, :slots])
    found = torch.nonzero(written)
    return int(found[-1]) + 1 if found.numel() else 0


def _written(part: torch.Tensor) -> torch.Tensor:
    """(slots,) bool: which slots of an (L, Hkv, slots, D) tensor hold any nonzero bit. Read as 8-byte words in
    place where the rows allow it (no copy, an eighth of the comparisons), else as bytes; one reduction (a chain of
    them costs several times as much on a busy machine)."""
    if part.stride(-1) == 1 and (part.shape[-1] * part.element_size()) % 8 == 0:
        words = part.view(torch.int64)
    else:
        words = part.contiguous().view(torch.uint8)
    return words.ne(0).to(torch.uint8).amax(dim=(0, 1, 3)).bool()


def _padded_shapes(shapes: dict[str, torch.Tensor], num_slots: int | None) -> dict[str, torch.Tensor]:
    """`shapes` ("meta" tensors) with the trimmed working tensors at the `num_slots` reading pads them to."""
    for name in SLOT_TENSORS:
        t = shapes.get(name)
        if num_slots is not None and t is not None and t.ndim == 4 and t.shape[2] <= num_slots:
            shapes[name] = torch.empty((*t.shape[:2], num_slots, t.shape[3]), dtype=t.dtype, device="meta")
    return shapes


def pad_slots(tensors: dict[str, torch.Tensor], num_slots: int) -> bool:
    """Pad trimmed working tensors back to this memory's `num_slots` (in place); False when they hold more."""
    for name in SLOT_TENSORS:
        t = tensors.get(name)
        if t is None or t.ndim != 4:
            return True  # not a cascade state: load_state's check names what is wrong
        if t.shape[2] > num_slots:
            return False
        if t.shape[2] < num_slots:  # one zeroed table and one copy (a concatenation costs a second pass)
            full = t.new_zeros((*t.shape[:2], num_slots, t.shape[3]))
            full[:, :, : t.shape[2]] = t
            tensors[name] = full
    return True
