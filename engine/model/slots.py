"""The slot table: a KV cache of up to S slots per layer, allocated in blocks as a conversation fills it, its read
copies, and the planning of each step's reads — the one owner of the invariant that a read copy always equals its
slot read, rotated afresh and rounded to the table's dtype.

The caller (the memory cascade) decides which token lives in which slot and at which position (`SlotBatch`), so
the same forward serves full attention, StreamingLLM-style sink+window, paged-in episodic blocks, batching and
Core ML conversion. Keys are stored *without* rotary embedding and rotated on read with the slot's current
position: the cascade re-numbers positions as the window slides without rewriting the cache, and while positions
equal absolute token indices the result equals standard attention exactly. (A multimodal-rotary model's keys are
stored turned by their token's own offsets, SlotBatch.offsets, and rotated by position on read all the same.)

Shapes: L layers, B batch, T new tokens, S slots, S' live slots, m attended slots, H query heads, Hkv key/value
heads, D head dim.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import (
    Rope,
    RotaryTable,
    apply_rope,
    layer_rope_kinds,
    masked_attention,
    pick_rope,
    small_step_attention,
    split_frame_attention,
)
from engine.model.config import ModelConfig
from engine.model.kv_types import Q8_BLOCK, KVType, dequantize_q8_0, quantize_q8_0

# Decoding steps through PyTorch (one token per row: KVCache.reads_pay) read the slot table through its read copies;
# chunks of several tokens convert and rotate every live slot on read, which their many queries amortize, and attend
# with PyTorch's fused kernel. A one-row decoding step on the native kernels reads neither: its attention rotates
# the stored keys as it reads them (engine/backends/native/spark_attention.c).
# One-row steps of at most this many tokens keep each token's query summary (KVCache.token_summaries): a speculative
# verify (engine.generation.speculative.MAX_DRAFT + 1 tokens) keeps those of the tokens it accepts.
TOKEN_SUMMARY_STEP = 16
# The table grows by at least this many slots at a time (and by half its size when larger): a fresh chat holds
# the slots it uses, a long one re-allocates a few times, never per token.
GROWTH_SLOTS = 256
# A CPU table's buffers from this size on are fresh anonymous pages, which the OS zero-fills when first written:
# the slots a step has not reached yet (the retrieval groups before anything is evicted, the reserve for the reply)
# hold no memory, where zeros written up front would.
LAZY_ZERO_BYTES = 1 << 20


def lazy_zeros(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """Zeros of `shape` in `like`'s dtype and device; on the CPU from LAZY_ZERO_BYTES on, pages of their own that
    hold memory only once written (the tensor keeps its mapping alive, and unmaps it when freed)."""
    nbytes = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or nbytes < LAZY_ZERO_BYTES:
        return like.new_zeros(shape)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: a forked process does not share it
    return torch.frombuffer(pages, dtype=like.dtype).view(shape)


@dataclass
class SlotBatch:
    """Everything one forward needs about where tokens go and what they see (built by the cascade).

    positions:      (B, T) long  position of each new token (for its query and its stored key)
    write_slots:    (B, T) long  slot each new token's K/V is written to
    slot_positions: (B, S') long position of each of the first S' <= S slots after this step's writes
    mask:           (B, 1, T, S') bool True where a new token may attend to a slot
    frame:          (B,) long or None, with frame_start (B,) long: a rotation frame for the slots from
                    frame_start on. RoPE scores depend only on position differences, so those keys may be rotated
                    at position + frame if the queries that score them are too. The cascade puts its window in a
                    frame that grows by one as the window's positions shrink by one: a window key's angle, and so
                    its read copy (KVCache), never changes while the window slides, and the sinks and paged-in
                    blocks before it keep theirs. One-row small steps use it; others rotate at plain positions.
    summary_weights: (B, T) float or None: each token's weight in the query summary (rows summing to 1; padding 0);
                    None weighs a row's tokens equally.
    local_mask:     (B, 1, T, S') bool or None: what a sliding-window layer's new tokens may attend to, a subset of
                    `mask` (the slots of the last `window` tokens, never a retrieved block); None: the same as
                    `mask` (everything attended is inside the window). Memories build it (engine.memory.base).
    offsets:        (B, T, 3) long or None: each new token's multimodal rotary offsets (engine.model.attention.
                    mrope_turn), applied to its q and k before the slot table's rotation, so its stored key
                    carries them; None: none (a text-only model, or no picture in the conversation).

    Only the leading S' slots take part (S' = slot_positions.shape[1]): a memory that has filled 300 of 4096 slots
    pays for 300, and a backend with a fixed shape (Core ML) pads the plan to its S with masked-off slots.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    slot_positions: torch.Tensor
    mask: torch.Tensor
    frame: torch.Tensor | None = None
    frame_start: torch.Tensor | None = None
    summary_weights: torch.Tensor | None = None
    local_mask: torch.Tensor | None = None
    offsets: torch.Tensor | None = None

    def position_bound(self) -> int:
        """One past the largest position this step rotates a query or key at, frames included: what the rotary
        table must hold for it (RotaryTable.cover)."""
        top = int(self.positions.max()) if self.positions.numel() else -1
        if self.slot_positions.numel():
            top = max(top, int(self.slot_positions.max()))
        if self.frame is not None and self.frame.numel():
            top += max(int(self.frame.max()), 0)
        return top + 1


def image_runs(tokens: torch.Tensor, image_from: int) -> torch.Tensor:
    """tokens (B, T) -> (B, T, T) bool, True where query i and a later token j lie in one run of picture ids (ids
    from `image_from` up, engine.vision: consecutive ones are one picture, as transformers groups Gemma 3's image
    tokens)."""
    image = tokens >= image_from  # (B, T)
    starts = image & ~F.pad(image, (1, 0))[:, :-1]  # (B, T) a run's first token
    group = torch.where(image, starts.cumsum(1), 0)  # (B, T) the run's number from 1, 0 for text
    t = tokens.shape[1]
    later = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)  # (T, T) j > i
    return (group[:, :, None] == group[:, None, :]) & image[:, :, None] & later


