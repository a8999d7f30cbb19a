"""Working memory (L1): the device slot table's layout and the positions the cascade assigns inside it.

Slots, for S = CascadeConfig.num_slots:
    [0, sinks)                      attention sinks: the first tokens, kept forever (StreamingLLM)
    [sinks, sinks + R*B)            R retrieval groups of B slots; per layer, each holds one paged-in episodic block:
                                    the first R - layer_blocks the same blocks in every layer (the layers'
                                    consensus), the rest each layer's own picks (engine.memory.cascade.retrieval)
    [sinks + R*B, ... + W)          the window: a ring of the W most recent tokens
    [..., S)                        padding to a multiple of 32, never attended

Positions (the largest is < sinks + R*B + W <= the model's trained context):
    sinks 0..sinks-1, then the window oldest to newest starting at sinks + n*B for the n filled retrieval groups
    (dense: with the retrieval gate leaving groups empty, the sinks then sit right before the window, as for the
    window-only memory, which bench long-ppl at the default geometry measured better than a fixed start);
    group g at sinks + (W - near) + g*B, near = min(W, retrieval_near): its block reads as if it had been said
    near + (n - g)*B tokens ago, not a whole long window ago, where the model hardly reads it (bench passkey at
    the default geometry). With a window no longer than retrieval_near the groups sit right before it. One position
    table serves every layer, so a group's position cannot follow which block each layer put in it.
Every layer holds the same number n <= R of blocks, in groups [0, n), so the mask is the same for every layer.
While nothing has left the window this makes position == absolute token index, i.e. exact full attention.
Keys are stored unrotated (engine.model.network), so re-numbering as the window slides costs nothing but this table.

Everything here is O(1) or O(S) per step with preallocated tensors: nothing grows with the conversation.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.stats import Counters, TierStats


class WorkingMemory:
    def __init__(self, cfg: CascadeConfig, num_layers: int, frame_period: int = 0) -> None:
        self.cfg = cfg
        self.num_layers = num_layers
        self.sinks, self.block, self.groups_n, self.window = (
            cfg.sink_tokens,
            cfg.block_size,
            cfg.retrieval_blocks,
            cfg.window,
        )
        self.retrieval_start = self.sinks
        self.window_start = self.sinks + cfg.retrieval_slots
        self.slot_positions = torch.zeros(cfg.num_slots, dtype=torch.long)  # (S,) position of each slot
        self.valid = torch.zeros(cfg.num_slots, dtype=torch.bool)  # (S,) slot holds a token that may be attended
        self._ring = torch.arange(self.window)  # (W,)
        self._window_positions = self.slot_positions[self.window_start : self.window_start + self.window]  # (W,) view
        # The window's rotation frame (engine.model.network.SlotBatch): 1 + evictions, so a window token's position + frame
        # stays fixed as the window slides; it wraps every `frame_period` evictions to keep position + frame inside
        # the model's rotary table. It starts at 1, not 0, so the window is its own frame from the first token and
        # a step costs the same before and after the window fills. A period of 0 disables it.
        self.frame_period = frame_period
        self._block_offsets = torch.arange(self.block)  # (B,)
        self._group_offsets = torch.arange(self.groups_n * self.block)  # (R*B,)
        self.counters = Counters()  # a routed block already sat in its retrieval group / had to be paged in
        self.reset()

    def reset(self) -> None:
        self.n_sink = 0  # sink slots filled
        self.n_window = 0  # window slots filled
        self.head = 0  # ring index the next window token goes to
        self.evicted = 0  # tokens that have left the window, ever
        self.groups: list[list[int]] = [[] for _ in range(self.num_layers)]  # per layer, block id held by groups 0..n-1
        self.valid.zero_()
        self.slot_positions.zero_()
        self.slot_positions[: self.sinks] = torch.arange(self.sinks)
        self.refresh_positions()

    @property
    def resident_blocks(self) -> int:
        """n: retrieval groups filled, in every layer alike."""
        return len(self.groups[0]) if self.groups else 0

    @property
    def held_tokens(self) -> int:
        """Tokens in sink, window and retrieval slots."""
        return self.n_sink + self.n_window + self.resident_blocks * self.block

    def slot_of(self, index: int) -> int:
        """Slot of absolute token `index` while nothing has been evicted (the pure-prefix phase)."""
        return index if index < self.sinks else self.window_start + (index - self.sinks)

    def slots_after(self, n: int) -> int:
        """Slots [0, k) in use once `n` more tokens are assigned: the sinks, then (past them) the retrieval groups
        and the window as far as it fills."""
        total = self.n_sink + self.n_window + n
        return total if total <= self.sinks else self.window_start + min(self.window, total - self.sinks)

    def recent_slots(self, n: int) -> torch.Tensor:
        """(m,) slots of the m = min(n, window fill) most recent window tokens, newest first."""
        m = min(n, self.n_window)
        return (self.head - 1 - torch.arange(m)) % self.window + self.window_start

    def window_blocks(self) -> range:
        """Ordinals c of the blocks wholly in the window: the window's tokens c*B .. c*B + B - 1, counting every
        token that ever entered it (the blocks episodic memory forms from them as they leave)."""
        return range(-(-self.evicted // self.block), (self.evicted + self.n_window) // self.block)

    def window_block_slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (n,) ordinals from window_blocks() -> (n*B,) their slots, block by block, oldest token first."""
        tokens = blocks[:, None] * self.block + self._block_offsets  # (n, B): the e-th window token sits at ring e % W
        return (tokens % self.window).flatten() + self.window_start

    def assign(self, count: int) -> tuple[list[int], list[int]]:
        """Slots for `count` new tokens, and the window slots whose current token they push out (oldest first).

        The caller must read the pushed-out slots' KV before the forward overwrites them.
        """
        slots: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            if self.n_sink < self.sinks:
                slots.append(self.n_sink)
                self.n_sink += 1
                continue
            slot = self.window_start + self.head
            if self.n_window == self.window:
                evicted.append(slot)
            else:
                self.n_window += 1
            slots.append(slot)
            self.head = (self.head + 1) % self.window
        self.evicted += len(evicted)
        self.valid[slots] = True
        return slots, evicted

    def release(self, count: int) -> list[int]:
        """Push the window's `count` oldest tokens out ahead of the tokens that would push them (a picture leaves
        whole, engine.memory.cascade.pictures): their slots, oldest first, free for the next tokens. The caller
        reads their KV before anything overwrites it."""
        oldest = (self.head - self.n_window) % self.window
        slots = ((oldest + torch.arange(count)) % self.window + self.window_start).tolist()
        self.n_window -= count
        self.evicted += count
        self.valid[slots] = False
        return slots

    def unassign(self, count: int, evicted: int = 0, released: int = 0) -> None:
        """Undo `assign` of the last `count` tokens, the last `evicted` of which pushed a token out (the caller
        writes those tokens' KV back): their slots are free again, or hold the pushed-out tokens again (newest
        first: the window's before the sinks', the reverse of the order assign fills them). `released`: the
        `release` before that assign, undone after it (those tokens are the window's oldest again)."""
        self.evicted -= evicted
        for i in range(count):
            if i < evicted:  # it took a full window's oldest slot: the slot holds that token again
                self.head = (self.head - 1) % self.window
            elif self.n_window:
                self.head = (self.head - 1) % self.window
                self.n_window -= 1
                self.valid[self.window_start + self.head] = False
            else:
                self.n_sink -= 1
                self.valid[self.n_sink] = False
        if released:
            self.n_window += released
            self.evicted -= released
            oldest = (self.head - self.n_window) % self.window
            self.valid[(oldest + torch.arange(released)) % self.window + self.window_start] = True

    def set_groups(self, groups: list[list[int]]) -> None:
        """Record which block each layer's retrieval groups [0, n) hold (the same n in every layer)."""
        if len({len(g) for g in groups}) > 1 or len(groups) != self.num_layers or len(groups[0]) > self.groups_n:
            raise ValueError("every layer must hold the same number of retrieval blocks, at most retrieval_blocks")
        self.groups = [list(g) for g in groups]
        n = self.resident_blocks
        end = self.retrieval_start + self.groups_n * self.block
        self.valid[self.retrieval_start : end] = False
        self.valid[self.retrieval_start : self.retrieval_start + n * self.block] = True
        self.refresh_positions()

    def group_slots(self, g: int) -> torch.Tensor:
        """(B,) slots of retrieval group g."""
        return self._block_offsets + (self.retrieval_start + g * self.block)

    def refresh_positions(self) -> None:
        """Window positions: oldest token at base = sinks + resident blocks * B, newest at base + fill - 1."""
        base = self.sinks + self.resident_blocks * self.block
        oldest = (self.head - self.n_window) % self.window
        self._window_positions.copy_(self._ring).sub_(oldest).remainder_(self.window).add_(base)
        # Retrieved blocks sit `retrieval_near` tokens before the newest, or right after the sinks while the window
        # holds fewer (blocks attached to a conversation that has not filled its window, engine.documents): a
        # block placed past the newest token would be read from the future.
        near = min(self.window, self.cfg.retrieval_near)
        end = self.retrieval_start + self.groups_n * self.block
        start = self.sinks + max(0, self.n_window - near)
        self.slot_positions[self.retrieval_start : end] = self._group_offsets + start

    def slot_tokens(self) -> torch.Tensor:
        """(S,) the index in the conversation of the token each slot holds: sinks are the first tokens, the window
        the latest (its positions run in token order from `base`); -1 for retrieval groups and empty slots (what
        a sliding-window layer must never see, engine.memory.base.window_mask)."""
        out = torch.full_like(self.slot_positions, -1)  # (S,)
        out[: self.n_sink] = torch.arange(self.n_sink)
        filled = self.recent_slots(self.n_window)  # (n_window,) newest first
        base = self.sinks + self.resident_blocks * self.block
        out[filled] = self.slot_positions[filled] - base + self.n_sink + self.evicted
        return out

    @property
    def frame(self) -> int:
        return 1 + self.evicted % self.frame_period if self.frame_period > 0 else 0

    def mask(self, slots: torch.Tensor) -> torch.Tensor:
        """slots (T,) just written -> (T, S) bool: every valid slot, causal among the new tokens."""
        t = slots.shape[0]
        if t == 1:
            return self.valid[None].clone()
        m = self.valid[None].expand(t, -1).clone()  # (T, S)
        m[:, slots] = torch.ones(t, t, dtype=torch.bool).tril()
        return m

    def stats(self, token_bytes: int) -> TierStats:
        """This tier's stats; `token_bytes`: one token's KV in the slot table (all layers)."""
        held, c = self.held_tokens, self.counters
        return TierStats.make(
            "working", held, held * token_bytes, self.cfg.num_slots * token_bytes, c.hits, c.misses, self.evicted
        )

    def state(self) -> dict[str, Any]:
        return {
            "n_sink": self.n_sink,
            "n_window": self.n_window,
            "head": self.head,
            "evicted": self.evicted,
            "groups": [list(g) for g in self.groups],
        }

    def load_state(self, meta: dict[str, Any]) -> None:
        self.reset()
        self.n_sink, self.n_window, self.head, self.evicted = (
            int(meta[k]) for k in ("n_sink", "n_window", "head", "evicted")
        )
        self.valid[: self.n_sink] = True
        filled = (self.head - 1 - torch.arange(self.n_window)) % self.window + self.window_start
        self.valid[filled] = True
        self.set_groups([[int(b) for b in layer] for layer in meta["groups"]])
