"""The slot table as MLX arrays, and one forward's attention over it (engine.backends.mlx.network.Attend).

Per layer, k and v are (B, C, Hkv, D) fp16 for slots [0, C) of the S the memory may address, grown as steps write
further (as engine.model.slots.KVCache grows, by the same GROWTH_SLOTS): keys unrotated, so the canonical host
layout (L, Hkv, n, D) fp16 is a transpose away and the cascade, sessions and the prefix cache see the same bytes as
on any backend. A step writes its new k, v first, then reads the live slots [0, S') back, rotates the keys at their
slots' positions and attends with the batch's mask. Rotation frames (SlotBatch.frame) are not used: RoPE scores
depend only on position differences, so plain positions give the same attention up to rounding.

Shapes: L layers, B rows, T new tokens, S' live slots, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import torch

from engine.model.attention import RotaryTable, layer_rope_kinds
from engine.model.config import ModelConfig
from engine.model.slots import GROWTH_SLOTS, TOKEN_SUMMARY_STEP, SlotBatch

KV_DTYPE = mx.float16  # what the table holds: the canonical KV dtype, so reads and writes convert nothing


def host(t: torch.Tensor) -> mx.array:
    return mx.array(t.detach().to("cpu").numpy())


class MLXSlotTable:
    """k, v per layer (B, C, Hkv, D) fp16, C the capacity grown so far (at most `max_slots`)."""

    def __init__(self, cfg: ModelConfig, batch: int, num_slots: int) -> None:
        self.cfg = cfg
        self.batch = batch
        self.max_slots = num_slots
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []
        self._resize(0)

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[1])

    def _resize(self, size: int) -> None:
        c = self.cfg
        kept = 0 if not self.k else min(size, self.capacity)
        old_k, old_v = self.k, self.v
        shape = (self.batch, size, c.num_key_value_heads, c.head_dim)
        self.k = [mx.zeros(shape, dtype=KV_DTYPE) for _ in range(c.num_hidden_layers)]
        self.v = [mx.zeros(shape, dtype=KV_DTYPE) for _ in range(c.num_hidden_layers)]
        if kept:
            for i in range(c.num_hidden_layers):
                self.k[i][:, :kept] = old_k[i][:, :kept]
                self.v[i][:, :kept] = old_v[i][:, :kept]
        mx.eval(self.k, self.v)

    def reserve(self, slots: int, exact: bool = False) -> None:
        """Hold slots [0, `slots`): grown by GROWTH_SLOTS or by half (`exact`: to `slots` in whole GROWTH_SLOTS)."""
        if slots > self.max_slots:
            raise IndexError(f"slot {slots - 1} is outside a table of {self.max_slots} slots")
        if slots <= self.capacity:
            return
        wanted = slots if exact else max(slots, self.capacity + self.capacity // 2)
        self._resize(min(self.max_slots, -(-wanted // GROWTH_SLOTS) * GROWTH_SLOTS))

    def release(self) -> None:
        self._resize(0)

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.k, *self.v))

    def read_rows(self, row: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row `row`'s k, v at `slots` (n,) -> (L, Hkv, n, D) fp16 each; slots past the capacity read as zeros."""
        held = slots < self.capacity
        idx = mx.array(np.where(held, slots, 0).astype(np.int32))
        out = []
        for table in (self.k, self.v):
            x = mx.stack([t[row][idx] for t in table]).transpose(0, 2, 1, 3)  # (L, Hkv, n, D)
            a = np.array(x)
            a[:, :, ~held] = 0
            out.append(a)
        return out[0], out[1]

    def write_rows(self, row: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (L, Hkv, n, D) fp16 at row `row`'s `slots` (n,), every layer."""
        idx = mx.array(slots.astype(np.int32))
        kt, vt = mx.array(k).transpose(0, 2, 1, 3), mx.array(v).transpose(0, 2, 1, 3)  # (L, n, Hkv, D)
        for i in range(self.cfg.num_hidden_layers):
            self.k[i][row, idx] = kt[i]
            self.v[i][row, idx] = vt[i]
        mx.eval(self.k, self.v)


class RopeTables:
    """The torch backend's RotaryTable (the same cos and signed sin, so both backends rotate by the same numbers),
    mirrored into MLX arrays (P, D) or (K, P, D) in the compute dtype whenever it grows."""

    def __init__(self, cfg: ModelConfig, limit: int, dtype: mx.Dtype) -> None:
        self.table = RotaryTable(cfg, limit, "cpu", torch.float32)
        self.dtype = dtype
        self.kinds = layer_rope_kinds(cfg)
        self._sync()

    def _sync(self) -> None:
        self.cos, self.sin = host(self.table.cos).astype(self.dtype), host(self.table.sin).astype(self.dtype)
        self.size = self.table.size

    def cover(self, n: int) -> None:
        self.table.cover(n)
        if self.table.size != self.size:
            self._sync()

    def lookup(self, positions: mx.array, layer: int) -> tuple[mx.array, mx.array]:
        """positions (B, N) -> cos, signed sin (B, 1, N, D) of `layer`'s rope."""
        kind = self.kinds[layer]
        cos, sin = (self.cos, self.sin) if kind is None else (self.cos[kind], self.sin[kind])
        return cos[positions][:, None], sin[positions][:, None]


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """x (B, heads, N, D) by cos and signed sin (B, 1, N, D): Hugging Face's half-split pairs, as apply_rope."""
    half = x.shape[-1] // 2
    return x * cos + mx.concatenate([x[..., half:], x[..., :half]], axis=-1) * sin


class MLXStep:
    """One forward over the table's leading `rows` rows: writes each layer's new k, v into the batch's write slots,
    attends over the live slots, and keeps the query summary of each layer."""

    def __init__(self, table: MLXSlotTable, batch: SlotBatch, rope: RopeTables, dtype: mx.Dtype) -> None:
        self.table, self.rope, self.dtype = table, rope, dtype
        b, t = batch.positions.shape
        self.rows, self.live = b, int(batch.slot_positions.shape[1])
        self.row_idx = mx.broadcast_to(mx.arange(b)[:, None], (b, t))  # (B, T)
        self.write_slots = host(batch.write_slots).astype(mx.int32)  # (B, T)
        self.positions = host(batch.positions).astype(mx.int32)  # (B, T)
        self.slot_positions = host(batch.slot_positions).astype(mx.int32)  # (B, S')
        low = mx.array(mx.finfo(dtype).min, dtype=dtype)
        # Additive masks, a blocked score the dtype's lowest finite value (not -inf): a padding row with nothing to
        # attend to stays finite rather than turning into NaN, as the torch backend's small steps do.
        self.mask = mx.where(host(batch.mask), mx.array(0.0, dtype=dtype), low)  # (B, 1, T, S')
        self.local = (
            None if batch.local_mask is None else mx.where(host(batch.local_mask), mx.array(0.0, dtype=dtype), low)
        )
        self.sliding = tuple(table.cfg.is_sliding(i) for i in range(table.cfg.num_hidden_layers))
        self.weights = None if batch.summary_weights is None else host(batch.summary_weights).astype(mx.float32)
        self.summaries: list[mx.array] = []  # per layer (B, Hkv, D) fp32
        self.token_summaries: list[mx.array] = []  # per layer (T, Hkv, D) fp32, one row of a few tokens only
        self.keep_tokens = b == 1 and t <= TOKEN_SUMMARY_STEP

    def record_queries(self, layer: int, q: mx.array) -> None:
        """As engine.model.slots.summarize_queries: the mean over each KV head's query heads, then over tokens."""
        b, t, hd = q.shape
        hkv, d = self.table.cfg.num_key_value_heads, self.table.cfg.head_dim
        per_group = q.astype(mx.float32).reshape(b, t, hkv, hd // (hkv * d), d).mean(axis=3)  # (B, T, Hkv, D)
        if self.weights is None:
            self.summaries.append(per_group.mean(axis=1))
        else:
            self.summaries.append((self.weights[:, :, None, None] * per_group).sum(axis=1))
        if self.keep_tokens:
            self.token_summaries.append(per_group[0])

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        table = self.table
        kt, vt = k.transpose(0, 2, 1, 3).astype(KV_DTYPE), v.transpose(0, 2, 1, 3).astype(KV_DTYPE)  # (B, T, Hkv, D)
        table.k[layer][self.row_idx, self.write_slots] = kt
        table.v[layer][self.row_idx, self.write_slots] = vt
        b, s = self.rows, self.live
        keys = table.k[layer][:b, :s].transpose(0, 2, 1, 3).astype(self.dtype)  # (B, Hkv, S', D)
        values = table.v[layer][:b, :s].transpose(0, 2, 1, 3).astype(self.dtype)  # (B, Hkv, S', D)
        cos_k, sin_k = self.rope.lookup(self.slot_positions, layer)
        cos_q, sin_q = self.rope.lookup(self.positions, layer)
        keys = rotate(keys, cos_k, sin_k)
        q = rotate(q, cos_q, sin_q)
        mask = self.local if self.sliding[layer] and self.local is not None else self.mask
        d = q.shape[-1]
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=mask)  # (B, H, T, D)
