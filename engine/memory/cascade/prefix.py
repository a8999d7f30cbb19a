"""Prefix reuse through the persistent tier (L3): exact prefix blocks and cascade snapshots.

Exact prefix blocks. "Prefix" means tokens whose KV equals full attention's: those fed before anything ever left
the window (a forward that evicts computes its own tokens with a truncated context). While the conversation is in
that pure-prefix phase, each newly completed block-aligned block is persisted keyed by the digest of the whole
token prefix through it; on an empty memory the longest chain of such blocks is restored (at most sinks + window
tokens).

Cascade snapshots, for prompts longer than that. Past the first eviction KV depends on the cascade (what was in
the window, which blocks were retrieved, how the prompt was chunked), so single blocks cannot be reused; the whole
memory state can, when it is the state a cold read of the new prompt passes through. Reuse never changes what the
memory holds, whatever the store has (a restored session re-reading its conversation continues as the original,
though only the original's cache knows its first prompt), so with a store a prompt read into an empty memory
(`fresh`) is chunked on a grid that does not depend on where the prompt ends:
  - a cut at F = sinks + window, the first eviction: exact blocks reused up to n <= F are full attention's KV
    however they were chunked, and every read chunks the evicting part from F on;
  - cuts at every grid point G = F + k * GRID_STEP past it, so the chunks between them do not depend on where the
    read started either;
  - the snapshot at the last grid point S before the prompt's tail (the last `tail` tokens, which the cascade
    chunks by the prompt's end, engine.memory.cascade.core), stored under key(model, numerics, "snapshot-" +
    CascadeConfig.state_tag(), digest of tokens[:S]).
A cold read of any longer prompt then holds exactly that state at S (same chunks before it), and the reused one
chunks the rest as the cold one does. On an empty memory the grid points are tried from the last one before the
prompt's tail down; the first snapshot that loads is restored, and only when none does the exact blocks are tried.
A snapshot is taken only of a fresh read, never in a later turn, whose state depends on how the conversation was
fed (replies token by token). The cost is recomputing up to GRID_STEP + tail tokens of a repeated prompt; the
cuts are only made with a store, so runs without the prefix cache chunk as before.
- Budgets are not part of the key (CascadeConfig.state_settings): a snapshot restores under this memory's budgets,
  as a session file does (engine.memory.cascade.episodic brings its blocks within the episodic budget).
- Storage: resident episodic blocks are not stored inside the snapshot but as content-addressed "kv" entries,
  referenced by the block's l3_key in the snapshot's meta. Successive snapshots of a growing conversation (one per
  prompt) share every block they have in common, and a later spill of such a block finds its KV already on disk.
  A snapshot is written after its blocks; one whose block has gone (budget) or fails its checks is not restored
  (the store counts a miss, corrupt entries are dropped with a warning).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.errors import SparkError
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.episodic import EpisodicMemory
from engine.memory.cascade.persistent import PersistentStore
from engine.memory.cascade.state_schema import CASCADE_STATE_VERSION, check_cascade_state
from engine.memory.values import SchemaError, StateTarget

KV = tuple[torch.Tensor, torch.Tensor]  # k, v (L, Hkv, n, D)
GRID_STEP = 256  # the default prefill chunk (engine.generation.loop): with it the grid's cuts cost no extra forward


def token_bytes(ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes: what prefix digests are computed over, on every machine."""
    return np.asarray(ids, dtype="<i4").tobytes()


@dataclass
class Snapshot:
    """A stored memory state that loaded and passed its checks, with its resident blocks' KV filled in."""

    tokens: int  # how many leading tokens of the prompt it holds
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    refs: dict[int, str]  # episodic block id -> the L3 key its KV was read from