def open_image_runs(batch: SlotBatch, tokens: torch.Tensor, image_from: int) -> SlotBatch:
    """`batch` with each picture's tokens (image_runs) also seeing the later tokens of their picture that this step
    writes, in every layer (transformers' or-mask: a sliding layer's window bounds only the past). The step must
    hold the whole run for the result to be the model's (engine.generation.loop.PromptFeed keeps it whole)."""
    if not bool((tokens >= image_from).any()):
        return batch  # text only: no (B, T, T) table
    runs = image_runs(tokens, image_from)  # (B, T, T)
    if not bool(runs.any()):
        return batch
    b, t = tokens.shape
    seen = torch.zeros_like(batch.mask[:, 0])  # (B, T, S')
    seen.scatter_(2, batch.write_slots[:, None, :].expand(b, t, t), runs)  # real tokens write distinct slots
    local = None if batch.local_mask is None else batch.local_mask | seen[:, None]
    return dataclasses.replace(batch, mask=batch.mask | seen[:, None], local_mask=local)


@dataclass(frozen=True, kw_only=True)
class Refresh:
    """Stale read copies to re-derive from the stored k, v.

    slots:       (n,) the slots whose key copies are stale
    ranks:       (n,) the ranks holding them, or None: the copies are the leading n ranks, keys and values both
    rope:        cos, sin (B, 1, n, D) at those slots' positions
    value_slots: (n_v,) slots whose value copies are stale too (their slot changed; a value has no position)
    value_ranks: (n_v,) the ranks holding them, a subset of `ranks` (unused when `ranks` is None)
    """

    slots: torch.Tensor
    ranks: torch.Tensor | None
    rope: Rope
    value_slots: torch.Tensor | None = None
    value_ranks: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class StepReads:
    """How every layer of one forward reads the slot table (planned once per forward by `KVCache.plan`).

    rope_q:        cos, sin (B, 1, T, D) at the new tokens' positions
    width:         m, the attended slots held in read ranks [0, m) (small steps), or 0: read all S' slots in slot
                   order (large steps, where converting on read is amortized over many tokens)
    rope_slots:    large steps: cos, sin (B, 1, S', D) at every live slot's position; None for small steps
    refresh:       small steps whose written slots are not the only stale ranks: what to re-derive after the write
    write_ranks:   (T,) ranks of the written slots when a one-row step can write their read copies in one pass
                   (KVCache.write_rotated), else None
    pre:           with write_ranks: the other stale ranks (a page-in), re-derived before the write
    split:         with a frame, ranks [0, split) are scored by queries at their positions (rope_q) and ranks
                   [split, m) by queries in the frame (rope_q_framed); 0 without a frame
    rope_q_framed: cos, sin (1, 1, T, D) at the new tokens' positions in the frame, or None without one
    blocked:       (B, 1, 1, T, m) bool, True where a new token may NOT attend; None when nothing is
    blocked_local: as `blocked`, for sliding-window layers when SlotBatch.local_mask hides more than `mask` does
    """

    rope_q: Rope
    width: int
    rope_slots: Rope | None = None
    refresh: Refresh | None = None
    write_ranks: torch.Tensor | None = None
    pre: Refresh | None = None
    split: int = 0
    rope_q_framed: Rope | None = None
    blocked: torch.Tensor | None = None
    blocked_local: torch.Tensor | None = None


@dataclass(frozen=True, kw_only=True)
class DirectReads:
    """A one-row, one-token step whose attention reads the table itself (the native step), keys rotated on read.

    rope_q:        cos, sin (1, 1, 1, D) at the new token's position
    rope_q_framed: cos, sin (1, 1, 1, D) at its position in the rotation frame, or None without one
    slots:         (m,) long, the attended slots in slot order
    positions:     (m,) long, the position each attended key is rotated at (in the frame from rank `split` on)
    split:         ranks [0, split) are scored by the query at its position, the rest by the framed one
    """

    rope_q: Rope
    rope_q_framed: Rope | None
    slots: torch.Tensor
    positions: torch.Tensor
    split: int


