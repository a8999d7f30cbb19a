"""Kept memory on disk: a conversation's whole memory, so reopening it (after a switch that left RAM, or a relaunch)
reads it back instead of recomputing it.

The compact `.spark` stays the durable record; an entry here is only an accelerator. It is a full `.spark` file
(engine.session.save's container: JSON + raw tensors, no compression, so reading costs a copy, not a codec) in the
cache folder, one per conversation, named by a hash of the conversation's file path (a name we choose; nothing read
from a file becomes a path). Before its memory is used it must match the compact record exactly: model fingerprint,
tokenizer, keys/values type, the backend's numerics and every token id (and the pending token). A damaged,
mismatched or stale entry is ignored (a damaged one deleted) and the caller recomputes as before.

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
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.backends.base import Backend
from engine.errors import SparkError
from engine.fileio import SYSTEM, FileSystem
from engine.memory.base import Memory
from engine.session.file import RECOMPUTE_KIND, TRANSCRIPT_KIND, SessionData, read_unchecked_state

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
        exactly; False (memory untouched or reset) otherwise, and the caller recomputes."""
        while (job := self.pending(conversation)) is not None:
            job.done.wait()  # its own copy is being written: reading it beats recomputing
        entry = self.entry_path(conversation)
        if not entry.is_file():
            return False
        try:
            kept = read_unchecked_state(entry)  # the container and metadata checked; the state by load_state below
        except (SparkError, OSError) as exc:
            log.info("kept memory for %s ignored (%s)", conversation.name, exc)
            entry.unlink(missing_ok=True)
            return False
        if not _matches(kept, record, backend):
            return False  # stale (the conversation went on elsewhere) or another model: rewritten or evicted later
        target = memory.state_target().cascade
        if target is not None and not pad_slots(kept.tensors, target.num_slots):
            entry.unlink(missing_ok=True)
            return False
        try:  # checks every value of the state before anything is written
            memory.load_state(kept.memory_meta, kept.tensors)
        except SparkError as exc:
            memory.reset()
            log.info("kept memory for %s ignored (%s)", conversation.name, exc)
            entry.unlink(missing_ok=True)
            return False
        if list(memory.tokens) != record.token_ids:
            memory.reset()
            return False
        with contextlib.suppress(OSError):
            os.utime(entry)  # recently used: the last to be evicted
        return True


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


def snapshot_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a memory's state to write while the memory goes on: each tensor copied once (the working ones
    without their trailing never-written slots), contiguous."""
    used = _used_slots(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if used is not None and name in SLOT_TENSORS:
            t = t[:, :, :used]
        out[name] = t.clone(memory_format=torch.contiguous_format)
    return out


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


def pad_slots(tensors: dict[str, torch.Tensor], num_slots: int) -> bool:
    """Pad trimmed working tensors back to this memory's `num_slots` (in place); False when they hold more."""
    for name in SLOT_TENSORS:
        t = tensors.get(name)
        if t is None or t.ndim != 4:
            return True  # not a cascade state: load_state's check names what is wrong
        if t.shape[2] > num_slots:
            return False
        if t.shape[2] < num_slots:
            pad = torch.zeros((*t.shape[:2], num_slots - t.shape[2], t.shape[3]), dtype=t.dtype)
            tensors[name] = torch.cat([t, pad], dim=2)
    return True
