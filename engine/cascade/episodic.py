"""Episodic memory (L2): blocks of KV that left the window, kept on the host and paged back in when relevant.

Tokens leaving the window are appended to a partial block; every `block_size` tokens the block is complete and
gets `rep_keys` representative keys: the tokens whose keys lie closest to the block's centroid (cosine, averaged
over layers and KV heads). InfLLM picks the tokens that receive the most attention inside the block, which needs
queries the backend protocol does not expose; centroid-nearest keys are the cheap key-only stand-in.

Relevance of a block to a query proxy q (L, Hkv, D) = max over its representative keys of the mean over
(layer, head) of cos(q, key). All representative keys live in one preallocated matrix, so scoring is one
mat-vec whose size is bounded by the budget, never by the conversation's length.

Budget: resident KV + representative keys <= `episodic_budget_bytes`. Over budget, the resident block with the
lowest priority (last access tick + FREQUENCY_WEIGHT x uses: LRU weighted by access frequency) spills to L3 and
stays routable as a stub (its representative keys and its L3 key); stubs may use at most a quarter of the budget,
beyond which the lowest-priority stub is forgotten. Without a persistent store, evicted blocks are simply dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.backends.base import CANONICAL_KV_DTYPE
from engine.cascade.config import CascadeConfig
from engine.cascade.persistent import PersistentStore
from engine.cascade.stats import Counters, TierStats

FREQUENCY_WEIGHT = 8  # one past access is worth this many routing rounds of recency


@dataclass
class Block:
    id: int  # j: holds tokens [sinks + j*B, sinks + (j+1)*B) of the conversation
    row: int  # its row in the representative-key matrix
    k: torch.Tensor | None  # (L, Hkv, B, D) fp16 on the host; None once spilled to L3
    v: torch.Tensor | None  # (L, Hkv, B, D) fp16
    l3_key: str | None  # where its KV lives on disk once spilled
    last_access: int
    uses: int

    @property
    def priority(self) -> int:
        return self.last_access + FREQUENCY_WEIGHT * self.uses


def normalize_query(q: torch.Tensor) -> torch.Tensor:
    """q (L, Hkv, D) -> (F,) float32, unit per (layer, head) and scaled so a dot product is the mean cosine."""
    q = q.float()
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return q.flatten() / math.sqrt(q.shape[0] * q.shape[1])


def representative_keys(k: torch.Tensor, r: int) -> torch.Tensor:
    """k (L, Hkv, B, D) -> (r, F): the r keys nearest the block centroid, normalised like `normalize_query`."""
    kn = k.float()
    kn = kn / kn.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # (L, Hkv, B, D)
    c = kn.mean(dim=2, keepdim=True)  # (L, Hkv, 1, D)
    c = c / c.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    typical = (kn * c).sum(-1).mean(dim=(0, 1))  # (B,) mean cosine to the centroid
    picks = typical.topk(r).indices.sort().values  # (r,)
    reps = kn[:, :, picks, :].permute(2, 0, 1, 3)  # (r, L, Hkv, D)
    return reps.reshape(r, -1) / math.sqrt(k.shape[0] * k.shape[1])  # (r, F)


class EpisodicMemory:
    def __init__(
        self,
        cfg: CascadeConfig,
        kv_shape: tuple[int, int, int],  # (L, Hkv, D)
        store: PersistentStore | None,
        digest_at: Callable[[int], str | None],  # token-prefix digest at a token index (for L3 keys of spills)
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.digest_at = digest_at
        L, hkv, d = kv_shape
        self.kv_shape = kv_shape
        b, r = cfg.block_size, cfg.rep_keys
        self.block_bytes = 2 * L * hkv * b * d * CANONICAL_KV_DTYPE.itemsize
        self.rep_bytes = r * L * hkv * d * 4
        budget = cfg.episodic_budget_bytes
        # Rows of the representative-key matrix: enough for a full budget of resident blocks plus stubs.
        stub_rows = (budget // 4) // self.rep_bytes if store is not None else 0
        self.max_rows = budget // (self.block_bytes + self.rep_bytes) + stub_rows
        self.counters = Counters()
        self.reset()

    def reset(self) -> None:
        L, hkv, d = self.kv_shape
        b, r = self.cfg.block_size, self.cfg.rep_keys
        self.partial_k = torch.zeros(L, hkv, b, d, dtype=CANONICAL_KV_DTYPE)  # (L, Hkv, B, D)
        self.partial_v = torch.zeros(L, hkv, b, d, dtype=CANONICAL_KV_DTYPE)  # (L, Hkv, B, D)
        self.partial_n = 0
        self.next_id = 0
        self.tick = 0
        self.blocks: dict[int, Block] = {}
        # Grown by doubling up to max_rows, so a short conversation does not pay for a full budget up front.
        self.reps = torch.zeros(0, r, L * hkv * d)  # (rows, r, F) float32
        self.row_block = torch.full((0,), -1, dtype=torch.long)  # (rows,) block id per row, -1 when free
        self.free_rows: list[int] = []
        self.resident = 0
        self.stubs = 0

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
        self.reps[row] = representative_keys(k, self.cfg.rep_keys)
        self.row_block[row] = block_id
        end = self.cfg.sink_tokens + (block_id + 1) * self.cfg.block_size
        digest = self.digest_at(end) if self.store is not None else None
        l3_key = self.store.key(digest, f"cascade-{self.cfg.geometry_tag()}") if self.store is not None and digest else None
        self.blocks[block_id] = Block(block_id, row, k, v, l3_key, self.tick, 0)
        self.resident += 1
        self._enforce_budget(protect=())

    def _take_row(self) -> int:
        if not self.free_rows:
            n = self.reps.shape[0]
            grow = max(1, min(self.max_rows, max(4, 2 * n)) - n)
            self.reps = torch.cat([self.reps, torch.zeros(grow, *self.reps.shape[1:])])
            self.row_block = torch.cat([self.row_block, torch.full((grow,), -1, dtype=torch.long)])
            self.free_rows.extend(range(n + grow - 1, n - 1, -1))
        return self.free_rows.pop()

    # -- budget -------------------------------------------------------------------------------------------------

    @property
    def bytes(self) -> int:
        partial = 2 * self.partial_k.numel() * self.partial_k.element_size()
        return self.resident * self.block_bytes + len(self.blocks) * self.rep_bytes + partial

    def _enforce_budget(self, protect: tuple[int, ...]) -> None:
        budget = self.cfg.episodic_budget_bytes
        while self.stubs and self.stubs * self.rep_bytes > budget // 4:
            self._forget(min((b for b in self.blocks.values() if b.k is None), key=lambda b: b.priority))
        while self.bytes > budget:
            candidates = [b for b in self.blocks.values() if b.k is not None and b.id not in protect]
            if not candidates:
                break
            victim = min(candidates, key=lambda b: b.priority)
            self._evict(victim, keep_stub=self.stubs * self.rep_bytes + self.rep_bytes <= budget // 4)

    def _evict(self, block: Block, keep_stub: bool) -> None:
        """Take a resident block's KV out of host memory: to L3 as a stub (still routable, pages back from disk)
        when `keep_stub` and it has an L3 key, else forgotten."""
        self.counters.evictions += 1
        if keep_stub and self.store is not None and block.l3_key is not None:
            self.store.put(block.l3_key, block.k, block.v, self.cfg.block_size)  # type: ignore[arg-type]
            block.k = block.v = None
            self.resident -= 1
            self.stubs += 1
        else:
            self._forget(block)

    def _forget(self, block: Block) -> None:
        del self.blocks[block.id]
        self.row_block[block.row] = -1
        self.free_rows.append(block.row)
        if block.k is None:
            self.stubs -= 1
        else:
            self.resident -= 1

    def spill(self) -> int:
        """Memory pressure: move every resident block's KV to L3, keeping its representative keys as a stub so it
        can still be routed to and paged back; without a store the blocks are forgotten. Returns the bytes freed."""
        before = self.bytes
        for block in [b for b in self.blocks.values() if b.k is not None]:
            self._evict(block, keep_stub=True)
        return before - self.bytes

    def drop_all(self) -> None:
        """Forget every complete block (`invalidate('episodic')`). The partial block and the block numbering stay,
        so block ids keep mapping to the same token ranges (and L3 keys) afterwards."""
        self.counters.evictions += len(self.blocks)
        self.blocks.clear()
        self.reps.zero_()
        self.row_block.fill_(-1)
        self.free_rows = list(range(self.reps.shape[0] - 1, -1, -1))
        self.resident = self.stubs = 0

    # -- routing ------------------------------------------------------------------------------------------------

    def select(self, query: torch.Tensor, k: int) -> list[int]:
        """query (L, Hkv, D) -> ids of the (at most) k most relevant blocks, best first."""
        self.tick += 1
        if not self.blocks or k == 0:
            return []
        q = normalize_query(query)  # (F,)
        scores = (self.reps @ q).amax(dim=1)  # (rows,)
        scores.masked_fill_(self.row_block < 0, float("-inf"))
        top = scores.topk(min(k, len(self.blocks))).indices  # (k,)
        return [int(i) for i in self.row_block[top].tolist()]

    def touch(self, block_id: int) -> None:
        """A block already in a retrieval slot was selected again: it counts as a use for LRU."""
        block = self.blocks[block_id]
        block.last_access, block.uses = self.tick, block.uses + 1

    def fetch(self, block_id: int, protect: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The block's k, v (L, Hkv, B, D), from host memory or back from L3; None when it is gone."""
        block = self.blocks[block_id]
        block.last_access, block.uses = self.tick, block.uses + 1
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
        return TierStats.make("episodic", len(self.blocks), self.bytes, self.cfg.episodic_budget_bytes, c.hits, c.misses, c.evictions)

    def state(self) -> tuple[dict, dict[str, torch.Tensor]]:
        meta = {
            "partial_n": self.partial_n,
            "next_id": self.next_id,
            "tick": self.tick,
            "rows": self.reps.shape[0],
            "free_rows": list(self.free_rows),
            "blocks": [[b.id, b.row, b.l3_key, b.last_access, b.uses, b.k is not None] for b in self.blocks.values()],
            "counters": self.counters.to_dict(),
        }
        tensors = {"ep.partial_k": self.partial_k.clone(), "ep.partial_v": self.partial_v.clone(), "ep.reps": self.reps.clone()}
        for b in self.blocks.values():
            if b.k is not None and b.v is not None:
                tensors[f"ep.{b.id}.k"], tensors[f"ep.{b.id}.v"] = b.k, b.v
        return meta, tensors

    def load_state(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.reset()
        self.partial_k.copy_(tensors["ep.partial_k"])
        self.partial_v.copy_(tensors["ep.partial_v"])
        self.partial_n, self.next_id, self.tick = int(meta["partial_n"]), int(meta["next_id"]), int(meta["tick"])
        self.reps = tensors["ep.reps"].float().clone()  # (rows, r, F)
        self.row_block = torch.full((int(meta["rows"]),), -1, dtype=torch.long)
        self.free_rows = [int(r) for r in meta["free_rows"]]
        for bid, row, l3_key, last, uses, resident in meta["blocks"]:
            k = tensors[f"ep.{bid}.k"].to(CANONICAL_KV_DTYPE).clone() if resident else None
            v = tensors[f"ep.{bid}.v"].to(CANONICAL_KV_DTYPE).clone() if resident else None
            self.blocks[int(bid)] = Block(int(bid), int(row), k, v, l3_key, int(last), int(uses))
            self.row_block[int(row)] = int(bid)
            self.resident += bool(resident)
            self.stubs += not resident
        self.counters = Counters.from_dict(meta["counters"])
