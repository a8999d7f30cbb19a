"""The slot table as MLX arrays, and one forward's attention over it (engine.backends.mlx.network.Attend).

Per layer, k and v are (B, C, Hkv, D) fp16 (or llama.cpp's q8_0 blocks, as the torch table's) for slots [0, C) of the S the memory may address, grown as steps write
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
from engine.model.kv_types import Q8_BLOCK, KVType
from engine.model.slots import GROWTH_SLOTS, TOKEN_SUMMARY_STEP, SlotBatch

KV_DTYPE = mx.float16  # what the table holds: the canonical KV dtype, so reads and writes convert nothing


def host(t: torch.Tensor) -> mx.array:
    return mx.array(t.detach().to("cpu").numpy())


def _round(x: mx.array) -> mx.array:
    """Half away from zero, as C's roundf (llama.cpp's quantizer)."""
    return mx.sign(x) * mx.floor(mx.abs(x) + 0.5)


def quantize_q8_0(x: mx.array) -> tuple[mx.array, mx.array]:
    """x (..., D) -> codes (..., D) int8 and scales (..., D/32) fp16: engine.model.kv_types.quantize_q8_0 in MLX
    ops, step for step (llama.cpp's quantizer, with its snapping of a block's own fp16 reading to the scale that
    reproduces it), so a q8_0 table here holds what the torch backend's would for the same values."""
    xb = x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // Q8_BLOCK, Q8_BLOCK)  # (..., n, 32)
    tiny = float(np.finfo(np.float32).tiny)
    d32 = mx.abs(xb).max(axis=-1) / 127  # (..., n)
    inv = mx.where(d32 > 0, 1 / mx.maximum(d32, tiny), 0.0)
    q = _round(xb * inv[..., None])
    d = d32.astype(mx.float16)

    def exact(scale: mx.array, codes: mx.array) -> mx.array:
        return ((scale.astype(mx.float32)[..., None] * codes).astype(mx.float16).astype(mx.float32) == xb).all(-1)

    done = exact(d, q)
    bits = d.view(mx.int16)  # d >= 0: its neighbours are the bit patterns one down and one up
    below = mx.where(bits > 0, bits - 1, bits).view(mx.float16)
    above = mx.where(bits < 0x7BFF, bits + 1, bits).view(mx.float16)
    for scale in (d, below, above):
        sc = scale.astype(mx.float32)[..., None]
        codes = mx.clip(mx.where(sc > 0, _round(xb / mx.maximum(sc, tiny)), 0.0), -127, 127)
        take = mx.logical_and(mx.logical_not(done), exact(scale, codes))
        d = mx.where(take, scale, d)
        q = mx.where(take[..., None], codes, q)
        done = mx.logical_or(done, take)
    return q.astype(mx.int8).reshape(x.shape), d


def dequantize_q8_0(codes: mx.array, scales: mx.array) -> mx.array:
    """codes (..., D) int8, scales (..., D/32) fp16 -> (..., D) fp16: fp16(d * q)."""
    qb = codes.astype(mx.float32).reshape(*codes.shape[:-1], -1, Q8_BLOCK)
    return (qb * scales.astype(mx.float32)[..., None]).astype(mx.float16).reshape(codes.shape)