def summarize_queries(q: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """The query summary: q (B, T, H*D) pre-RoPE (after q_proj and its bias) -> out (B, Hkv, D) fp32, the mean over
    the step's tokens (weighted by `weights` (B, T) when given) and over the query heads of each KV-head group
    (heads of a group are adjacent). Computed in the forward that makes q, never in a pass of its own. Returns
    each token's own summary, (B, T, Hkv, D) fp32."""
    b, t, hd = q.shape
    hkv, d = out.shape[1], out.shape[2]
    per_group = q.reshape(b, t, hkv, hd // (hkv * d), d).float().mean(dim=3)  # (B, T, Hkv, D)
    if weights is None:
        out.copy_(per_group.mean(dim=1))
    else:
        out.copy_(torch.einsum("bt,btkd->bkd", weights.float(), per_group))
    return per_group


class KVCache(nn.Module):
    """The slot table: k, v (L, B, Hkv, C, D) for slots [0, C) of the S the memory may use (C <= S, the capacity,
    grown in blocks as steps write further: `reserve`). Keys are stored unrotated (see module doc). With
    `kv_type` q8_0, k and v hold int8 codes and `k_scale`, `v_scale` (L, B, Hkv, C, D/32) their fp16 scales
    (engine.model.kv_types); every read dequantizes to the fp16 values the table stands for.

    Beside it, once a step through PyTorch reads them, live *read copies* in the table's dtype, in read order
    rather than slot order: rank r of `k_read`/`v_read` holds slot `read_slots[r]`, its key rotated at
    `read_positions[b, r]` (in the compute dtype, then rounded to the table's). A step of few tokens attends to
    the slots it may see, ranked in slot order, so its keys and values are the leading m ranks (no gather, even
    though a cascade's attended slots have gaps), and it re-derives only the ranks whose slot, rotation or content
    changed: in plain decoding just the new token's (SlotBatch.frame keeps a sliding window's rotations fixed;
    without it a sliding window re-rotates them all). The copies are always derived from the stored k, v. A
    table only the native step reads (one row on the CPU) never allocates them.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_read: torch.Tensor
    v_read: torch.Tensor
    read_slots: torch.Tensor
    read_positions: torch.Tensor
    summary: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        batch: int,
        num_slots: int,
        device: torch.device | str,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        kv_type: KVType = KVType.F16,
    ) -> None:
        """`dtype`: what k, v hold (fp16 or fp32) or, with `kv_type` q8_0, the dtype they read as (fp16)."""
        super().__init__()
        why_not = kv_type.fits(cfg.head_dim)
        if why_not is not None:
            raise ValueError(why_not)
        self.kv_type = kv_type
        self.value_dtype = dtype  # what a read of k, v gives
        stored = torch.int8 if kv_type is KVType.Q8_0 else dtype
        self.rope_kinds = layer_rope_kinds(cfg)  # each layer's rope in a multi-kind RotaryTable's lookups
        self.sliding = tuple(cfg.is_sliding(i) for i in range(cfg.num_hidden_layers))  # layers reading local_mask
        self.max_slots = num_slots  # S: the slots the memory may address
        self.compute_dtype = compute_dtype
        self.reads_in_use = False  # whether the read copies are kept (a step through PyTorch has read them)
        # A one-row short step's per-token query summaries, (T, Hkv, D) fp32 per layer (SlotStep.record_queries):
        # a speculative verify keeps those of the tokens it accepts. Shared by leading_rows views; the backend
        # clears it before each forward.
        self.token_summaries: list[torch.Tensor] = []
        empty = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, 0, cfg.head_dim)
        self.register_buffer("k", torch.zeros(empty, device=device, dtype=stored), persistent=False)  # (L,B,Hkv,C,D)
        self.register_buffer("v", torch.zeros(empty, device=device, dtype=stored), persistent=False)  # (L,B,Hkv,C,D)
        blocks = cfg.head_dim // Q8_BLOCK if kv_type is KVType.Q8_0 else 0  # no scales for an fp16 table
        scales = (*empty[:4], blocks)
        self.register_buffer(
            "k_scale", torch.zeros(scales, device=device, dtype=torch.float16), persistent=False
        )  # (L,B,Hkv,C,D/32)
        self.register_buffer(
            "v_scale", torch.zeros(scales, device=device, dtype=torch.float16), persistent=False
        )  # (L,B,Hkv,C,D/32)
        # Rotated keys are kept in the compute dtype: rounding them to the table's fp16 would give a step through
        # PyTorch (a prefill chunk, a speculative verify) other bits than the native step, which rotates each key in
        # fp32 as it reads it, and greedy tokens could then depend on how the tokens were fed. Values are not
        # rotated, so their copies stay in the table's dtype.
        self.register_buffer(
            "k_read", torch.zeros(empty, device=device, dtype=compute_dtype), persistent=False
        )  # (L,B,Hkv,0|C,D)
        self.register_buffer(
            "v_read", torch.zeros(empty, device=device, dtype=dtype), persistent=False
        )  # (L,B,Hkv,0|C,D)
        self.register_buffer(
            "read_slots", torch.full((num_slots,), -1, device=device, dtype=torch.long), persistent=False
        )  # (S,)
        self.register_buffer(
            "read_positions", torch.full((batch, num_slots), -1, device=device, dtype=torch.long), persistent=False
        )  # (B,S)
        # The last forward's query summary (summarize_queries): what the cascade routes episodic blocks with.
        summary_shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim)
        self.register_buffer(
            "summary", torch.zeros(summary_shape, device=device, dtype=torch.float32), persistent=False
        )  # (L,B,Hkv,D)

    @staticmethod
    def bytes_per_slot(
        cfg: ModelConfig,
        dtype: torch.dtype,
        read_copies: bool,
        compute_dtype: torch.dtype,
        kv_type: KVType = KVType.F16,
    ) -> int:
        """Bytes one slot of one row takes: k, v in `dtype` (or q8_0 blocks), every layer, and their read copies
        when a step through PyTorch keeps them (rotated keys in `compute_dtype`, values in `dtype`)."""
        per_tensor = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
        copies = compute_dtype.itemsize + dtype.itemsize if read_copies else 0
        stored = kv_type.bytes_per_value() if kv_type is KVType.Q8_0 else dtype.itemsize
        return int(per_tensor * (2 * stored + copies))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every (L, B, Hkv, C, *) buffer, for whole-row operations such as beam reordering (the read copies are
        (L, B, Hkv, 0, D) until used, the scales (L, B, Hkv, C, 0) in an fp16 table)."""
        return [self.k, self.v, self.k_scale, self.v_scale, self.k_read, self.v_read]

    def read(self, layer: int, name: str, slots: torch.Tensor | slice) -> torch.Tensor:
        """`name` ("k" or "v") of `layer` at `slots` (index (n,) or a slice) -> (B, Hkv, n, D) in the value dtype."""
        codes = self.get_buffer(name)[layer]  # (B, Hkv, C, D)
        if self.kv_type is KVType.F16:
            return codes.index_select(2, slots) if isinstance(slots, torch.Tensor) else codes[:, :, slots]
        scales = self.get_buffer(f"{name}_scale")[layer]  # (B, Hkv, C, D/32)
        if isinstance(slots, torch.Tensor):
            return dequantize_q8_0(codes.index_select(2, slots), scales.index_select(2, slots))
        return dequantize_q8_0(codes[:, :, slots], scales[:, :, slots])

    def read_rows(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s k, v at `slots` (n,), every layer -> (L, Hkv, n, D) each in the value dtype. A slot the table
        has not grown to reads as zeros, as one never written: reading the whole addressable range (a memory's
        state, its digest) must not grow the table to the trained context."""
        held = slots < self.capacity  # (n,)
        inside = slots if bool(held.all()) else slots[held]
        out = []
        for name in ("k", "v"):
            codes = self.get_buffer(name)[:, row].index_select(2, inside)  # (L, Hkv, n', D)
            if self.kv_type is KVType.Q8_0:
                codes = dequantize_q8_0(codes, self.get_buffer(f"{name}_scale")[:, row].index_select(2, inside))
            if inside is not slots:
                full = codes.new_zeros((codes.shape[0], codes.shape[1], slots.numel(), codes.shape[3]))
                full[:, :, held] = codes
                codes = full  # (L, Hkv, n, D)
            out.append(codes)
        return out[0], out[1]

    def write_rows(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (L, Hkv, n, D) at row `row`'s `slots` (n,), every layer (paging in, restoring)."""
        for name, x in (("k", k), ("v", v)):
            if self.kv_type is KVType.Q8_0:
                codes, scales = quantize_q8_0(x)
                self.get_buffer(name)[:, row].index_copy_(2, slots, codes)
                self.get_buffer(f"{name}_scale")[:, row].index_copy_(2, slots, scales)
            else:
                self.get_buffer(name)[:, row].index_copy_(2, slots, x.to(self.value_dtype))

    def allocated_bytes(self) -> int:
        """Bytes this table holds now: k, v and read copies as allocated (grown so far), bookkeeping included."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values() if t is not None)

    def leading_rows(self, n: int) -> KVCache:
        """This table's rows [0, n) as a KVCache sharing its storage and its read-copy bookkeeping (views).

        The read copies of rows left out are not kept up to date by forwards over the view: whoever switches
        between views of different sizes must `forget()` the read copies first (TorchBackend.forward does). A view
        does not grow: `reserve` the whole table before taking one."""
        view = copy.copy(self)
        view._buffers = dict(self._buffers)  # a module's shallow copy would share (and so overwrite) the dict
        for name in ("k", "v", "k_scale", "v_scale", "k_read", "v_read"):
            view._buffers[name] = self.get_buffer(name)[:, :n]  # (L, n, Hkv, C, *)
        view._buffers["read_positions"] = self.read_positions[:n]  # (n, S)
        view._buffers["summary"] = self.summary[:, :n]  # (L, n, Hkv, D): rows past n keep their last summary
        return view

    @property
    def batch(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_slots(self) -> int:
        """S, the slots the memory may address (the table holds `capacity` of them so far)."""
        return self.max_slots

    @property
    def capacity(self) -> int:
        return int(self.k.shape[3])

    def reserve(self, slots: int, read_copies: bool = False, exact: bool = False) -> None:
        """Hold at least slots [0, `slots`) (at most S), and the read copies too when `read_copies` (kept from then
        on): grows by GROWTH_SLOTS or by half (`exact`: to `slots` in whole GROWTH_SLOTS), keeping what the table
        holds. Slots never written read as zeros."""
        if slots > self.max_slots:
            raise IndexError(f"slot {slots - 1} is outside a table of {self.max_slots} slots")
        if read_copies and not self.reads_in_use:
            self.reads_in_use = True
            self.k_read, self.v_read = self._grown(self.k_read, self.capacity), self._grown(self.v_read, self.capacity)
        if slots <= self.capacity:
            return
        wanted = slots if exact else max(slots, self.capacity + self.capacity // 2)
        size = min(self.max_slots, -(-wanted // GROWTH_SLOTS) * GROWTH_SLOTS)
        self.k, self.v = self._grown(self.k, size), self._grown(self.v, size)
        self.k_scale, self.v_scale = self._grown(self.k_scale, size), self._grown(self.v_scale, size)
        if self.reads_in_use:
            self.k_read, self.v_read = self._grown(self.k_read, size), self._grown(self.v_read, size)

    def widen(self, num_slots: int) -> None:
        """Address up to `num_slots` slots from now on (the forks of a row's memory write past its own: ForkTable),
        keeping everything the table holds; what is allocated still grows only as steps write."""
        extra = num_slots - self.max_slots
        if extra <= 0:
            return
        self.read_slots = torch.cat((self.read_slots, self.read_slots.new_full((extra,), -1)))  # (S,)
        self.read_positions = torch.cat(
            (self.read_positions, self.read_positions.new_full((self.batch, extra), -1)), dim=1
        )  # (B, S)
        self.max_slots = num_slots

    def reserve_for(self, batch: SlotBatch, read_copies: bool = False) -> None:
        """`reserve` the slots a step reads (its S' live ones) and writes."""
        written = int(batch.write_slots.max()) + 1 if batch.write_slots.numel() else 0
        self.reserve(max(batch.slot_positions.shape[1], written), read_copies)

    def reserve_ahead(self, slots: int) -> None:
        """Grow once, in whole GROWTH_SLOTS, for the slots [0, `slots`) a prompt about to be read and its reply
        will use: no step-by-step growth, each of which holds two tables at once."""
        self.reserve(min(self.max_slots, slots), exact=True)

    @staticmethod
    def _grown(t: torch.Tensor, size: int) -> torch.Tensor:
        """t (L, B, Hkv, C, X) -> (L, B, Hkv, size, X) holding t's leading slots, zeros after."""
        out = lazy_zeros((*t.shape[:3], size, t.shape[4]), t)
        kept = min(size, t.shape[3])
        out[:, :, :, :kept] = t[:, :, :, :kept]
        return out

    def release(self) -> None:
        """Give the whole table back (an idle row): capacity 0, no read copies; the memory that used it has reset."""
        self.k, self.v = self._grown(self.k, 0), self._grown(self.v, 0)
        self.k_scale, self.v_scale = self._grown(self.k_scale, 0), self._grown(self.v_scale, 0)
        self.k_read, self.v_read = self._grown(self.k_read, 0), self._grown(self.v_read, 0)
        self.reads_in_use = False
        self.forget()

    def write(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (B, T); k, v (B, Hkv, T, D) -> stored at [layer, b, :, slots[b]]. Returns k, v as stored (in the
        table's value dtype: a q8_0 table's dequantized values)."""
        if self.kv_type is KVType.Q8_0:
            return self._write_q8_0(layer, slots, k, v)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if slots.shape[0] == 1:
            # One sequence: a plain index_copy_ is the cheapest write.
            self.k[layer].index_copy_(2, slots[0], k)
            self.v[layer].index_copy_(2, slots[0], v)
            return k, v
        idx = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, Hkv, T, D)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)
        return k, v

    def _write_q8_0(
        self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for name, x in (("k", k), ("v", v)):
            codes, scales = quantize_q8_0(x)  # (B, Hkv, T, D) int8, (B, Hkv, T, D/32) fp16
            for buffer, part in (
                (self.get_buffer(name)[layer], codes),
                (self.get_buffer(f"{name}_scale")[layer], scales),
            ):
                if slots.shape[0] == 1:
                    buffer.index_copy_(2, slots[0], part)
                else:
                    buffer.scatter_(2, slots[:, None, :, None].expand(-1, part.shape[1], -1, part.shape[3]), part)
            out.append(dequantize_q8_0(codes, scales))
        return out[0], out[1]

    def forget(self, slots: torch.Tensor | None = None) -> None:
        """Drop the read copies of `slots` (all when None) after their k, v changed: restores, paging in, writes."""
        if slots is None:
            self.read_slots.fill_(-1)
        elif slots.numel() == 1:  # a decoding step's write: one comparison, not isin's sort
            self.read_slots.masked_fill_(self.read_slots == slots.reshape(()), -1)
        else:
            self.read_slots.masked_fill_(torch.isin(self.read_slots, slots), -1)

    def plan_direct(self, batch: SlotBatch, rope: RotaryTable) -> DirectReads:
        """A one-row, one-token step's reads for an attention that rotates keys as it reads them (the native step):
        the attended slots and their rotation positions; the read copies of the written slot are dropped."""
        self.reserve_for(batch)
        self.forget(batch.write_slots.flatten())
        attended = batch.mask.reshape(-1).nonzero().squeeze(1)  # (m,) the slots the token attends to
        positions = batch.slot_positions[0].index_select(0, attended)  # (m,)
        split, rope_q_framed = 0, None
        if batch.frame is not None and batch.frame_start is not None and int(batch.frame[0]):
            in_frame = attended >= batch.frame_start[0]  # (m,) a suffix
            split = int(attended.numel() - in_frame.sum())
            positions = positions + batch.frame[0] * in_frame
            rope_q_framed = rope.lookup(batch.positions + batch.frame[:, None])
        return DirectReads(
            rope_q=rope.lookup(batch.positions),
            rope_q_framed=rope_q_framed,
            slots=attended,
            positions=positions.contiguous(),
            split=split,
        )

    def reads_pay(self, tokens: int) -> bool:
        """Whether a step of `tokens` new tokens per row reads through the read copies: a decoding step through
        PyTorch (one token: a batch, a GPU, a q8_0 table), which repeats. A chunk of several tokens (a short
        message after a long conversation, a prompt's piece before a cut, a speculative verify) rotates the live
        slots on read instead: the copies of a long table cost more bytes than the table. By the step's shape
        alone, so that a conversation fed again on the same schedule (a compact session's restore) takes the
        same paths and gets the same bits."""
        return tokens == 1

    def plan(self, batch: SlotBatch, rope: RotaryTable) -> StepReads:
        """How this step reads the table; for small steps, moves the read bookkeeping to the attended slots (their
        copies are brought up to date by the forward that follows, layer by layer)."""
        rope_q = rope.lookup(batch.positions)
        b, t = batch.positions.shape
        small = self.reads_pay(t)
        self.reserve_for(batch, read_copies=small)
        if not small:
            self.forget(batch.write_slots.flatten())
            return StepReads(rope_q=rope_q, width=0, rope_slots=rope.lookup(batch.slot_positions))
        one_query = batch.mask.shape[:-1].numel() == 1  # one row, one token: it attends to exactly `attended`
        rows = batch.mask.reshape(-1, batch.mask.shape[-1])  # (B*Hm*T, S')
        attended = (rows[0] if one_query else rows.any(0)).nonzero().squeeze(1)  # (m,) slots anything attends to
        positions = batch.slot_positions.index_select(1, attended)  # (B, m) rotation positions of their keys
        split, rope_q_framed, frame_start = 0, None, None
        if b == 1 and batch.frame is not None and batch.frame_start is not None and int(batch.frame[0]):
            frame_start = batch.frame_start[0]
            in_frame = attended >= frame_start  # (m,) a suffix: ranks follow slot order
            split = int(attended.numel() - in_frame.sum())
            positions = positions + batch.frame[:, None] * in_frame
            rope_q_framed = rope.lookup(batch.positions + batch.frame[:, None])
        stale, moved = self._move_reads(batch, attended, positions)
        m, n = attended.numel(), stale.numel()
        blocked: torch.Tensor | None = None
        if not one_query:
            blocked = ~batch.mask.index_select(-1, attended).unsqueeze(1)  # (B, 1, 1, T, m)
            if not blocked.any():  # e.g. new tokens over exactly the slots each attends
                blocked = None
        blocked_local: torch.Tensor | None = None
        if batch.local_mask is not None:
            blocked_local = ~batch.local_mask.index_select(-1, attended).unsqueeze(1)  # (B, 1, 1, T, m)
        base: dict[str, Any] = {
            "rope_q": rope_q,
            "width": m,
            "split": split,
            "rope_q_framed": rope_q_framed,
            "blocked": blocked,
            "blocked_local": blocked_local,
        }
        if n * 2 > m:  # most ranks moved (e.g. a sliding window without a frame re-numbers its slots): rewrite all
            return StepReads(**base, refresh=Refresh(slots=attended, ranks=None, rope=rope.lookup(positions)))

        def refresh(ranks: torch.Tensor, value_ranks: torch.Tensor) -> Refresh:
            return Refresh(
                slots=attended.index_select(0, ranks),
                ranks=ranks,
                rope=rope.lookup(positions.index_select(1, ranks)),
                value_slots=attended.index_select(0, value_ranks),
                value_ranks=value_ranks,
            )

        # The one-pass write rotates the new keys as their queries are rotated (in the frame when there is one), so
        # it serves only steps whose written slots all sit in that frame: not sinks written while a frame is on.
        same_frame = frame_start is None or bool((batch.write_slots[0] >= frame_start).all())
        if b == 1 and n == t and same_frame:  # n stale ranks for T written slots: check they are theirs
            ranks = torch.searchsorted(attended, batch.write_slots[0]).clamp_(max=m - 1)  # (T,)
            if torch.equal(attended.index_select(0, ranks), batch.write_slots[0]):
                return StepReads(**base, write_ranks=ranks)
        elif b == 1 and t == 1 and same_frame:
            # A decoding step right after the memory changed (a page-in, a re-route): re-derive the other stale
            # ranks first, then take the one-pass write (and the native step) as in plain decoding.
            rank = torch.searchsorted(attended, batch.write_slots[0]).clamp_(max=m - 1)  # (1,)
            others = stale != rank
            if bool(attended[rank] == batch.write_slots[0, 0]) and int(others.sum()) == n - 1:
                pre = refresh(stale[others], moved[moved != rank])
                return StepReads(**base, write_ranks=rank, pre=pre)
        return StepReads(**base, refresh=refresh(stale, moved))

    def _move_reads(
        self, batch: SlotBatch, attended: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hold the attended slots (m,), in slot order, at ranks [0, m) with keys rotated at `positions` (B, m).

        Returns the stale ranks of keys (n,): those whose slot or rotation changed since their copy was made, or
        whose slot this step writes; and the stale ranks of values (n_v,) <= n: only those whose slot changed or
        is written (a value does not depend on its position)."""
        self.forget(batch.write_slots.flatten())  # written slots always get a fresh copy
        m = attended.numel()
        moved = self.read_slots[:m] != attended  # (m,) holds another slot, or a forgotten one
        stale = moved | (self.read_positions[:, :m] != positions).any(0)  # (m,)
        self.read_slots[:m] = attended
        self.read_slots[m:] = -1
        self.read_positions[:, :m] = positions
        return stale.nonzero().squeeze(1), moved.nonzero().squeeze(1)

    def write_rotated(
        self,
        layer: int,
        slots: torch.Tensor,
        ranks: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rope: Rope,
    ) -> torch.Tensor:
        """Plain decoding, one row whose only stale ranks are the slots it writes: store k, v (1, Hkv, T, D) at
        `slots` (1, T), and rotate the queries (1, H, T, D) and the stored keys in one pass with cos/sin (1, 1, T, D)
        into the read copies at `ranks` (T,), instead of reading the keys back. Returns the rotated queries."""
        k, v = self.write(layer, slots, k, v)
        h = q.shape[1]
        qk = apply_rope(
            torch.cat((q, k.to(q.dtype)), dim=1), *pick_rope(rope, self.rope_kinds[layer])
        )  # (1, H + Hkv, T, D)
        self.k_read[layer].index_copy_(2, ranks, qk[:, h:].to(self.k_read.dtype))
        self.v_read[layer].index_copy_(2, ranks, v)  # already in the table's dtype
        return qk[:, :h]

    def refresh(self, layer: int, r: Refresh) -> None:
        """Re-derive stale read copies of `layer` from the stored k, v."""
        rope = pick_rope(r.rope, self.rope_kinds[layer])
        fresh_k = apply_rope(self.read(layer, "k", r.slots).to(self.compute_dtype), *rope).to(
            self.k_read.dtype
        )  # (B, Hkv, n, D)
        if r.ranks is None:
            n = r.slots.numel()
            self.k_read[layer][:, :, :n] = fresh_k
            self.v_read[layer][:, :, :n] = self.read(layer, "v", r.slots)
            return
        self.k_read[layer].index_copy_(2, r.ranks, fresh_k)
        if r.value_ranks is not None and r.value_slots is not None and r.value_ranks.numel():
            fresh_v = self.read(layer, "v", r.value_slots).to(self.v_read.dtype)  # (B, Hkv, n_v, D)
            self.v_read[layer].index_copy_(2, r.value_ranks, fresh_v)

    def refresh_all_layers(self, r: Refresh) -> None:
        for layer in range(self.k.shape[0]):
            self.refresh(layer, r)


class SlotStep:
    """One forward over the slot table (engine.model.attention.StepAttention): each layer stores its new k, v in the
    slots the batch names, keeps the read copies exact, and attends over the slots the batch lets it see."""

    def __init__(self, cache: KVCache, batch: SlotBatch, reads: StepReads) -> None:
        self.cache, self.batch, self.reads = cache, batch, reads

    def record_queries(self, layer: int, q: torch.Tensor) -> None:
        per_token = summarize_queries(q, self.batch.summary_weights, self.cache.summary[layer])  # (B, T, Hkv, D)
        if per_token.shape[0] == 1 and per_token.shape[1] <= TOKEN_SUMMARY_STEP:  # one row, a few tokens (a verify)
            self.cache.token_summaries.append(per_token[0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache, batch, reads = self.cache, self.batch, self.reads
        kind, local = cache.rope_kinds[layer], cache.sliding[layer]
        rope_q = pick_rope(reads.rope_q, kind)
        if reads.rope_slots is not None:  # a large step: convert and rotate every live slot on read
            cache.write(layer, batch.write_slots, k, v)
            live = batch.slot_positions.shape[1]  # S'
            keys = apply_rope(cache.read(layer, "k", slice(0, live)).to(q.dtype), *pick_rope(reads.rope_slots, kind))
            values = cache.read(layer, "v", slice(0, live)).to(q.dtype)  # (B, Hkv, S', D)
            mask = batch.local_mask if local and batch.local_mask is not None else batch.mask
            return masked_attention(apply_rope(q, *rope_q), keys, values, mask)  # (B, H, T, D)
        blocked = reads.blocked_local if local and reads.blocked_local is not None else reads.blocked
        # New keys and the queries that score them share a rotation: in the frame when there is one.
        rope_new = reads.rope_q if reads.rope_q_framed is None else reads.rope_q_framed
        q_raw = q
        if reads.write_ranks is not None:
            if reads.pre is not None:
                cache.refresh(layer, reads.pre)
            q = cache.write_rotated(layer, batch.write_slots, reads.write_ranks, q, k, v, rope_new)  # (B, H, T, D)
        else:
            assert reads.refresh is not None  # KVCache.plan gives a small step one or the other
            cache.write(layer, batch.write_slots, k, v)
            q = apply_rope(q, *pick_rope(rope_new, kind))  # (B, H, T, D)
            cache.refresh(layer, reads.refresh)
        m = reads.width
        # (B, Hkv, m, D) each, widened to the compute dtype for the product (a no-op where they match)
        keys, values = cache.k_read[layer][:, :, :m].to(q.dtype), cache.v_read[layer][:, :, :m].to(q.dtype)
        if reads.rope_q_framed is None:
            return small_step_attention(q, keys, values, blocked)  # (B, H, T, D)
        return split_frame_attention(apply_rope(q_raw, *rope_q), q, keys, values, reads.split, blocked)


class ForkTable:
    """Copy-on-write forks of one row's memory (beam search, engine.generation.beam): which slots each fork's tokens
    live in, past the `base` slots the memory itself owns.

    A fork is a node: the token it last wrote and its parent. Forking never copies KV: every fork of a node sees
    the node's whole chain (and the memory's slots) by mask, and a fork's next token is written to a slot of its own
    (KV is written once and never rewritten, so a shared slot needs no copy-on-write of its contents; what is
    shared is the slot). A node lives while a fork or a child holds it; when the last one lets go its slot is free
    for the next write. So N beams hold the memory's slots once plus the distinct tokens of their tree, not N
    copies of everything.
    """

    ROOT = -1  # the node every fork starts from: the memory's own slots, no token of a fork

    def __init__(self, base: int) -> None:
        self.base = base  # first slot past the memory's own: forks write in [base, base + high_water)
        self.parent: dict[int, int] = {}  # node -> parent node (ROOT for the first token after the memory)
        self.slot: dict[int, int] = {}  # node -> the slot its token's KV is in
        self.depth: dict[int, int] = {}  # node -> tokens on its chain (1 for a child of ROOT)
        self.refs: dict[int, int] = {}  # node -> forks and children holding it
        self.free: list[int] = []  # slots given back, reused before the table grows
        self.high_water = 0  # slots past `base` ever used: what the table had to grow by
        self._next = 0

    @property
    def held(self) -> int:
        """Slots the forks hold now (the distinct tokens of their tree)."""
        return len(self.slot)

    def write(self, parents: Sequence[int]) -> list[int]:
        """One new node under each of `parents` (ROOT or a held node): their ids, each holding one fresh slot and
        one reference (the fork's). Each parent loses the reference its fork held (the fork moved on) and gains
        one from its child; the caller `hold`s a parent first for every extra fork that shares it."""
        nodes = []
        for p in parents:
            node, self._next = self._next, self._next + 1
            if self.free:
                slot = self.free.pop()
            else:
                slot, self.high_water = self.base + self.high_water, self.high_water + 1
            self.parent[node], self.slot[node], self.refs[node] = p, slot, 1
            self.depth[node] = 1 if p == self.ROOT else self.depth[p] + 1
            nodes.append(node)
        return nodes

    def hold(self, node: int) -> None:
        """One more fork shares `node`."""
        if node != self.ROOT:
            self.refs[node] += 1

    def drop(self, node: int) -> None:
        """A fork lets go of `node`: nodes no fork or child holds free their slots, up the chain."""
        while node != self.ROOT:
            self.refs[node] -= 1
            if self.refs[node]:
                return
            parent = self.parent.pop(node)
            self.free.append(self.slot.pop(node))
            del self.refs[node], self.depth[node]
            node = parent

    def chain(self, node: int) -> list[int]:
        """The slots of `node`'s tokens, oldest first (empty for ROOT)."""
        slots: list[int] = []
        while node != self.ROOT:
            slots.append(self.slot[node])
            node = self.parent[node]
        return slots[::-1]
