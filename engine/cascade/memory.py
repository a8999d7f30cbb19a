"""CascadeMemory: engine.memory.Memory over the three tiers (working L1, episodic L2, persistent L3).

Per plan (before each forward), in this order:
  1. route: the routing query is the backend's query summary (per layer and KV head, the mean pre-RoPE query of the
     last forwards, over their last `proxy_tokens` tokens); when the routing strategy says so (a new prompt chunk,
     drift, the clock), each layer selects its top-k episodic blocks and only the (layer, group) pairs whose block
     changed are paged in (read from host memory, or back from L3);
  2. assign slots to the new tokens; tokens pushed out of the window are read (read_kv) *before* the forward
     overwrites them and appended to the current partial episodic block;
  3. positions and the mask come from the working memory's preallocated tables.
A plan may hold at most `window` tokens: with more, a new token would overwrite one fed in the same forward,
whose KV does not exist yet. Within one chunk that wraps the window, earlier tokens of the chunk see the window
as it is after the whole chunk is written (at least W - T + 1 window tokens instead of W).

Prefix reuse (L3). "Prefix" means tokens whose KV equals full attention's: those fed before anything ever left the
window (a forward that evicts computes its own tokens with a truncated context). While the conversation is in
that pure-prefix phase, after_forward persists each newly completed block-aligned block keyed by the digest of
the whole token prefix through it; reuse_prefix on an empty memory restores the longest chain of such blocks
(at most sinks + window tokens). Episodic blocks spilled under budget pressure go to L3 too, keyed additionally by
the cascade geometry, since their KV depends on it; they are only found again through their L2 stubs.

Cascade snapshots (L3), for prompts longer than that. Past the first eviction KV depends on the cascade (what was
in the window, which blocks were retrieved, how the prompt was chunked), so single blocks cannot be reused; the
whole memory state can. With a store, `prefill_cut` (called by engine.generate.prefill before feeding a prompt)
asks for one extra chunk boundary at C = the last multiple of block_size below the prompt's end (below, because
prefill always computes the last token for its logits), if C lies past what exact blocks cover; when after_forward
sees the memory reach exactly C tokens it stores `state()` under key(model, numerics, "snapshot-" + every
state-relevant setting (CascadeConfig.state_tag), digest of tokens[:C]). `reuse_prefix(ids)` on an empty memory
hashes ids at every block boundary, tries the snapshots from the longest down, restores the first that loads and
returns its length; only when none does it falls back to exact blocks. Block alignment keeps that lookup to
len/block_size index probes; the cost is recomputing 1 to block_size tokens of a repeated prompt.
- Exactness: a restored snapshot continues exactly as the memory it was taken from (same slots, ring, retrieval
  groups, episodic blocks, routing accumulators, fp16 KV as state() gives). The prompt's chunk boundaries up to C
  are part of that state: a cold run of P + Q is chunked from 0 and differs from "snapshot of P, then the rest" by
  the chunk-boundary effect the cascade always has (see plan); a repeated prompt is chunked identically either way.
  The extra boundary at C is only made with a store, so runs without the prefix cache chunk as before.
- Storage: resident episodic blocks are not stored inside the snapshot but as content-addressed "kv" entries
  (key: sha256 of their fp16 bytes), referenced by the block's l3_key in the snapshot's meta. Successive snapshots
  of a growing conversation (one per prompt) share every block they have in common, and a later spill of such a
  block finds its KV already on disk. A snapshot is written after its blocks; one whose block has gone (budget)
  or fails its checks is not restored (the store counts a miss, corrupt entries are dropped with a warning).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import torch

from engine.backends.base import Backend
from engine.cascade.config import AUTO_WINDOW, CascadeConfig
from engine.cascade.episodic import EpisodicMemory
from engine.cascade.migrate import migrate_state
from engine.cascade.persistent import PersistentStore
from engine.cascade.routing import ROUTING, RouteContext
from engine.cascade.stats import CascadeStats, Counters, TierStats
from engine.cascade.working import WorkingMemory
from engine.errors import InputTooLarge, SessionFileError, SparkError
from engine.memory import RowPlan
from engine.model import ROTARY_HEADROOM
from engine.session_schema import (
    CASCADE_STATE_VERSION,
    SchemaError,
    StateTarget,
    check_memory_state,
)

STATE_VERSION = CASCADE_STATE_VERSION  # 2: per-layer retrieval groups, key bounds, query-summary routing (engine.cascade.migrate)
TAIL_STEP = 4  # a prompt's last TAIL_STEPS * TAIL_STEP tokens go in small chunks, each routed by the one before
TAIL_STEPS = 6
TIERS = ("working", "episodic", "persistent")


def _token_bytes(ids: list[int]) -> bytes:
    """Token ids as little-endian int32 bytes: what prefix digests are computed over, on every machine."""
    return np.asarray(ids, dtype="<i4").tobytes()


def _content_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 of a block's fp16 k, v bytes: its content address as a snapshot's episodic block."""
    h = hashlib.sha256(k.contiguous().view(torch.uint8).numpy())
    h.update(v.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


FRAME_PERIOD_MAX = 4096


class CascadeMemory:
    """The memory of one sequence: row `row` of the backend's slot table, laid out per `config`."""

    def __init__(self, backend: Backend, config: CascadeConfig, row: int = 0, store: PersistentStore | None = None) -> None:
        if config.window == AUTO_WINDOW:
            raise ValueError("resolve the automatic window first (CascadeConfig.fit_to or for_model)")
        self.backend = backend
        self.row = row
        self.store = store
        self.kv_token_bytes = backend.kv_bytes_per_token()
        self._layout(config)

    def _layout(self, config: CascadeConfig) -> None:
        """Lay the memory out per `config` (empty), resizing a one-row slot table to it."""
        backend, c = self.backend, self.backend.config
        if backend.num_slots != config.num_slots:
            if backend.batch != 1 or self.row != 0:
                raise ValueError(f"the backend's slot table has {backend.num_slots} slots; this cascade needs {config.num_slots}")
            backend.allocate(1, config.num_slots)
        self.cfg = config
        # Frames stay inside the rotary table (the trained context + ROTARY_HEADROOM), and small: fp32 angles lose
        # precision as positions grow (a period of 4096 costs one full re-rotation of the window per 4096 tokens).
        table = c.max_position_embeddings + ROTARY_HEADROOM
        self.working = WorkingMemory(config, c.num_hidden_layers, frame_period=max(0, min(table - config.num_slots, FRAME_PERIOD_MAX)))
        self.episodic = EpisodicMemory(config, (c.num_hidden_layers, c.num_key_value_heads, c.head_dim), self.store, self._take_block_digest)
        self.router = ROUTING[config.routing]()
        self._snapshot_tag = f"snapshot-{config.state_tag()}"
        self.counters = Counters()  # working tier: routed block already resident / paged in
        self.tokens: list[int] = []
        self._reset_state()

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def _reset_state(self) -> None:
        self.tokens = []
        self.working.reset()
        self.episodic.reset()
        self._hasher = hashlib.sha256()  # running digest of every token fed (content address of the prefix)
        self._prefix_digests: dict[int, str] = {}  # block-aligned end index -> prefix digest, until persisted
        self._block_digests: dict[int, str] = {}  # episodic block end index -> prefix digest, until the block forms
        self._prefix_open = True  # nothing has left the window yet: every KV so far equals full attention's
        self._persisted = 0  # tokens [0, persisted) are in L3 as exact prefix blocks
        self._since_route = 0
        self._recent: list[tuple[torch.Tensor, int]] = []  # (query summary (L, Hkv, D) fp32, tokens) of recent forwards
        self._routed: torch.Tensor | None = None  # (L, Hkv, D) the routing query of the last routing decision
        self._last_prefill = False
        self._last_slots = torch.zeros(0, dtype=torch.long)  # (T,) slots of the last plan
        self._last_evicted = False
        self._snapshot_at: int | None = None  # snapshot the state when this many tokens are in (see prefill_cut)
        self._content_keys: dict[int, str] = {}  # episodic block id -> its content-addressed L3 key, once hashed
        self.reused_tokens = 0  # how many leading tokens the last reuse_prefix restored (for stats and benches)

    def reset(self) -> None:
        self._reset_state()

    def invalidate(self, tier: str | None = None) -> None:
        """Drop a tier's contents ('working' forgets the conversation, as reset(); None: every tier)."""
        if tier not in (None, *TIERS):
            raise ValueError(f"unknown tier {tier!r}; choose one of {', '.join(TIERS)}")
        if tier in (None, "persistent") and self.store is not None:
            self.store.clear()
        if tier in (None, "working"):
            self._reset_state()
        elif tier == "episodic":
            self.episodic.drop_all()
            self.working.set_groups([[] for _ in range(self.working.num_layers)])

    # -- hashing ------------------------------------------------------------------------------------------------

    def _feed_hash(self, ids: list[int], start: int) -> None:
        """Extend the running prefix digest by ids (absolute indices start..), recording digests at boundaries
        that a later step needs: block-aligned ends while in the pure prefix, and episodic block ends."""
        b, sinks, end = self.cfg.block_size, self.cfg.sink_tokens, start + len(ids)
        cuts: dict[int, tuple[bool, bool]] = {}
        if self.store is not None:
            if self._prefix_open:
                for e in range(max(self._persisted, start) // b * b + b, end + 1, b):
                    cuts[e] = (True, False)
            if self.cfg.retrieval_blocks:
                m = max(self.episodic.next_id + 1, (start - sinks) // b + 1)  # blocks not formed yet, ending after start
                for e in range(sinks + m * b, end + 1, b):
                    cuts[e] = (cuts.get(e, (False, False))[0], True)
        data = _token_bytes(ids)
        at = start
        for e in sorted(cuts):
            self._hasher.update(data[4 * (at - start) : 4 * (e - start)])
            at = e
            digest = self._hasher.copy().hexdigest()
            prefix, block = cuts[e]
            if prefix:
                self._prefix_digests[e] = digest
            if block:
                self._block_digests[e] = digest
        self._hasher.update(data[4 * (at - start) :])

    def _take_block_digest(self, end: int) -> str | None:
        return self._block_digests.pop(end, None)

    # -- routing ------------------------------------------------------------------------------------------------

    def _recent_keys(self, n: int) -> torch.Tensor | None:
        """For backends without a query summary: the mean key of the n most recent tokens, (L, Hkv, D)."""
        slots = self.working.recent_slots(n)
        if slots.numel() == 0:
            return None
        k, _ = self.backend.read_kv(self.row, slots)  # (L, Hkv, m, D)
        return k.float().mean(dim=2)

    def _routing_query(self) -> torch.Tensor | None:
        """(L, Hkv, D): the query summaries of the last proxy_tokens tokens, weighted by their forwards' tokens."""
        if not self._recent:
            return self._recent_keys(self.cfg.proxy_tokens)
        total = sum(n for _, n in self._recent)
        return sum(q * (n / total) for q, n in self._recent)  # type: ignore[return-value]

    def _remember_summary(self, tokens: int) -> None:
        summary = self.backend.query_summary()  # (B, L, Hkv, D) or None
        if summary is None:
            return
        self._recent.append((summary[self.row].float().clone(), tokens))
        while len(self._recent) > 1 and sum(n for _, n in self._recent[1:]) >= self.cfg.proxy_tokens:
            self._recent.pop(0)

    def _drift(self, query: torch.Tensor) -> float:
        if self._routed is None:
            return 1.0
        return 1.0 - float(torch.nn.functional.cosine_similarity(query, self._routed, dim=-1).mean())

    def _route(self, prefill: bool) -> None:
        query = self._routing_query()
        if query is None:
            return
        ctx = RouteContext(prefill, self._since_route, self.cfg.reroute_every, self._drift(query), self.cfg.reroute_drift / 100)
        if not self.router.should_route(ctx):
            return
        self._since_route = 0
        self._routed = query
        while True:
            chosen = self.episodic.select(query, self.cfg.retrieval_blocks)  # (L, n) block ids per layer
            if self._page_in(chosen):
                return

    def _page_in(self, chosen: list[list[int]]) -> bool:
        """Put each layer's chosen blocks in its retrieval groups, paging in only (layer, group) pairs that change.
        False when a block turned out to be gone (forgotten from L3): the caller selects again."""
        old = self.working.groups
        n = len(chosen[0])
        new: list[list[int | None]] = []
        for layer, pick in enumerate(chosen):
            keep = [b if g < len(old[layer]) and old[layer][g] in pick else None for g, b in enumerate(old[layer][:n])]
            keep += [None] * (n - len(keep))
            rest = iter(sorted(b for b in pick if b not in keep))  # by id, not rank: placement follows the set alone
            new.append([b if b is not None else next(rest) for b in keep])
        changed = {(layer, g) for layer in range(len(new)) for g in range(n) if g >= len(old[layer]) or old[layer][g] != new[layer][g]}
        needed = {new[layer][g] for layer, g in changed}
        protect = tuple({b for pick in chosen for b in pick})
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for bid in sorted(needed):  # type: ignore[type-var]
            got = self.episodic.fetch(bid, protect=protect)  # type: ignore[arg-type]
            if got is None:
                return False
            kv[bid] = got  # type: ignore[index]
        for bid in set(protect) - needed:
            self.episodic.touch(bid)
        self.counters.hits += n * len(new) - len(changed)
        self.counters.misses += len(changed)
        for g in sorted({g for _, g in changed}):
            slots = self.working.group_slots(g)
            k, v = self.backend.read_kv(self.row, slots)  # (L, Hkv, B, D): layers that keep their block keep their KV
            ks, vs = list(k.unbind(0)), list(v.unbind(0))
            for layer in (layer for layer, gg in changed if gg == g):
                bk, bv = kv[new[layer][g]]  # type: ignore[index]
                ks[layer], vs[layer] = bk[layer], bv[layer]
            self.backend.write_kv(self.row, slots, torch.stack(ks), torch.stack(vs))
        self.working.set_groups(new)  # type: ignore[arg-type]
        return True

    # -- the Memory protocol ------------------------------------------------------------------------------------

    def plan(self, ids: list[int]) -> RowPlan:
        t = len(ids)
        if t == 0:
            raise ValueError("plan needs at least one token")
        if t > self.cfg.window:
            raise InputTooLarge(f"A step of {t} tokens exceeds the {self.cfg.window}-token window; feed it in smaller chunks.")
        prefill = t > 1
        if self.cfg.retrieval_blocks and self.episodic.blocks:
            self._route(prefill)
        start = len(self.tokens)
        slots, evicted = self.working.assign(t)
        if evicted:
            self._prefix_open = False
            self._prefix_digests.clear()
            if self.cfg.retrieval_blocks:
                k, v = self.backend.read_kv(self.row, torch.tensor(evicted))  # (L, Hkv, e, D) each, before overwrite
                self.episodic.append(k, v)
        self._feed_hash(ids, start)
        self.tokens.extend(ids)
        self._since_route += t
        self._last_prefill, self._last_evicted = prefill, bool(evicted)
        self.working.refresh_positions()
        ws = torch.tensor(slots, dtype=torch.long)  # (T,)
        self._last_slots = ws
        w = self.working
        return RowPlan(w.slot_positions[ws], ws, w.slot_positions.clone(), w.mask(ws), w.frame, w.window_start)

    def after_forward(self) -> None:
        if self.cfg.retrieval_blocks:
            self._remember_summary(self._last_slots.numel())
        if self.store is not None and self._prefix_open and not self._last_evicted:
            self._persist_prefix()
        if self._snapshot_at is not None and len(self.tokens) >= self._snapshot_at:
            if len(self.tokens) == self._snapshot_at:  # a caller that ignored the cut just gets no snapshot
                self._snapshot()
            self._snapshot_at = None

    def _persist_prefix(self) -> None:
        b = self.cfg.block_size
        assert self.store is not None
        while self._persisted + b <= len(self.tokens):
            end = self._persisted + b
            key = self.store.key(self._prefix_digests.pop(end), "exact")
            if key not in self.store:
                slots = torch.tensor([self.working.slot_of(i) for i in range(self._persisted, end)])  # (B,)
                k, v = self.backend.read_kv(self.row, slots)  # (L, Hkv, B, D)
                self.store.put(key, k, v, end)
            self._persisted = end

    def reuse_prefix(self, ids: list[int]) -> int:
        if self.tokens or self.store is None:
            return 0
        n = self._reuse_snapshot(ids) or self._reuse_exact(ids)
        if n:
            self.store.flush()  # the entries' new recency must outlive this process, or LRU evicts the hot ones
        self.reused_tokens = n
        return n

    def _reuse_exact(self, ids: list[int]) -> int:
        assert self.store is not None
        b = self.cfg.block_size
        limit = min(len(ids), self.cfg.sink_tokens + self.cfg.window) // b * b
        hasher = hashlib.sha256()
        found: list[tuple[torch.Tensor, torch.Tensor]] = []
        for end in range(b, limit + 1, b):
            hasher.update(_token_bytes(ids[end - b : end]))
            kv = self.store.get(self.store.key(hasher.copy().hexdigest(), "exact"))
            if kv is None:
                break
            found.append(kv)
        if not found:
            return 0
        n = len(found) * b
        slots, _ = self.working.assign(n)
        for j, (k, v) in enumerate(found):
            self.backend.write_kv(self.row, torch.tensor(slots[j * b : (j + 1) * b]), k, v)
        self._last_prefill = True  # the restored tokens are the start of this prompt, as if prefilled
        self._persisted = n
        self._feed_hash(ids[:n], 0)
        self.tokens.extend(ids[:n])
        self._since_route += n
        self.working.refresh_positions()
        return n

    # -- cascade snapshots --------------------------------------------------------------------------------------

    def snapshot_key(self, prefix: list[int]) -> str:
        """The L3 key a snapshot of this memory holding exactly `prefix` is stored under."""
        assert self.store is not None
        return self.store.key(hashlib.sha256(_token_bytes(prefix)).hexdigest(), self._snapshot_tag)

    def prefill_cut(self, ids: list[int], start: int) -> list[int]:
        """Before a prompt `ids` is fed from index `start` (after reuse_prefix): indices of ids where chunks must
        end, ascending. One lets the memory snapshot its state (see the module docstring). When the conversation
        reaches past the window, the prompt's last tokens also go in small chunks: a forward's query summary
        routes the next one, so the question at the end of a prompt routes the tokens that answer it."""
        base = len(self.tokens) - start  # absolute index of ids[0]
        end = base + len(ids)
        cuts: set[int] = set()
        if self.cfg.retrieval_blocks and end > self.cfg.sink_tokens + self.cfg.window:
            cuts.update(c - base for c in range(end - TAIL_STEP, end - TAIL_STEP * TAIL_STEPS - 1, -TAIL_STEP) if c > len(self.tokens))
        if self.store is not None:
            cut = (end - 1) // self.cfg.block_size * self.cfg.block_size
            if cut > len(self.tokens) and not (self._prefix_open and cut <= self.cfg.sink_tokens + self.cfg.window):
                self._snapshot_at = cut  # else nothing is left to feed before it, or exact prefix blocks cover it
                cuts.add(cut - base)
        return sorted(cuts)

    def _snapshot(self) -> None:
        assert self.store is not None
        key = self.store.key(self._hasher.copy().hexdigest(), self._snapshot_tag)
        if key in self.store:
            return
        for block in self.episodic.blocks.values():
            if block.k is None or block.v is None:
                continue  # a stub: its KV is in L3 under l3_key already, and a restored stub pages it in the same way
            ref = self._content_keys.get(block.id)
            if ref is None:
                ref = self._content_keys[block.id] = self.store.key(_content_digest(block.k, block.v), "content")
                block.l3_key = ref  # where its KV now lives on disk: a later spill of it writes nothing
            self.store.put(ref, block.k, block.v, self.cfg.block_size)
        meta, tensors = self.state()
        for block in self.episodic.blocks.values():  # resident blocks travel by reference (their l3_key in meta)
            tensors.pop(f"ep.{block.id}.k", None)
            tensors.pop(f"ep.{block.id}.v", None)
        self.store.put_state(key, meta, tensors)

    def _reuse_snapshot(self, ids: list[int]) -> int:
        """Restore the longest stored snapshot whose tokens are a prefix of ids; its length, or 0."""
        assert self.store is not None
        b = self.cfg.block_size
        data = _token_bytes(ids)
        hasher = hashlib.sha256()
        keys: list[tuple[int, str]] = []
        for end in range(b, len(ids) + 1, b):
            hasher.update(data[4 * (end - b) : 4 * end])
            keys.append((end, self.store.key(hasher.copy().hexdigest(), self._snapshot_tag)))
        for end, key in reversed(keys):
            if key not in self.store:
                continue
            got = self.store.get_state(key)
            if got is None:
                continue
            meta, tensors = got
            if meta.get("tokens") != ids[:end] or not self._same_settings(meta):
                self.store.discard(key, "its recorded tokens or settings do not match its key")
                continue
            tensors = dict(tensors)
            refs: dict[int, str] = {}
            try:
                listed = [(int(b[0]), b[2], b[5]) for b in meta["episodic"]["blocks"]]
            except (KeyError, TypeError, ValueError, IndexError, OverflowError):
                self.store.discard(key, "its episodic blocks are unreadable")
                continue
            for bid, l3_key, resident in listed:
                kv = self.store.get(l3_key) if resident and l3_key else None
                if resident and kv is None:
                    # A block it references was evicted (budget) or broken (dropped with a warning): the snapshot
                    # can never load, so it goes too and the next cold run of this prompt writes a whole new one.
                    self.store.discard(key)
                    break
                if kv is not None:
                    tensors[f"ep.{bid}.k"], tensors[f"ep.{bid}.v"] = kv
                    refs[int(bid)] = l3_key
            else:
                try:  # a cache file is input like any other: the session schema decides before anything is written
                    check_memory_state(meta, tensors, self.state_target())
                except SchemaError as exc:
                    self.store.discard(key, f"the snapshot {exc}")
                    continue
                self._restore(meta, tensors)
                self._content_keys = refs
                return end
        return 0

    def _same_settings(self, meta: dict) -> bool:
        if meta.get("kind") != "cascade" or meta.get("version") != STATE_VERSION:
            return False
        try:
            saved = CascadeConfig.from_dict(meta["config"])
        except (KeyError, TypeError, ValueError, AttributeError, SparkError):
            return False
        return replace(saved, persistent_budget_bytes=self.cfg.persistent_budget_bytes) == self.cfg

    # -- session state ------------------------------------------------------------------------------------------

    def spill(self) -> int:
        """Free host memory under pressure: episodic KV goes to disk (see EpisodicMemory.spill); bytes freed."""
        return self.episodic.spill()

    def max_feed(self) -> int:
        return self.cfg.window  # one plan's tokens must fit the window together

    def stats(self) -> CascadeStats:
        w = self.working
        working = TierStats.make(
            "working",
            w.held_tokens,
            w.held_tokens * self.kv_token_bytes,
            self.cfg.num_slots * self.kv_token_bytes,
            self.counters.hits,
            self.counters.misses,
            w.evicted,
        )
        persistent = self.store.stats() if self.store is not None else TierStats.make("persistent", 0, 0, 0, 0, 0, 0)
        return CascadeStats(working, self.episodic.stats(), persistent)

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """Meta (JSON-able) + tensors: working slots' KV (L, Hkv, S, D) fp16, episodic blocks fp16 with their key
        bounds, and the routing state in fp32 as computed (so a restored conversation routes exactly as an
        uninterrupted one): route.recent (n, L, Hkv*D) query summaries, route.routed (L, Hkv, D)."""
        ep_meta, tensors = self.episodic.state()
        k, v = self.backend.read_kv(self.row, torch.arange(self.cfg.num_slots))  # (L, Hkv, S, D) each
        tensors.update({"wk.k": k, "wk.v": v})
        if self._recent:
            # (n, L, Hkv*D): three dimensions, so no reader mistakes it for KV in the canonical (L, Hkv, n, D) layout
            tensors["route.recent"] = torch.stack([q.flatten(1) for q, _ in self._recent])
        if self._routed is not None:
            tensors["route.routed"] = self._routed.clone()
        meta = {
            "kind": "cascade",
            "version": STATE_VERSION,
            "config": self.cfg.to_dict(),
            "tokens": list(self.tokens),
            "working": self.working.state(),
            "episodic": ep_meta,
            "routing": {
                "since_route": self._since_route,
                "recent_tokens": [n for _, n in self._recent],
                "last_prefill": self._last_prefill,
                "last_evicted": self._last_evicted,
                "last_slots": self._last_slots.tolist(),
            },
            "prefix": {"open": self._prefix_open, "persisted": self._persisted},
            "counters": self.counters.to_dict(),
            "stats": self.stats().to_dict(),
        }
        return meta, tensors

    def state_target(self) -> StateTarget:
        c = self.backend.config
        dims = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        return StateTarget(c.vocab_size, dims, cascade=self.cfg, max_positions=c.max_position_embeddings)

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        try:  # the one schema (engine.session_schema): nothing is touched unless all of it holds
            check_memory_state(meta, tensors, self.state_target())
        except SchemaError as exc:
            raise SessionFileError(f"The saved memory cannot be restored: it {exc}.") from None
        if meta.get("version") == 1:
            meta, tensors = migrate_state(meta, tensors)
        saved = CascadeConfig.from_dict(meta["config"])
        # The state depends on its geometry, not on budgets: a file saved under another geometry (an older default,
        # another cascade.json) restores in its own, within the model's trained context, under this memory's budgets.
        saved = replace(saved, episodic_budget_bytes=self.cfg.episodic_budget_bytes, persistent_budget_bytes=self.cfg.persistent_budget_bytes)
        if saved != self.cfg:
            if self.backend.batch != 1 or self.row != 0:
                raise SessionFileError("The saved memory used a different cascade geometry; restore it with the same settings.")
            self._layout(saved)
        self._restore(meta, tensors)

    def _restore(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        """load_state without its checks (callers check the kind, version and settings)."""
        c = self.backend.config
        self._reset_state()
        self.backend.write_kv(self.row, torch.arange(self.cfg.num_slots), tensors["wk.k"], tensors["wk.v"])
        self.working.load_state(meta["working"])
        self.episodic.load_state(meta["episodic"], tensors)
        r = meta["routing"]
        self._since_route = int(r["since_route"])
        self._last_prefill, self._last_evicted = bool(r["last_prefill"]), bool(r["last_evicted"])
        self._last_slots = torch.tensor(r["last_slots"], dtype=torch.long)
        recent = tensors.get("route.recent")
        counts = [int(n) for n in r["recent_tokens"]]
        shape = (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        self._recent = [] if recent is None else [(recent[i].float().reshape(shape).clone(), counts[i]) for i in range(len(counts))]
        routed = tensors.get("route.routed")
        self._routed = None if routed is None else routed.float().clone()
        self._prefix_open, self._persisted = bool(meta["prefix"]["open"]), int(meta["prefix"]["persisted"])
        self.counters = Counters.from_dict(meta["counters"])
        tokens = [int(t) for t in meta["tokens"]]
        self._feed_hash(tokens, 0)  # rebuilds the running digest and the boundary digests still pending
        self.tokens = tokens