class MLXSlotTable:
    """k, v per layer (B, C, Hkv, D) fp16, C the capacity grown so far (at most `max_slots`). With `kv_type` q8_0,
    k and v hold int8 codes and `k_scale`, `v_scale` (B, C, Hkv, D/32) their fp16 scales (engine.model.kv_types);
    every read gives the fp16 values they stand for."""

    def __init__(self, cfg: ModelConfig, batch: int, num_slots: int, kv_type: KVType = KVType.F16) -> None:
        self.cfg = cfg
        self.batch = batch
        self.max_slots = num_slots
        self.kv_type = kv_type
        self.k: list[mx.array] = []
        self.v: list[mx.array] = []
        self.k_scale: list[mx.array] = []
        self.v_scale: list[mx.array] = []
        self._resize(0)

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[1])

    def buffers(self) -> list[mx.array]:
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def _resize(self, size: int) -> None:
        c = self.cfg
        kept = 0 if not self.k else min(size, self.capacity)
        old = (self.k, self.v, self.k_scale, self.v_scale)
        q8 = self.kv_type is KVType.Q8_0
        shape = (self.batch, size, c.num_key_value_heads, c.head_dim)
        scales = (*shape[:3], c.head_dim // Q8_BLOCK if q8 else 0)
        layers = range(c.num_hidden_layers)
        self.k = [mx.zeros(shape, dtype=mx.int8 if q8 else KV_DTYPE) for _ in layers]
        self.v = [mx.zeros(shape, dtype=mx.int8 if q8 else KV_DTYPE) for _ in layers]
        self.k_scale = [mx.zeros(scales, dtype=mx.float16) for _ in layers]
        self.v_scale = [mx.zeros(scales, dtype=mx.float16) for _ in layers]
        if kept:
            for new, was in zip((self.k, self.v, self.k_scale, self.v_scale), old, strict=True):
                for i in layers:
                    new[i][:, :kept] = was[i][:, :kept]
        mx.eval(self.buffers())

    def store(self, layer: int, rows: mx.array | int, slots: mx.array, k: mx.array, v: mx.array) -> None:
        """k, v (..., Hkv, D) into `layer` at [rows, slots] (index arrays broadcasting to k's leading dims)."""
        if self.kv_type is KVType.Q8_0:
            (kc, ks), (vc, vs) = quantize_q8_0(k), quantize_q8_0(v)
            self.k[layer][rows, slots], self.k_scale[layer][rows, slots] = kc, ks
            self.v[layer][rows, slots], self.v_scale[layer][rows, slots] = vc, vs
            return
        self.k[layer][rows, slots] = k.astype(KV_DTYPE)
        self.v[layer][rows, slots] = v.astype(KV_DTYPE)

    def values(self, layer: int, name: str, rows: slice | int, slots: slice | mx.array) -> mx.array:
        """`name` ("k" or "v") of `layer` at [rows, slots] as the fp16 values the table holds."""
        codes = (self.k if name == "k" else self.v)[layer][rows, slots]
        if self.kv_type is KVType.F16:
            return codes
        return dequantize_q8_0(codes, (self.k_scale if name == "k" else self.v_scale)[layer][rows, slots])

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
        return sum(int(a.nbytes) for a in self.buffers())

    def read_rows(self, row: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row `row`'s k, v at `slots` (n,) -> (L, Hkv, n, D) fp16 each; slots past the capacity read as zeros."""
        held = slots < self.capacity
        idx = mx.array(np.where(held, slots, 0).astype(np.int32))
        out = []
        for name in ("k", "v"):
            layers = range(self.cfg.num_hidden_layers)
            x = mx.stack([self.values(i, name, row, idx) for i in layers]).transpose(0, 2, 1, 3)  # (L, Hkv, n, D)
            a = np.array(x)
            a[:, :, ~held] = 0
            out.append(a)
        return out[0], out[1]

    def write_rows(self, row: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store k, v (L, Hkv, n, D) fp16 at row `row`'s `slots` (n,), every layer."""
        idx = mx.array(slots.astype(np.int32))
        kt, vt = mx.array(k).transpose(0, 2, 1, 3), mx.array(v).transpose(0, 2, 1, 3)  # (L, n, Hkv, D)
        for i in range(self.cfg.num_hidden_layers):
            self.store(i, row, idx, kt[i], vt[i])
        mx.eval(self.buffers())


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
        # Additive masks, a blocked score half the dtype's lowest finite value (not -inf, and not the lowest, which an
        # fp16 score added to it could overflow): a padding row with nothing to attend to stays finite rather than
        # turning into NaN, as the torch backend's small steps do.
        low = mx.array(mx.finfo(dtype).min / 2, dtype=dtype)
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
        table.store(layer, self.row_idx, self.write_slots, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        b, s = slice(0, self.rows), slice(0, self.live)
        keys = table.values(layer, "k", b, s).transpose(0, 2, 1, 3).astype(self.dtype)  # (B, Hkv, S', D)
        values = table.values(layer, "v", b, s).transpose(0, 2, 1, 3).astype(self.dtype)  # (B, Hkv, S', D)
        cos_k, sin_k = self.rope.lookup(self.slot_positions, layer)
        cos_q, sin_q = self.rope.lookup(self.positions, layer)
        keys = rotate(keys, cos_k, sin_k)
        q = rotate(q, cos_q, sin_q)
        mask = self.local if self.sliding[layer] and self.local is not None else self.mask
        d = q.shape[-1]
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=mask)  # (B, H, T, D)
