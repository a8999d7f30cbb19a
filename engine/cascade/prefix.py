"""Prefix reuse through the persistent tier (L3): exact prefix blocks and cascade snapshots.

Exact prefix blocks. "Prefix" means tokens whose KV equals full attention's: those fed before anything ever left
the window (a forward that evicts computes its own tokens with a truncated context). While the conversation is in
that pure-prefix phase, each newly completed block-aligned block is persisted keyed by the digest of the whole
token prefix through it; on an empty memory the longest chain of such blocks is restored (at most sinks + window
tokens).

Cascade snapshots, for prompts longer than that. Past the first eviction KV depends on the cascade (what was in
the window, which blocks were retrieved, how the prompt was chunked), so single blocks cannot be reused; the whole
memory state can. With a store, `cut` asks for one extra chunk boundary at C = the last multiple of block_size
below the prompt's end (below, because prefill always computes the last token for its logits), if C lies past
what exact blocks cover; when the memory reaches exactly C tokens it stores its state under key(model, numerics,
"snapshot-" + CascadeConfig.state_tag() + the prompt's length, digest of tokens[:C]). On an empty memory the
snapshot of a prompt of the same length and first C tokens is restored if it loads, else the exact blocks are
tried. The cost is recomputing 1 to block_size tokens of a repeated prompt.
- Exactness: reuse never changes what the memory holds, whatever the store has (a restored session continues
  as the original did, though only one of them has the original's cache). A state reused for a prompt must be
  the one a cold read of that very prompt reaches, and the rest must be chunked as the cold read chunks it:
  - a snapshot is taken only while a prompt is read into an empty memory (`fresh`, the canonical chunking:
    chunks from 0, the tail and snapshot cuts of the prompt's end), never in a later turn, whose state depends
    on how the conversation was fed (replies token by token);
  - it is keyed by the prompt's length too: the cuts before C (the tail's, engine.cascade.memory) depend on
    where the prompt ends, so the snapshot of P is not the state a cold read of P + Q has at C (that one was
    chunked from 0 without P's cuts); a repeated or regenerated prompt is chunked identically either way;
  - exact blocks reused up to n <= sinks + window are full attention's KV however they were chunked, but the
    chunks after them would start at n instead of at a multiple of the chunk from 0: a fresh read that crosses
    the first eviction therefore cuts at sinks + window, so every read chunks the evicting part from there.
  The extra boundaries are only made with a store, so runs without the prefix cache chunk as before.
- Budgets are not part of the key (CascadeConfig.state_settings): a snapshot restores under this memory's budgets,
  as a session file does (engine.cascade.episodic brings its blocks within the episodic budget).
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

from engine.cascade.config import CascadeConfig
from engine.cascade.episodic import EpisodicMemory
from engine.cascade.persistent import PersistentStore
from engine.errors import SparkError
from engine.session_schema import (
    CASCADE_STATE_VERSION,
    SchemaError,
    StateTarget,
    check_memory_state,
)

KV = tuple[torch.Tensor, torch.Tensor]  # k, v (L, Hkv, n, D)


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
        self.reset()

    def reset(self) -> None:
        self.hasher = hashlib.sha256()  # running digest of every token fed (content address of the prefix)
        self.prefix_digests: dict[int, str] = {}  # block-aligned end index -> prefix digest, until persisted
        self.open = True  # nothing has left the window yet: every KV so far equals full attention's
        self.persisted = 0  # tokens [0, persisted) are in L3 as exact prefix blocks
        self.snapshot_at: int | None = None  # snapshot the state when this many tokens are in (see cut)
        self.snapshot_of = 0  # ... of a read of a prompt this long (part of the snapshot's key)
        # How many tokens the memory holds as a cold read would (0 when empty, n after reusing n); None once it
        # holds anything else (a prompt was read, a session restored): only such a memory reads `fresh` (see cut).
        self.canonical: int | None = 0

    def feed(self, ids: list[int], start: int) -> None:
        """Extend the running digest by ids (absolute indices start..), recording the digests at block-aligned
        ends that are still to be persisted (in the pure prefix, with a store)."""
        b, end = self.cfg.block_size, start + len(ids)
        data = token_bytes(ids)
        at = start
        if self.store is not None and self.open:
            for e in range(max(self.persisted, start) // b * b + b, end + 1, b):
                self.hasher.update(data[4 * (at - start) : 4 * (e - start)])
                at = e
                self.prefix_digests[e] = self.hasher.copy().hexdigest()
        self.hasher.update(data[4 * (at - start) :])

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

    def snapshot_key(self, prefix: list[int], prompt_tokens: int) -> str:
        """The L3 key a snapshot of a memory holding exactly `prefix`, read from a prompt of `prompt_tokens`
        tokens, is stored under."""
        assert self.store is not None
        return self._snapshot_key(hashlib.sha256(token_bytes(prefix)).hexdigest(), prompt_tokens)

    def _snapshot_key(self, digest: str, prompt_tokens: int) -> str:
        assert self.store is not None
        return self.store.key(digest, f"{self.snapshot_tag}-of-{prompt_tokens}")

    def cut(self, tokens: int, end: int) -> list[int]:
        """Before a prompt ending at absolute index `end` is fed to a memory of `tokens` tokens: the chunk
        boundaries (absolute) that make the read canonical, see the module docstring; the one to snapshot at is
        remembered for `due`. Empty without a store, or when the memory is not read fresh (see `canonical`)."""
        fresh, self.canonical = self.canonical == tokens, None  # after this prompt the memory holds a conversation
        if self.store is None or not fresh:
            return []
        cuts = []
        first_eviction = self.cfg.sink_tokens + self.cfg.window
        if self.open and tokens < first_eviction < end:
            cuts.append(first_eviction)
        cut = (end - 1) // self.cfg.block_size * self.cfg.block_size
        if cut > tokens and not (self.open and cut <= first_eviction):
            self.snapshot_at, self.snapshot_of = cut, end
            cuts.append(cut)
        return cuts

    def due(self, tokens: int) -> bool:
        """After a forward: whether the memory, now of `tokens` tokens, is to be snapshot (once, at the cut; a
        caller that ignored the cut just gets no snapshot)."""
        if self.snapshot_at is None or tokens < self.snapshot_at:
            return False
        at, self.snapshot_at = self.snapshot_at, None
        return tokens == at

    def put_snapshot(self, episodic: EpisodicMemory, state: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> None:
        """Store the memory's state (as `state()` gives it, called once its blocks have their L3 keys) under the
        digest of every token fed; resident episodic blocks go in as content-addressed entries of their own."""
        assert self.store is not None
        key = self._snapshot_key(self.hasher.copy().hexdigest(), self.snapshot_of)
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

    def find_snapshot(self, ids: list[int], target: StateTarget) -> Snapshot | None:
        """The snapshot a fresh read of the prompt `ids` + its last token took (at its cut), if stored and it passes
        the session schema for `target`; an entry that cannot be used is deleted on the way."""
        assert self.store is not None
        end = len(ids) // self.cfg.block_size * self.cfg.block_size  # the cut of a prompt of len(ids) + 1 tokens
        if end == 0:
            return None
        key = self.snapshot_key(ids[:end], len(ids) + 1)
        got = self.store.get_state(key) if key in self.store else None
        return None if got is None else self._complete(key, end, ids, *got, target)

    def _complete(self, key: str, end: int, ids: list[int], meta: dict[str, Any], stored: dict[str, torch.Tensor], target: StateTarget) -> Snapshot | None:
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
            check_memory_state(meta, tensors, target)
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
