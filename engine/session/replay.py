"""Compact sessions: record how a conversation's memory was fed, and rebuild that memory by feeding it again.

A memory's contents are a deterministic function of the model, the numerics and the exact sequence of feeds
(which tokens, in which chunks: a chunk's size changes the arithmetic's blocking, so it is part of the recipe)
plus the prefixes restored from the persistent cache. `FeedLog` records that sequence as a short run-length
schedule; `replay` repeats it on a fresh memory. A digest of the memory's tensors, taken when the file is saved,
tells on restore whether the rebuilt memory is bit for bit the one that was saved.

Schedule (JSON): a list of `[op, size, count]` runs, op "f" = `count` feeds of `size` tokens each, op "r" = `size`
tokens restored from the prefix cache (count 1), op "s" = one speculative verify forward of `size` tokens of which
the memory kept the first `count` (<= size; the rest were rejected drafts, taken back). A verify that kept every
token is not a feed of the same tokens: the memory records a verify's tokens as if fed one by one (the cascade's
routing query, engine.memory.base `rollback`). The kept tokens add up to the
memory's token count. A replayed verify feeds filler after the kept tokens: under the causal mask, and with every
row of a matrix product computed on its own, the kept tokens' KV does not depend on what follows them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.backends.base import Backend
from engine.errors import SessionFileError
from engine.generation.loop import (  # the very steps generation takes, so a replay computes what it computed
    feed_step,
    settle,
    verify_forward,
)
from engine.memory.base import Memory

Schedule = list[list[Any]]  # [[op ("f" | "r"), size, count], ...], as JSON holds it
MAX_RUNS = 1_000_000  # a schedule longer than this is not one this app wrote


@dataclass
class FeedLog:
    """The feed schedule of one memory since its last reset. `valid` turns False when a feed could not be
    attributed (then a compact save falls back to the full memory)."""

    runs: Schedule = field(default_factory=list)
    accounted: int = 0  # tokens the schedule covers
    valid: bool = True

    def clear(self) -> None:
        self.runs, self.accounted, self.valid = [], 0, True

    def record_feed(self, held_after_plan: int, n: int, verify: bool = False) -> None:
        """A forward of `n` tokens (`verify`: a speculative verify, engine.generation.loop.verify_forward);
        `held_after_plan` is the memory's token count with those `n` included."""
        back = self.accounted - (held_after_plan - n)
        if back > 0:  # the last forward was a verify whose rejected drafts the memory took back
            self.runs = self._taken_back(self.runs, back)
            self.accounted -= back
        reused = held_after_plan - n - self.accounted
        if reused < 0 or (not self.runs and back > 0):
            self.valid = False  # the memory was changed behind the log's back
            return
        if reused:
            self.runs.append(["r", reused, 1])
        if verify:
            self.runs.append(["s", n, n])  # kept whole until a later feed shows what was taken back
        elif self.runs and self.runs[-1][0] == "f" and self.runs[-1][1] == n:
            self.runs[-1][2] += 1
        else:
            self.runs.append(["f", n, 1])
        self.accounted = held_after_plan

    def schedule_for(self, held: int) -> Schedule | None:
        """The schedule covering a memory that holds `held` tokens, or None when it does not add up."""
        runs = [list(r) for r in self.runs]
        if self.valid and self.accounted - held > 0:  # the last verify's rejected drafts were taken back
            runs = self._taken_back(runs, self.accounted - held)
            return runs if runs else None
        if not self.valid or self.accounted != held:
            return None
        return runs

    @staticmethod
    def _taken_back(runs: Schedule, back: int) -> Schedule:
        """`runs` with their last verify keeping all but its last `back` tokens ([] when the last run is not a
        verify that kept that many)."""
        if not runs or runs[-1][0] != "s" or runs[-1][2] != runs[-1][1] or runs[-1][1] <= back:
            return []
        return [*runs[:-1], ["s", runs[-1][1], runs[-1][1] - back]]

    def adopt(self, schedule: Schedule, held: int) -> None:
        """After a restore: continue the restored memory's schedule."""
        self.runs, self.accounted, self.valid = [list(r) for r in schedule], held, True


def check_schedule(raw: object, tokens: int) -> Schedule:
    """A schedule read from a file, checked before anything runs; raises SessionFileError."""
    bad = SessionFileError("The session file's memory recipe is malformed; nothing was restored.")
    if not isinstance(raw, list) or len(raw) > MAX_RUNS:
        raise bad
    total, out = 0, []
    for run in raw:
        if not (isinstance(run, list) and len(run) == 3 and run[0] in ("f", "r", "s")):
            raise bad
        op, size, count = run
        if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (size, count)) or (
            (op == "r" and count != 1) or (op == "s" and count > size)
        ):
            raise bad
        total += count if op == "s" else size * count
        if total > tokens:
            raise bad
        out.append([op, size, count])
    if total != tokens:
        raise bad
    return out


def memory_digest(memory: Memory) -> str:
    """sha256 over the memory's tensors (names sorted): equal digests mean a bit-identical memory."""
    _, tensors = memory.state()
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        # The tensor's own bytes, not a copy: hashlib lets other threads run while it hashes a large buffer, so
        # saving the whole slot table does not stall the GUI thread.
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def replay(
    feed: Callable[[list[int], int, bool], None],
    memory: Memory,
    ids: Sequence[int],
    schedule: Schedule,
    on_progress: Callable[[int, int], None] | None = None,
    before: Callable[[int], None] | None = None,
) -> None:
    """Rebuild a memory holding `ids` by repeating `schedule` on the empty `memory`.

    `before(at)` runs before each step with the tokens fed so far, and once at the end (a conversation's
    attachments join the memory where they joined it when it was fed, engine.session.types.AttachmentRecord).

    `feed(piece, keep, verify)` runs one forward of `piece` (engine.generation.loop's step, through the session's
    backend; a speculative verify when `verify`) and keeps its first `keep` tokens (all but a verify's rejected
    drafts). A prefix
    that came from the persistent cache is taken from it again when it is still there, else computed in chunks
    of at most the memory's largest feed (then the digest check may report a difference).
    """
    at, total = 0, len(ids)
    # A memory whose reuse_prefix takes a prompt (less its last token) restores exactly a known prefix by its own name.
    restore: Callable[[list[int]], int] = getattr(memory, "restore_prefix", memory.reuse_prefix)
    for op, size, count in schedule:
        for _ in range(1 if op == "s" else count):
            if before is not None:
                before(at)
            if op == "r":
                got = min(restore(list(ids[at : at + size])), size)
                step = max(1, memory.max_feed())
                pos = at + got
                while pos < at + size:
                    end = min(pos + step, at + size)
                    feed(list(ids[pos:end]), end - pos, False)
                    pos = end
            elif op == "s":
                kept = list(ids[at : at + count])
                feed(kept + [kept[-1]] * (size - count), count, True)  # filler where the rejected drafts were
            else:
                feed(list(ids[at : at + size]), size, False)
            at += count if op == "s" else size
            if on_progress is not None:
                on_progress(at, total)
    if before is not None:
        before(at)


def backend_feed(backend: Backend, memory: Memory) -> Callable[[list[int], int, bool], None]:
    """One forward of a piece keeping its first `keep` tokens, exactly as generation does it (a plain step, or a
    speculative verify and the taking back of its rejected drafts)."""

    def feed(piece: list[int], keep: int, verify: bool) -> None:
        if not verify:
            feed_step(backend, memory, piece)
        else:
            verify_forward(backend, memory, piece)
            settle(memory, len(piece) - keep)

    return feed