class PrefixCache:
    """The running digest of a memory's tokens and what it keys in L3 (a no-op without a store)."""

    def __init__(self, store: PersistentStore | None, cfg: CascadeConfig) -> None:
        self.store = store
        self.cfg = cfg
        self.snapshot_tag = f"snapshot-{cfg.state_tag()}"
        self.first_eviction = cfg.sink_tokens + cfg.window
        self.grid_step = max(cfg.block_size, min(cfg.window, GRID_STEP) // cfg.block_size * cfg.block_size)
        self.reset()

    def reset(self) -> None:
        self.hasher = hashlib.sha256()  # running digest of every token fed (content address of the prefix)
        self._before_feed = self.hasher.copy()  # the digest before the last feed (take_back)
        self.prefix_digests: dict[int, str] = {}  # block-aligned end index -> prefix digest, until persisted
        self.open = True  # nothing has left the window yet: every KV so far equals full attention's
        self.persisted = 0  # tokens [0, persisted) are in L3 as exact prefix blocks
        self.snapshot_at: int | None = None  # snapshot the state when this many tokens are in (see cut)
        # How many tokens the memory holds as a cold read would (0 when empty, n after reusing n); None once it
        # holds anything else (a prompt was read, a session restored): only such a memory reads `fresh` (see cut).
        self.canonical: int | None = 0

    def feed(self, ids: list[int], start: int) -> None:
        """Extend the running digest by ids (absolute indices start..), recording the digests at block-aligned
        ends that are still to be persisted (in the pure prefix, with a store)."""
        b, end = self.cfg.block_size, start + len(ids)
        self._before_feed = self.hasher.copy()  # what take_back returns to
        data = token_bytes(ids)
        at = start
        if self.store is not None and self.open:
            for e in range(max(self.persisted, start) // b * b + b, end + 1, b):
                self.hasher.update(data[4 * (at - start) : 4 * (e - start)])
                at = e
                self.prefix_digests[e] = self.hasher.copy().hexdigest()
        self.hasher.update(data[4 * (at - start) :])

    def take_back(self, kept: list[int], start: int) -> None:
        """The last feed (of ids from absolute index `start`) is to hold only its first tokens, `kept`: the digest
        and the block digests to persist are as if only those were fed."""
        self.hasher = self._before_feed
        end = start + len(kept)
        for e in [e for e in self.prefix_digests if e > end]:
            del self.prefix_digests[e]
        self.feed(kept, start)

    def close(self) -> None:
        """Something left the window: from here on no KV is full attention's."""
        self.open = False
        self.prefix_digests.clear()

    # -- exact prefix blocks ------------------------------------------------------------------------------------

    def persist(self, tokens: int, read: Callable[[int, int], KV]) -> None:
        """After a forward in the pure prefix: store each newly completed block; `read(start, end)` its KV."""
        if self.store is None or not self.open:
            return
        b = self.cfg.block_size
        while self.persisted + b <= tokens:
            end = self.persisted + b
            key = self.store.key(self.prefix_digests.pop(end), "exact")
            if key not in self.store:
                k, v = read(self.persisted, end)  # (L, Hkv, B, D)
                self.store.put(key, k, v, end)
            self.persisted = end

    def find_exact(self, ids: list[int]) -> list[KV]:
        """The KV of the longest chain of exact blocks that starts ids (at most sinks + window tokens)."""
        assert self.store is not None
        b = self.cfg.block_size
        limit = min(len(ids), self.cfg.sink_tokens + self.cfg.window) // b * b
        hasher = hashlib.sha256()
        found: list[KV] = []
        for end in range(b, limit + 1, b):
            hasher.update(token_bytes(ids[end - b : end]))
            kv = self.store.get(self.store.key(hasher.copy().hexdigest(), "exact"))
            if kv is None:
                break
            found.append(kv)
        return found

    # -- cascade snapshots --------------------------------------------------------------------------------------

    def snapshot_key(self, prefix: list[int]) -> str:
        """The L3 key a snapshot of a memory holding exactly `prefix` is stored under."""
        assert self.store is not None
        return self.store.key(hashlib.sha256(token_bytes(prefix)).hexdigest(), self.snapshot_tag)

    def snapshot_points(self, end: int, tail: int) -> range:
        """The grid points a fresh read of a prompt of `end` tokens snapshots at or passes through in the same
        state as any longer prompt's read (see the module docstring), ascending."""
        return range(self.first_eviction + self.grid_step, end - tail, self.grid_step)

    def cut(self, tokens: int, end: int, tail: int) -> list[int]:
        """Before a prompt ending at absolute index `end` (its last `tail` tokens chunked by its end) is fed to a
        memory of `tokens` tokens: the chunk boundaries (absolute) that make the read canonical; the last one
        before the tail is the one to snapshot at, remembered for `due`. Empty without a store, or when the memory
        is not read fresh (see `canonical`)."""
        fresh, self.canonical = self.canonical == tokens, None  # after this prompt the memory holds a conversation
        if self.store is None or not fresh or end <= self.first_eviction:
            return []
        grid = range(self.first_eviction, end, self.grid_step)
        points = self.snapshot_points(end, tail)
        if points and points[-1] > tokens:
            self.snapshot_at = points[-1]
        return [c for c in grid if c > tokens]

    def due(self, tokens: int) -> bool:
        """After a forward: whether the memory, now of `tokens` tokens, is to be snapshot (once, at the cut; a
        caller that ignored the cut just gets no snapshot)."""
        if self.snapshot_at is None or tokens < self.snapshot_at:
            return False
        at, self.snapshot_at = self.snapshot_at, None
        return tokens == at

    def put_snapshot(
        self, episodic: EpisodicMemory, state: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]]
    ) -> None:
        """Store the memory's state (as `state()` gives it, called once its blocks have their L3 keys) under the
        digest of every token fed; resident episodic blocks go in as content-addressed entries of their own."""
        assert self.store is not None
        key = self.store.key(self.hasher.copy().hexdigest(), self.snapshot_tag)
        if key in self.store:
            return
        resident = [b for b in episodic.blocks.values() if b.k is not None and b.v is not None]
        for block in resident:  # a stub's KV is in L3 under its l3_key already, and pages in the same way restored
            assert block.k is not None and block.v is not None
            self.store.put(episodic.content_key(block), block.k, block.v, self.cfg.block_size)
        meta, tensors = state()
        for block in resident:  # they travel by reference (their l3_key in meta)
            tensors.pop(f"ep.{block.id}.k", None)
            tensors.pop(f"ep.{block.id}.v", None)
        self.store.put_state(key, meta, tensors)

    def _same_settings(self, meta: dict[str, Any]) -> bool:
        if meta.get("kind") != "cascade" or meta.get("version") != CASCADE_STATE_VERSION:
            return False
        try:
            saved = CascadeConfig.from_dict(meta["config"])
        except (KeyError, TypeError, ValueError, AttributeError, SparkError):
            return False
        return saved.same_state(self.cfg)

    def find_snapshot(self, ids: list[int], last: int, target: StateTarget) -> Snapshot | None:
        """The longest stored snapshot at a grid point up to `last` whose tokens are a prefix of ids and that passes
        the session schema for `target`; entries that cannot be used are deleted on the way."""
        assert self.store is not None
        data = token_bytes(ids)
        hasher = hashlib.sha256()
        keys: list[tuple[int, str]] = []
        at = 0
        for end in self.snapshot_points(last + 1, 0):  # one pass over the tokens for every grid point's digest
            hasher.update(data[4 * at : 4 * end])
            at = end
            keys.append((end, self.store.key(hasher.copy().hexdigest(), self.snapshot_tag)))
        for end, key in reversed(keys):
            if key not in self.store:
                continue
            got = self.store.get_state(key)
            if got is None:
                continue
            found = self._complete(key, end, ids, *got, target)
            if found is not None:
                return found
        return None

    def _complete(
        self,
        key: str,
        end: int,
        ids: list[int],
        meta: dict[str, Any],
        stored: dict[str, torch.Tensor],
        target: StateTarget,
    ) -> Snapshot | None:
        """A read snapshot with its blocks' KV filled in from L3, checked; None (and the entry deleted) if unusable."""
        assert self.store is not None
        if meta.get("tokens") != ids[:end] or not self._same_settings(meta):
            self.store.discard(key, "its recorded tokens or settings do not match its key")
            return None
        tensors = dict(stored)
        refs: dict[int, str] = {}
        try:
            listed = [(int(b[0]), b[2], b[5]) for b in meta["episodic"]["blocks"]]
        except (KeyError, TypeError, ValueError, IndexError, OverflowError):
            self.store.discard(key, "its episodic blocks are unreadable")
            return None
        for bid, l3_key, resident in listed:
            kv = self.store.get(l3_key) if resident and l3_key else None
            if resident and kv is None:
                # A block it references was evicted (budget) or broken (dropped with a warning): the snapshot can
                # never load, so it goes too and the next cold run of this prompt writes a whole new one.
                self.store.discard(key)
                return None
            if kv is not None:
                tensors[f"ep.{bid}.k"], tensors[f"ep.{bid}.v"] = kv
                refs[bid] = l3_key
        try:  # a cache file is input like any other: the session schema decides before anything is written
            check_cascade_state(meta, tensors, target)
        except SchemaError as exc:
            self.store.discard(key, f"the snapshot {exc}")
            return None
        return Snapshot(end, meta, tensors, refs)

    # -- state --------------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"open": self.open, "persisted": self.persisted}

    def load_state(self, meta: dict[str, Any], tokens: list[int]) -> None:
        """Restore the phase and what is persisted, then rebuild the digests from the memory's `tokens`."""
        self.reset()
        self.open, self.persisted = bool(meta["open"]), int(meta["persisted"])
        self.feed(tokens, 0)
