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
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.backends.base import Backend
from engine.errors import SparkError
from engine.memory.base import Memory
from engine.session.file import RECOMPUTE_KIND, TRANSCRIPT_KIND, SessionData, read_unchecked_state

log = logging.getLogger(__name__)

DEFAULT_KEPT_BUDGET_BYTES = 4 * 1024**3  # "a few GB": room for tens of long conversations of the default model
ENTRY_SUFFIX = ".kept"


def entry_estimate(state_bytes: int, tokens: int) -> int:
    """An entry's size before it is written: its tensors, and its JSON (token ids twice, a few bytes each)."""
    return state_bytes + 65536 + 32 * tokens


@dataclass(frozen=True)
class KeptUsage:
    entries: int
    bytes: int
    budget_bytes: int


class KeptMemory:
    """The kept-memory folder under `budget_bytes` (changeable: `set_budget` trims at once)."""

    def __init__(self, folder: Path, budget_bytes: int = DEFAULT_KEPT_BUDGET_BYTES) -> None:
        self.folder = folder
        self.budget_bytes = max(0, budget_bytes)

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
        """Delete every entry; returns the bytes freed."""
        freed = 0
        for _, size, p in self._entries():
            p.unlink(missing_ok=True)
            freed += size
        return freed

    def discard(self, conversation: Path) -> None:
        self.entry_path(conversation).unlink(missing_ok=True)

    def _make_room(self, needed: int, keep: Path | None) -> bool:
        """Delete least recently used entries (never `keep`) until `needed` more bytes fit the budget."""
        if needed > self.budget_bytes:
            return False
        rows = [r for r in self._entries() if r[2] != keep]
        used = sum(size for _, size, _ in rows)
        for _, size, p in rows:
            if used + needed <= self.budget_bytes:
                break
            p.unlink(missing_ok=True)
            used -= size
        return used + needed <= self.budget_bytes

    # -- entries -----------------------------------------------------------------------------------------------------
    def write(self, conversation: Path, estimate: int, save: Callable[[Path], int]) -> bool:
        """Keep a conversation's memory: `save(path)` writes the full `.spark` (engine.session.engine.Session.keep).
        Room is made first for `estimate` bytes (`entry_estimate`); False when it would not fit."""
        entry = self.entry_path(conversation)
        entry.unlink(missing_ok=True)  # the old version's bytes count for nothing while the new one is written
        if not self._make_room(estimate, keep=None):
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            save(entry)
        except (SparkError, OSError) as exc:
            log.info("kept memory not written (%s)", exc)
            entry.unlink(missing_ok=True)
            return False
        if not self._make_room(0, keep=entry):  # larger than estimated and over: the new entry goes too
            entry.unlink(missing_ok=True)
            return False
        return True

    def read_into(self, conversation: Path, record: SessionData, memory: Memory, backend: Backend) -> bool:
        """Restore `conversation`'s kept memory into the fresh `memory` when its entry matches the compact `record`
        exactly; False (memory untouched or reset) otherwise, and the caller recomputes."""
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


def trim_slots(tensors: dict[str, torch.Tensor]) -> None:
    """Drop the trailing all-zero slots the working tensors share (in place)."""
    if not all(name in tensors and tensors[name].ndim == 4 for name in SLOT_TENSORS):
        return
    used = 0
    for name in SLOT_TENSORS:
        t = tensors[name]
        bits = t.contiguous().view(torch.uint8).reshape(t.shape[0] * t.shape[1], t.shape[2], -1)
        written = torch.nonzero(bits.any(dim=2).any(dim=0))
        used = max(used, int(written[-1]) + 1 if written.numel() else 0)
    for name in SLOT_TENSORS:
        tensors[name] = tensors[name][:, :, :used].contiguous()


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
