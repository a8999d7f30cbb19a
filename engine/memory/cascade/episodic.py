"""Episodic memory (L2): blocks of KV that left the window, kept on the host and paged back in when relevant.

Tokens leaving the window are appended to a partial block; every `block_size` tokens the block is complete and
gets its key bounds (Quest): per layer, KV head and channel, the min and the max of its keys (unrotated, as
stored). Relevance of a block to a query q for one layer is Quest's upper bound on q . k over the block's keys,
summed over the layer's KV heads: sum over (head, channel) of max(q * kmin, q * kmax). Blocks are ranked per
layer, so each layer's retrieval slots may hold different blocks. All bounds live in two preallocated matrices,
so scoring is a few element-wise passes whose size is bounded by the budget, never by the conversation's length.
Why bounds rather than InfLLM's representative tokens (those receiving the most attention inside the block):
a bound needs no queries at the time a block forms, is exact about the one key that matters (a passkey is a
single token among filler) where a few representatives may miss it, and costs 2 key rows per block.

Budget: resident KV + bounds <= `episodic_budget_bytes`. Over budget, the resident block with the lowest
priority (last access tick + FREQUENCY_WEIGHT x uses: LRU weighted by access frequency) spills to L3 and stays
routable as a stub (its bounds and its L3 key); stubs may use at most a quarter of the budget, beyond which the
lowest-priority stub is forgotten. Without a persistent store, evicted blocks are simply dropped. A state restored
under a smaller budget (another machine) is brought within it the same way as soon as it is loaded. With a
`SharedBudget` (engine.memory.cascade.budget) the complete blocks of every memory sharing it stay within its limit
too: a memory over it evicts its own blocks the same way.

A memory reopened from its kept copy on disk (engine.session.kept) holds its blocks *paged*: resident as far as every
budget and priority is concerned (so it behaves exactly as the memory read back whole would), but their KV stays in
the kept file until retrieval first asks for a block, or the budget spills it (`PagedBlocks`). A paged block whose
bytes fail their check is treated as a block gone from L3: forgotten, never used.

A spilled block's L3 key is its content address (sha256 of its fp16 k, v bytes): whatever the block's KV depended
on (the geometry, the routing, which blocks earlier budgets kept), the key names exactly those bytes, so a stub can
never page in another conversation's KV, and cascade snapshots (engine.memory.cascade.prefix) reference the same entries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.backends.base import CANONICAL_KV_DTYPE
from engine.memory.cascade.budget import SharedBudget
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.persistent import PersistentStore
from engine.memory.cascade.stats import Counters, TierStats

FREQUENCY_WEIGHT = 8  # one past access is worth this many routing rounds of recency
# Ids of adopted blocks (attached documents and recalled conversations, engine.documents) start here: after any
# conversation's own blocks, so the two never share an id and conversation order puts the attachments last.
ADOPTED_BASE = 1 << 40


class PagedBlocks(Protocol):
    """Where paged blocks' KV waits (engine.session.kept: the kept file, held open)."""

    def read(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block's k, v (L, Hkv, B, D) fp16, checked; None when its bytes fail their check."""
        ...


@dataclass
class Block:
    id: int  # j: holds tokens [sinks + j*B, sinks + (j+1)*B) of the conversation
    row: int  # its row in the key-bound matrices
    k: torch.Tensor | None  # (L, Hkv, B, D) fp16 on the host; None once spilled to L3
    v: torch.Tensor | None  # (L, Hkv, B, D) fp16
    l3_key: str | None  # its content address in L3 once computed (spilled, or referenced by a snapshot)
    last_access: int
    uses: int
    paged: PagedBlocks | None = None  # resident, its KV still in the kept file (k, v None until read)

    @property
    def resident(self) -> bool:
        return self.k is not None or self.paged is not None

    @property
    def priority(self) -> int:
        return self.last_access + FREQUENCY_WEIGHT * self.uses


def content_digest(k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 of a block's fp16 k, v bytes: its content address in L3."""
    h = hashlib.sha256(k.contiguous().view(torch.uint8).numpy().data)
    h.update(v.contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def key_bounds(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k (L, Hkv, B, D) -> per-channel min and max over the block's tokens, each (L, Hkv*D) float32."""
    kmin, kmax = blocks_key_bounds(k, k.shape[2])
    return kmin[0], kmax[0]


def blocks_key_bounds(k: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k (L, Hkv, n*B, D), n blocks of B = `block` tokens -> each block's key bounds, each (n, L, Hkv*D) float32."""
    L, hkv, t, d = k.shape
    kf = k.float().reshape(L, hkv, t // block, block, d)  # (L, Hkv, n, B, D)
    kmin = kf.amin(dim=3).permute(2, 0, 1, 3).reshape(t // block, L, hkv * d)  # (n, L, F)
    kmax = kf.amax(dim=3).permute(2, 0, 1, 3).reshape(t // block, L, hkv * d)  # (n, L, F)
    return kmin, kmax


def token_bound_scores(kmin: torch.Tensor, kmax: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """kmin, kmax (rows, L, F); queries (T, L, Hkv, D) -> (rows, L): per layer, each block's best upper bound over
    the T queries (a block holding the key any one query token asks for scores high)."""
    best = bound_scores(kmin, kmax, queries[0])
    for q in queries[1:]:
        best = torch.maximum(best, bound_scores(kmin, kmax, q))
    return best


def bound_scores(kmin: torch.Tensor, kmax: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """kmin, kmax (rows, L, F); query (L, Hkv, D) -> (rows, L): each block's upper bound on q . k per layer."""
    q = query.float().reshape(query.shape[0], -1)  # (L, F)
    # max(q*kmin, q*kmax) is q*kmax where q > 0 and q*kmin where q < 0: two batched mat-vecs, no temporaries.
    return torch.einsum("rlf,lf->rl", kmax, q.clamp(min=0)) + torch.einsum("rlf,lf->rl", kmin, q.clamp(max=0))


class EpisodicMemory:
    def __init__(
        self,
        cfg: CascadeConfig,
        kv_shape: tuple[int, int, int],  # (L, Hkv, D)
        store: PersistentStore | None,
        shared: SharedBudget | None = None,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.shared = shared
        L, hkv, d = kv_shape
        self.kv_shape = kv_shape
        b = cfg.block_size
        self.block_bytes = 2 * L * hkv * b * d * CANONICAL_KV_DTYPE.itemsize
        self.rep_bytes = 2 * L * hkv * d * 4  # a block's key bounds
        budget = cfg.episodic_budget_bytes
        # Rows of the key-bound matrices: enough for a full budget of resident blocks plus stubs.
        stub_rows = (budget // 4) // self.rep_bytes if store is not None else 0
        self.max_rows = budget // (self.block_bytes + self.rep_bytes) + stub_rows
        self.counters = Counters()
        self.reset()
        if shared is not None:
            shared.join(self)

    def reset(self) -> None:
        L, hkv, d = self.kv_shape
        b = self.cfg.block_size
        self.partial_k = torch.zeros(L, hkv, b, d, dtype=CANONICAL_KV_DTYPE)  # (L, Hkv, B, D)
        self.partial_v = torch.zeros(L, hkv, b, d, dtype=CANONICAL_KV_DTYPE)  # (L, Hkv, B, D)
        self.partial_n = 0
        self.next_id = 0
        self.tick = 0
        self.blocks: dict[int, Block] = {}
        # Grown by doubling up to max_rows, so a short conversation does not pay for a full budget up front.
        self.kmin = torch.zeros(0, L, hkv * d)  # (rows, L, F) float32, F = Hkv*D
        self.kmax = torch.zeros(0, L, hkv * d)  # (rows, L, F) float32
        self.row_block = torch.full((0,), -1, dtype=torch.long)  # (rows,) block id per row, -1 when free
        self.free_rows: list[int] = []
        self.resident = 0
        self.stubs = 0
        self.pinned: set[int] = set()  # adopted blocks: paged out to L3 under pressure, never forgotten

    # -- intake -------------------------------------------------------------------------------------------------

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (L, Hkv, e, D): tokens that just left the window, oldest first."""
        b = self.cfg.block_size
        at = 0
        while at < k.shape[2]:
            n = min(b - self.partial_n, k.shape[2] - at)
            self.partial_k[:, :, self.partial_n : self.partial_n + n] = k[:, :, at : at + n]
            self.partial_v[:, :, self.partial_n : self.partial_n + n] = v[:, :, at : at + n]
            self.partial_n += n
            at += n
            if self.partial_n == b:
                self._complete(self.partial_k.clone(), self.partial_v.clone())
                self.partial_n = 0

    def _complete(self, k: torch.Tensor, v: torch.Tensor) -> None:
        block_id = self.next_id
        self.next_id += 1
        if self.max_rows == 0:
            return
        row = self._take_row()
        self.kmin[row], self.kmax[row] = key_bounds(k)
        self.row_block[row] = block_id
        self.blocks[block_id] = Block(block_id, row, k, v, None, self.tick, 0)
        self.resident += 1
        self._enforce_budget(protect=())

    def adopt(self, first_id: int, kmin: torch.Tensor, kmax: torch.Tensor, keys: list[str]) -> None:
        """Blocks read elsewhere (engine.documents' capsules) join as pinned stubs: their key bounds (n, L, F) are
        routable at once, their KV (in L3 under `keys`, one per block) is paged in only when retrieval picks them.
        Ids first_id, first_id + 1, ...; a pinned block is never forgotten by the budgets, only paged out."""
        for j, key in enumerate(keys):
            row = self._take_row()
            self.kmin[row], self.kmax[row] = kmin[j], kmax[j]
            self.row_block[row] = first_id + j
            self.blocks[first_id + j] = Block(first_id + j, row, None, None, key, self.tick, 0)
            self.pinned.add(first_id + j)
            self.stubs += 1

    def forget_adopted(self, first_id: int, n: int) -> None:
        """Adopted blocks first_id .. first_id + n - 1 leave (their attachment was detached)."""
        for block_id in range(first_id, first_id + n):
            block = self.blocks.get(block_id)
            if block is not None:
                self._forget(block)

    def _loose_stubs(self) -> list[Block]:
        """Stubs the budgets may forget (every stub but the pinned ones)."""
        return [b for b in self.blocks.values() if not b.resident and b.id not in self.pinned]

    def _take_row(self) -> int:
        if not self.free_rows:
            n = self.kmin.shape[0]
            grow = max(1, min(self.max_rows, max(4, 2 * n)) - n)
            self.kmin = torch.cat([self.kmin, torch.zeros(grow, *self.kmin.shape[1:])])
            self.kmax = torch.cat([self.kmax, torch.zeros(grow, *self.kmax.shape[1:])])
            self.row_block = torch.cat([self.row_block, torch.full((grow,), -1, dtype=torch.long)])
            self.free_rows.extend(range(n + grow - 1, n - 1, -1))
        return self.free_rows.pop()

    # -- budget -------------------------------------------------------------------------------------------------

    @property
    def charged_bytes(self) -> int:
        """What a shared budget counts: complete blocks, resident KV and every block's key bounds."""
        return self.resident * self.block_bytes + len(self.blocks) * self.rep_bytes

    @property
    def bytes(self) -> int:
        partial = 2 * self.partial_k.numel() * self.partial_k.element_size()
        return self.charged_bytes + partial

    def _enforce_budget(self, protect: tuple[int, ...]) -> None:
        budget = self.cfg.episodic_budget_bytes
        while (loose := self._loose_stubs()) and len(loose) * self.rep_bytes > budget // 4:
            self._forget(min(loose, key=lambda b: b.priority))
        while self.bytes > budget:
            candidates = [b for b in self.blocks.values() if b.resident and b.id not in protect]
            if candidates:
                victim = min(candidates, key=lambda b: b.priority)
                self._evict(victim, keep_stub=self.stubs * self.rep_bytes + self.rep_bytes <= budget // 4)
                continue
            # Every resident block sits in a retrieval group (per-layer picks can hold R x layers of them): the
            # stubs' bounds give way, so only the blocks the slots need can ever exceed the budget.
            stubs = self._loose_stubs()
            if not stubs:
                break
            self._forget(min(stubs, key=lambda b: b.priority))
        while self.shared is not None and self.shared.over():  # the memories sharing it hold too much together
            resident = [b for b in self.blocks.values() if b.resident and b.id not in protect]
            stubs = self._loose_stubs()
            if resident:  # a stub only while stubs stay within their quarter of the shared limit
                keep_stub = self.stubs * self.rep_bytes + self.rep_bytes <= self.shared.limit_bytes // 4
                self._evict(min(resident, key=lambda b: b.priority), keep_stub=keep_stub)
            elif stubs:
                self._forget(min(stubs, key=lambda b: b.priority))
            else:  # only blocks in retrieval slots are left here, as above
                break

    def _read_paged(self, block: Block) -> bool:
        """Bring a paged block's KV into host memory; False (the block forgotten) when its bytes fail their check."""
        if block.paged is None:
            return True
        kv = block.paged.read(block.id)
        if kv is None:
            self._forget(block)  # still counted as resident until forgotten
            return False
        block.k, block.v = kv
        block.paged = None
        return True

    def content_key(self, block: Block) -> str:
        """The resident block's L3 key (its content address), computed once."""
        assert self.store is not None and block.k is not None and block.v is not None
        if block.l3_key is None:
            block.l3_key = self.store.key(content_digest(block.k, block.v), "content")
        return block.l3_key

    def _evict(self, block: Block, keep_stub: bool) -> None:
        """Take a resident block's KV out of host memory: to L3 as a stub (still routable, pages back from disk)
        when `keep_stub` and there is a store, else forgotten."""
        self.counters.evictions += 1
        keep_stub = keep_stub or block.id in self.pinned
        if keep_stub and self.store is not None and not self._read_paged(block):
            return  # its bytes failed their check: forgotten
        if keep_stub and self.store is not None and block.k is not None and block.v is not None:
            self.store.put(self.content_key(block), block.k, block.v, self.cfg.block_size)
            block.k = block.v = None
            self.resident -= 1
            self.stubs += 1
        else:
            self._forget(block)

    def _forget(self, block: Block) -> None:
        del self.blocks[block.id]
        self.pinned.discard(block.id)
        self.row_block[block.row] = -1
        self.free_rows.append(block.row)
        if block.resident:
            self.resident -= 1
        else:
            self.stubs -= 1
        block.paged = None

    def spill(self) -> int:
        """Memory pressure: move every resident block's KV to L3, keeping its representative keys as a stub so it
        can still be routed to and paged back; without a store the blocks are forgotten. Returns the bytes freed."""
        before = self.bytes
        for block in [b for b in self.blocks.values() if b.resident]:
            self._evict(block, keep_stub=True)
        return before - self.bytes

    def drop_all(self) -> None:
        """Forget every complete block (`invalidate('episodic')`). The partial block and the block numbering stay,
        so block ids keep mapping to the same token ranges (and L3 keys) afterwards."""
        self.counters.evictions += len(self.blocks)
        self.blocks.clear()
        self.pinned.clear()
        self.kmin.zero_()
        self.kmax.zero_()
        self.row_block.fill_(-1)
        self.free_rows = list(range(self.kmin.shape[0] - 1, -1, -1))
        self.resident = self.stubs = 0

    # -- routing ------------------------------------------------------------------------------------------------

    def select(
        self,
        query: torch.Tensor,
        k: int,
        beat: torch.Tensor | None = None,
        at_least: int = 0,
        tokens: torch.Tensor | None = None,
        depth: int = 0,
    ) -> list[list[int]]:
        """query (L, Hkv, D) -> per layer, ids of its n most relevant blocks, best first, n = min(k, blocks).
        The retrieval gate: with `beat` (L,), n is at most how many blocks outscore beat[layer] in the median
        layer (every layer holds the same number of blocks, engine.memory.cascade.working), but never below `at_least`.
        With `tokens` (T, L, Hkv, D), the recent tokens' own queries, blocks rank by their best score over those
        (token_bound_scores) instead of by the mean query; with `depth`, each layer lists that many (at least n)."""
        self.tick += 1
        n = min(k, len(self.blocks))
        if n == 0:
            return [[] for _ in range(query.shape[0])]
        scores = (  # (rows, L)
            bound_scores(self.kmin, self.kmax, query)
            if tokens is None
            else token_bound_scores(self.kmin, self.kmax, tokens)
        )
        scores.masked_fill_((self.row_block < 0)[:, None], float("-inf"))
        if beat is not None:
            n = min(n, max(at_least, int((scores > beat).sum(0).median())))
        n = max(n, min(depth, len(self.blocks)))
        top = scores.topk(n, dim=0).indices  # (n, L)
        return self.row_block[top].t().tolist()  # (L, n)

    def touch(self, block_id: int) -> None:
        """A block already in a retrieval slot was selected again: it counts as a use for LRU."""
        block = self.blocks[block_id]
        block.last_access, block.uses = self.tick, block.uses + 1

    def fetch(self, block_id: int, protect: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block's k, v (L, Hkv, B, D), from host memory or back from L3; None when it is gone."""
        block = self.blocks[block_id]
        block.last_access, block.uses = self.tick, block.uses + 1
        if not self._read_paged(block):  # a paged block counts as resident: the same stats as one read whole
            return None
        if block.k is not None and block.v is not None:
            self.counters.hits += 1
            return block.k, block.v
        self.counters.misses += 1
        kv = self.store.get(block.l3_key) if self.store is not None and block.l3_key else None
        if kv is None:
            self._forget(block)
            return None
        block.k, block.v = kv[0].clone(), kv[1].clone()
        self.stubs -= 1
        self.resident += 1
        self._enforce_budget(protect=protect)
        return block.k, block.v

    # -- snapshot -----------------------------------------------------------------------------------------------

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats.make(
            "episodic", len(self.blocks), self.bytes, self.cfg.episodic_budget_bytes, c.hits, c.misses, c.evictions
        )

    def state(self, paged: dict[int, PagedBlocks] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Meta and tensors. A paged block's KV is read for it (without keeping it), or, given `paged`, left where it
        is and listed there by block id, for a caller that reads it later (engine.session.kept's writer)."""
        blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for b in list(self.blocks.values()):
            if b.paged is None:
                continue
            if paged is not None:
                paged[b.id] = b.paged
                continue
            kv = b.paged.read(b.id)
            if kv is None:  # its bytes failed their check: forgotten, as a stub whose L3 entry is gone
                self._forget(b)
            else:
                blocks[b.id] = kv
        meta = {
            "partial_n": self.partial_n,
            "next_id": self.next_id,
            "tick": self.tick,
            "rows": self.kmin.shape[0],
            "free_rows": list(self.free_rows),
            "blocks": [[b.id, b.row, b.l3_key, b.last_access, b.uses, b.resident] for b in self.blocks.values()],
            "counters": self.counters.to_dict(),
        }
        tensors = {
            "ep.partial_k": self.partial_k.clone(),
            "ep.partial_v": self.partial_v.clone(),
            "ep.kmin": self.kmin.clone(),
            "ep.kmax": self.kmax.clone(),
        }
        for b in self.blocks.values():  # a block's KV never changes once formed: shared, not copied
            kv = (b.k, b.v) if b.k is not None and b.v is not None else blocks.get(b.id)
            if kv is not None:
                tensors[f"ep.{b.id}.k"], tensors[f"ep.{b.id}.v"] = kv
        return meta, tensors

    def load_state(
        self, meta: dict[str, Any], tensors: dict[str, torch.Tensor], paged: PagedBlocks | None = None
    ) -> None:
        """Inverse of state(), then within this memory's budget (it may be smaller than the writer's): blocks over
        it spill to L3 or are forgotten, lowest priority first, as any block over budget is. With `paged`, a
        resident block whose tensors are shapes only (the "meta" device) stays paged there until first read."""
        self.reset()
        self.partial_k.copy_(tensors["ep.partial_k"])
        self.partial_v.copy_(tensors["ep.partial_v"])
        self.partial_n, self.next_id, self.tick = int(meta["partial_n"]), int(meta["next_id"]), int(meta["tick"])
        self.kmin = tensors["ep.kmin"].float().clone()  # (rows, L, F)
        self.kmax = tensors["ep.kmax"].float().clone()  # (rows, L, F)
        self.row_block = torch.full((int(meta["rows"]),), -1, dtype=torch.long)
        self.free_rows = [int(r) for r in meta["free_rows"]]
        for bid, row, l3_key, last, uses, resident in meta["blocks"]:
            k = v = None
            on_disk = None
            if resident and paged is not None and tensors[f"ep.{bid}.k"].device.type == "meta":
                on_disk = paged
            elif resident:
                k = tensors[f"ep.{bid}.k"].to(CANONICAL_KV_DTYPE).clone()
                v = tensors[f"ep.{bid}.v"].to(CANONICAL_KV_DTYPE).clone()
            # A resident block's key is recomputed from its KV when needed: a key read from a file is trusted only
            # where it is the sole way back to the KV (a stub).
            key = None if resident else l3_key
            self.blocks[int(bid)] = Block(int(bid), int(row), k, v, key, int(last), int(uses), on_disk)
            self.row_block[int(row)] = int(bid)
            self.resident += bool(resident)
            self.stubs += not resident
        self.counters = Counters.from_dict(meta["counters"])
        self._enforce_budget(protect=())
