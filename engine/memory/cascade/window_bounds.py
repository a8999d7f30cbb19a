"""The retrieval gate's reference: the key bounds of the blocks still in the window.

An evicted block is paged in only where it outscores the window's own `gate_rank`-th best block (per layer, in the
median layer; EpisodicMemory.select): retrieval competes with the window for the model's attention on equal terms,
and a block the window already outranks costs more than it brings (bench long-ppl at the default geometry).
A window block's bounds are exactly those episodic memory gives it when it leaves (key bounds of its keys as
stored). They are computed once per block from the slot table and kept in a ring sized to the window, so a
routing decision reads only the blocks completed since the last one. The ring grows as blocks are first bounded (a
window of the default geometry holds 248 blocks, 11 MB of bounds on the default model, which a conversation that
never routes never needs). Derived data, never saved: a restored memory recomputes them from the same KV and routes
exactly as an uninterrupted one.
"""

from __future__ import annotations

import torch

from engine.backends.base import Backend
from engine.memory.cascade.episodic import blocks_key_bounds, bound_scores
from engine.memory.cascade.working import WorkingMemory

READ_BLOCKS = 16  # window blocks read from the slot table at once: bounds the copies to a few MB on real models


class WindowBounds:
    def __init__(self, backend: Backend, row: int, working: WorkingMemory, kv_shape: tuple[int, int, int]) -> None:
        L, hkv, d = kv_shape
        self.backend = backend
        self.row = row
        self.working = working
        self.rows = working.window // working.block + 1  # more than the blocks a window can hold at once
        # Row c % rows holds block c; only rows [0, R) exist so far, R growing to `rows` as blocks are bounded.
        self.kmin = torch.zeros(0, L, hkv * d)  # (R, L, F) float32
        self.kmax = torch.zeros(0, L, hkv * d)  # (R, L, F) float32
        self.held = torch.full((self.rows,), -1, dtype=torch.long)  # (rows,) block ordinal per row, -1: none
        self.reset()

    def reset(self) -> None:
        self.held.fill_(-1)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """query (L, Hkv, D) -> (n, L): the bound scores of the n blocks wholly in the window."""
        span = self.working.window_blocks()
        blocks = torch.arange(span.start, span.stop)  # (n,)
        rows = blocks % self.rows  # (n,)
        missing = blocks[self.held[rows] != blocks]  # (m,)
        for at in range(0, missing.numel(), READ_BLOCKS):  # a whole window (after a restore) in bounded reads
            new = missing[at : at + READ_BLOCKS]
            k, _ = self.backend.read_kv(self.row, self.working.window_block_slots(new))  # (L, Hkv, n*B, D)
            kmin, kmax = blocks_key_bounds(k, self.working.block)  # (n, L, F) each
            self._hold(int((new % self.rows).max()) + 1)
            self.kmin[new % self.rows], self.kmax[new % self.rows] = kmin, kmax
            self.held[new % self.rows] = new
        return bound_scores(self.kmin[rows], self.kmax[rows], query)

    def _hold(self, n: int) -> None:
        """Rows [0, n) exist (grown by half at least, at most to `rows`, keeping what they hold)."""
        have = self.kmin.shape[0]
        if n <= have:
            return
        size = min(self.rows, max(n, have + have // 2))
        extra = torch.zeros(size - have, *self.kmin.shape[1:])  # (size - R, L, F)
        self.kmin, self.kmax = torch.cat((self.kmin, extra)), torch.cat((self.kmax, extra))

    def threshold(self, query: torch.Tensor, rank: int) -> torch.Tensor | None:
        """query (L, Hkv, D) -> (L,): per layer, the bound score of the window's rank-th best block (its worst when
        it holds fewer); None when the gate is off (rank 0) or no block is wholly in the window."""
        if rank == 0:
            return None
        scores = self.scores(query)  # (n, L)
        if scores.shape[0] == 0:
            return None
        return scores.topk(min(rank, scores.shape[0]), dim=0).values[-1]
