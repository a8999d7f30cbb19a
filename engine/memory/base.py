"""Per-sequence memory: which token's KV lives in which slot of the backend's slot table.

`Memory.plan(ids)` is called before every forward with the ids about to be fed. It does every memory side
effect first — saving KV that is about to be overwritten, paging blocks in — and returns the `RowPlan` the
forward needs. The cascade (engine.memory.cascade) is the real implementation; `FullAttentionMemory` here is plain
contiguous attention over every token (the reference the cascade is compared against, and the benchmarks'
"full attention" peer).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.backends.base import Backend
from engine.errors import InputTooLarge, SessionFileError
from engine.memory.values import (
    KV_DTYPE,
    MAX_COUNT,
    SchemaError,
    StateTarget,
    check_tensor,
    exact_names,
    memory_kind,
    tokens_in_vocab,
)
from engine.model.network import ROTARY_HEADROOM, SlotBatch


@dataclass
class RowPlan:
    """One sequence row's part of a SlotBatch (see engine.model.network.SlotBatch for meanings).

    positions (T,) long, write_slots (T,) long, slot_positions (S',) long, mask (T, S') bool  (S' <= S live slots)
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    slot_positions: torch.Tensor
    mask: torch.Tensor
    frame: int = 0  # rotation frame of the slots from frame_start on (engine.model.network.SlotBatch)
    frame_start: int = 0
    local_mask: torch.Tensor | None = None  # (T, S') what sliding-window layers see; None: the same as mask
    offsets: torch.Tensor | None = None  # (T, 3) multimodal rotary offsets (Backend.position_offsets); None: none

    def as_batch(self) -> SlotBatch:
        """A B=1 SlotBatch: positions (1,T), write_slots (1,T), slot_positions (1,S), mask (1,1,T,S), frame (1,)."""
        framed = self.frame != 0
        return SlotBatch(
            self.positions[None],
            self.write_slots[None],
            self.slot_positions[None],
            self.mask[None, None],
            torch.tensor([self.frame]) if framed else None,
            torch.tensor([self.frame_start]) if framed else None,
            local_mask=None if self.local_mask is None else self.local_mask[None, None],
            offsets=None if self.offsets is None else self.offsets[None],
        )


@dataclass(frozen=True)
class ForkView:
    """What the next token of a memory would see, for forks that write past the memory's own slots (beam search:
    engine.generation.beam, engine.model.slots.ForkTable) and never change the memory itself.

    slot_positions (S0,) long, visible (S0,) bool, slot_tokens (S0,) long over the memory's own slots [0, S0): each
    slot's position, whether the next token attends to it, and the index in the conversation of its token (-1 for
    a retrieved block or an empty slot: engine.memory.base.window_mask). A fork's token at depth d (1 for the next
    token) takes position `position + d - 1` and conversation index `index + d - 1`; slots from `frame_start` on,
    the forks' own included, are rotated in `frame` (engine.model.slots.SlotBatch). `max_depth`: the most tokens a
    fork may add with its positions inside the model's rotary table.
    """

    position: int
    index: int
    slot_positions: torch.Tensor
    visible: torch.Tensor
    slot_tokens: torch.Tensor
    max_depth: int
    frame: int = 0
    frame_start: int = 0


def window_mask(
    mask: torch.Tensor, slot_tokens: torch.Tensor, query_tokens: torch.Tensor, window: int
) -> torch.Tensor | None:
    """What a sliding-window layer's new tokens may attend to: mask (T, S'), slot_tokens (S',) the index in the
    conversation of the token each slot holds (-1 for a retrieved block or an empty slot), query_tokens (T,) the new
    tokens' indices -> (T, S') the slots of the last `window` tokens (each query's own included) that `mask` allows,
    never a retrieved one; None when that is `mask` itself (nothing attended has left the window), or window 0."""
    if not window:
        return None
    local = mask & (slot_tokens[None, :] > query_tokens[:, None] - window) & (slot_tokens[None, :] >= 0)
    return None if torch.equal(local, mask) else local


class Memory(Protocol):
    """The memory of one sequence (one row of the backend's slot table)."""

    row: int
    tokens: list[int]  # every token fed so far, in order

    def plan(self, ids: list[int]) -> RowPlan:
        """Reserve slots for `ids` (evicting / paging as needed) and return where they go and what they see."""
        ...

    def reuse_prefix(self, ids: list[int]) -> int:
        """On an empty memory: restore KV for the longest cached prefix of `ids` (persistent tier), feed nothing,
        and return how many leading tokens are now in place (0 when nothing is cached or memory is not empty)."""
        ...

    def after_forward(self) -> None:
        """Called after each forward of a plan (e.g. to persist blocks whose KV is now computed)."""
        ...

    def reset(self) -> None:
        """Forget everything (the slot table row is considered empty)."""
        ...

    def max_feed(self) -> int:
        """The most tokens one plan may take (prefill chunks are clamped to it)."""
        ...

    def slots_after(self, tokens: int) -> int:
        """The slots [0, n) of the backend's table this memory's row will use once `tokens` more are fed (a hint
        for the table's growth, Backend.expect)."""
        ...

    def speculation_room(self) -> int:
        """The most tokens the next plan may take and `rollback` then take back in part (a speculative verify: the
        last sampled token and its drafts), each computed as if fed one by one; below 2, decode plainly."""
        ...

    def rollback(self, n: int) -> None:
        """Take back the last `n` tokens of the last plan (drafts its verify rejected), after its forward and before
        `after_forward`: as if they had never been fed — their slots free, no tier, digest or saved state sees them.
        Part of a plan only within `speculation_room()`; the whole of any plan (a forward stopped midway, which
        wrote some layers' K/V: what the plan pushed out of the memory's slots is put back).

        Called after every verify, with 0 when it kept every token: the memory then records the plan's tokens as if
        fed one by one (the cascade's routing query)."""
        ...

    def fork_view(self) -> ForkView:
        """What the next token would see, changing nothing: forks (beam search) share this memory's slots by mask
        and write their own tokens past them."""
        ...

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Everything needed to restore this memory exactly: (JSON-able meta, canonical fp16 host tensors)."""
        ...

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of `state()` on a memory over a backend of the same model; writes KV back into the slots."""
        ...

    def state_target(self) -> StateTarget:
        """What a state must fit to load here (its checker runs before load_state)."""
        ...


class FullAttentionMemory:
    """Token i lives in slot i at position i: exact full attention, capacity = the slot table size."""

    def __init__(self, backend: Backend, row: int = 0) -> None:
        self.backend = backend
        self.row = row
        self.tokens: list[int] = []
        self._slot_positions = torch.arange(backend.num_slots)  # (S,) position == slot

    def reset(self) -> None:
        self.tokens = []

    def reuse_prefix(self, ids: list[int]) -> int:
        return 0

    def max_feed(self) -> int:
        return self.backend.num_slots - len(self.tokens)

    def slots_after(self, tokens: int) -> int:
        return min(self.backend.num_slots, len(self.tokens) + tokens)

    def after_forward(self) -> None:
        pass

    def speculation_room(self) -> int:
        return self.max_feed()

    def rollback(self, n: int) -> None:
        # The taken-back slots are written again by the next plan (which refreshes their read copies).
        if n:
            del self.tokens[-n:]

    def fork_view(self) -> ForkView:
        n, c = len(self.tokens), self.backend.config
        held = torch.arange(n)  # (n,) token i in slot i at position i
        table = c.max_position_embeddings + ROTARY_HEADROOM
        return ForkView(n, n, held, torch.ones(n, dtype=torch.bool), held, max_depth=table - n)

    def state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        k, v = self.backend.read_kv(self.row, torch.arange(len(self.tokens)))  # (L, Hkv, N, D) each
        return {"kind": "full", "tokens": list(self.tokens)}, {"k": k, "v": v}

    def state_target(self) -> StateTarget:
        c = self.backend.config
        return StateTarget(
            c.id_limit, (c.num_hidden_layers, c.num_key_value_heads, c.head_dim), max_slots=self.backend.num_slots
        )

    def load_state(self, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        try:
            check_full_state(meta, tensors, self.state_target())
        except SchemaError as exc:
            raise SessionFileError(f"The saved memory cannot be restored: it {exc}.") from None
        tokens = [int(t) for t in meta["tokens"]]
        self.backend.write_kv(self.row, torch.arange(len(tokens)), tensors["k"], tensors["v"])
        self.tokens = tokens

    def plan(self, ids: list[int]) -> RowPlan:
        start, t, s = len(self.tokens), len(ids), self.backend.num_slots
        if start + t > s:
            raise InputTooLarge(f"The conversation ({start + t} tokens) exceeds the {s}-token full-attention cache.")
        live = start + t  # only the filled slots take part (see SlotBatch)
        if live > self._slot_positions.numel():  # the table was widened (Backend.widen) since this memory was made
            self._slot_positions = torch.arange(s)
        new = torch.arange(start, live)  # (T,)
        mask = self._slot_positions[None, :live] <= new[:, None]  # (T, S') causal
        self.tokens.extend(ids)
        local = window_mask(mask, self._slot_positions[:live], new, self.backend.config.sliding_window)
        offsets = self.backend.position_offsets(self.tokens, t)
        return RowPlan(new, new, self._slot_positions[:live], mask, local_mask=local, offsets=offsets)


def check_full_state(meta: Any, tensors: Mapping[str, torch.Tensor], target: StateTarget) -> None:
    """FullAttentionMemory's state: tokens, and their KV (L, Hkv, n, D) fp16."""
    meta = memory_kind(meta, "full", target.max_slots is not None)
    assert target.max_slots is not None
    tokens = tokens_in_vocab(meta.get("tokens"), "tokens", target.vocab_size, MAX_COUNT)
    if len(tokens) > target.max_slots:
        raise SchemaError(
            f"holds {len(tokens)} tokens, more than the {target.max_slots} slots of this full-attention memory"
        )
    L, hkv, d = target.kv_dims
    for name in ("k", "v"):
        check_tensor(tensors, name, KV_DTYPE, (L, hkv, len(tokens), d))
    exact_names(tensors, {"k", "v"})
