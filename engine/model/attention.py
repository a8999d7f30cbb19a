"""Attention kernels: rotary embeddings, the few-query GQA attentions the slot table's read copies feed, and the
causal attention of the training / scoring path.

`StepAttention` is the one interface a layer's attention calls: given a layer's projections it stores what must be
stored and returns the attention output. `engine.model.slots.SlotStep` implements it over the slot table; `CausalStep`
here implements it for a plain causal pass without a cache.

Shapes: B batch, T new tokens, S' attended slots, H query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig

# The rotary table reaches this far past the trained context. Only rotation frames (engine.model.slots.SlotBatch.frame)
# use it: a frame adds the same offset to queries and keys, so attention still sees distances inside the trained
# context, and a slot table as large as that context can still slide its window in a frame.
ROTARY_HEADROOM = 4096
# Positions a rotary table first holds, and the least it grows by (RotaryTable.cover).
ROTARY_GROWTH = 4096

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin (B, 1, N, D); (K, B, 1, N, D) from a K-kind table


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) including Llama 3 / linear / LongRoPE scaling, as transformers computes them. A
    partial-rotary model (R < D rotated channels) has R/2 frequencies, then zeros: its pass-through pairs, which
    loading moved to (i, i + D/2) for i >= R/2 (ModelConfig.rotary_dims), rotate by angle 0."""
    r = cfg.rope_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))  # (R/2,)
    return F.pad(_scaled_inv_freq(cfg, inv), (0, (cfg.head_dim - r) // 2))  # (D/2,)


def rope_attention_factors(cfg: ModelConfig) -> torch.Tensor:
    """(D/2,) factors on each pair's cos and sin: LongRoPE's attention factor on the rotated pairs, 1 elsewhere."""
    out = torch.ones(cfg.head_dim // 2)
    sc = cfg.rope_scaling
    if sc is not None and sc.rope_type == "longrope":
        out[: cfg.rope_dim // 2] = sc.attention_factor
    return out


def rope_cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (N,) -> cos, sin (N, D) fp32 (unsigned), attention factors included: what RotaryTable holds and
    what a Core ML host feeds."""
    freqs = torch.outer(positions.to(torch.float32), rope_inv_freq(cfg))  # (N, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
    factors = rope_attention_factors(cfg)
    if bool((factors == 1.0).all()):
        return emb.cos(), emb.sin()
    scale = torch.cat((factors, factors))  # (D,)
    return emb.cos() * scale, emb.sin() * scale


def _scaled_inv_freq(cfg: ModelConfig, inv: torch.Tensor) -> torch.Tensor:
    """inv (R/2,) with the model's rope scaling applied."""
    if cfg.rope_freq_factors is not None:
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc.rope_type == "linear":
        return inv / sc.factor
    if sc.rope_type == "longrope":
        return inv / torch.tensor(sc.long_factors if cfg.long_rope else sc.short_factors, dtype=torch.float32)
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_llama / sc.factor + smooth * inv_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


def layer_rope_kinds(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Which rope each layer rotates with: None for every layer of a one-rope model; else 0 (the model's rope) or 1
    (the sliding-window layers' own base, Gemma 3): the index into a two-kind RotaryTable's lookups (pick_rope)."""
    if cfg.rope_local_theta is None:
        return (None,) * cfg.num_hidden_layers
    return tuple(int(cfg.is_sliding(i)) for i in range(cfg.num_hidden_layers))


def pick_rope(rope: Rope, kind: int | None) -> Rope:
    """A layer's (B, 1, N, D) cos/sin out of a lookup: as is for a one-rope table, else its kind's."""
    return rope if kind is None else (rope[0][kind], rope[1][kind])


def _cos_sin(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (N,) -> cos, signed sin (N, D) fp32."""
    cos, sin = rope_cos_sin(cfg, positions)  # (N, D) each
    sin[:, : cfg.head_dim // 2].neg_()
    return cos, sin


def mrope_turn(cfg: ModelConfig, offsets: torch.Tensor) -> Rope:
    """Multimodal rotary (ModelConfig.mrope_section): offsets (B, T, 3) long, each token's (dt, dh, dw) from its
    scalar position -> cos, signed sin (B, 1, T, D) that turn each pair by its section's offset. Rotations add, so a
    q or k turned by this and then by the slot table at position p is turned by p + the offset of its section: the
    three positions of transformers' mrope, while the slot table keeps one position per slot."""
    sections = torch.tensor(cfg.mrope_section, device=offsets.device)
    pair_section = torch.repeat_interleave(torch.arange(3, device=offsets.device), sections)  # (D/2,)
    angles = offsets.to(torch.float32)[..., pair_section] * rope_inv_freq(cfg).to(offsets.device)  # (B, T, D/2)
    emb = torch.cat((angles, angles), dim=-1)  # (B, T, D)
    cos, sin = emb.cos(), emb.sin()
    sin[..., : cfg.head_dim // 2].neg_()
    return cos[:, None], sin[:, None]


class RotaryTable:
    """cos/sin lookup by position: a precomputed table (P, D) indexed per step instead of recomputing trig.

    The sin table is stored *signed* (first half negated), so rotating is x*cos + roll(x)*sin: four kernels instead
    of rotate-half's seven, and bit-identical (negating a factor is exact).

    A model whose sliding-window layers have their own rope base (Gemma 3) gets a two-kind table (K, P, D): its
    lookups carry both kinds, and each layer picks its own (pick_rope, layer_rope_kinds).

    The table holds the positions steps have reached (`cover`, by the backend before each forward), up to `limit`:
    a long-context model's whole range is large (Gemma 3 270M's, two kinds of 36,864 positions of 256 channels, is
    144 MB) while a conversation's positions stay within its memory's slots. Each row depends only on its position,
    so a grown table holds the bits one built whole would."""

    def __init__(self, cfg: ModelConfig, limit: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.limit = limit  # positions it may grow to
        self.kinds = 1 if cfg.rope_local_theta is None else 2
        self.cos, self.sin = self._rows(0, min(limit, ROTARY_GROWTH), device, dtype)  # (P, D) or (K, P, D) each

    def _rows(self, start: int, stop: int, device: torch.device | str, dtype: torch.dtype) -> Rope:
        """cos, signed sin of positions [start, stop): (N, D) each, or (K, N, D)."""
        positions = torch.arange(start, stop)  # (N,)
        cos, sin = _cos_sin(self.cfg, positions)
        if self.kinds == 2:
            assert self.cfg.rope_local_theta is not None
            local = dataclasses.replace(
                self.cfg, rope_theta=self.cfg.rope_local_theta, rope_scaling=None, rope_freq_factors=None
            )
            cos_l, sin_l = _cos_sin(local, positions)
            cos, sin = torch.stack((cos, cos_l)), torch.stack((sin, sin_l))  # (2, N, D) each
        return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

    @property
    def size(self) -> int:
        """Positions [0, size) are held."""
        return int(self.cos.shape[-2])

    def cover(self, n: int) -> None:
        """Hold positions [0, n): grown to at least twice the size (at most `limit`). IndexError past `limit`."""
        if n <= self.size:
            return
        if n > self.limit:
            raise IndexError(f"position {n - 1} is outside the rotary table's {self.limit} positions")
        stop = min(self.limit, max(n, 2 * self.size, ROTARY_GROWTH))
        cos, sin = self._rows(self.size, stop, self.cos.device, self.cos.dtype)
        self.cos, self.sin = torch.cat((self.cos, cos), dim=-2), torch.cat((self.sin, sin), dim=-2)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """positions (B, N) long, each below `size` -> cos, signed sin (B, 1, N, D), broadcastable over heads
        ((K, B, 1, N, D) for a K-kind table)."""
        if self.kinds == 1:
            return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        return self.cos[:, positions].unsqueeze(2), self.sin[:, positions].unsqueeze(2)

    def leading(self, n: int) -> Rope:
        """cos, signed sin (1, 1, n, D) of positions 0..n-1 ((K, 1, 1, n, D) for a K-kind table)."""
        self.cover(n)
        if self.kinds == 1:
            return self.cos[:n][None, None], self.sin[:n][None, None]
        return self.cos[:, :n][:, None, None], self.sin[:, :n][:, None, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, N, D) rotated by cos and *signed* sin (B, 1, N, D) from RotaryTable, with Hugging Face's
    half-split pairing: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin))


class StepAttention(Protocol):
    """What a layer's attention asks of the step it runs in (the slot table, or a plain causal pass)."""

    def record_queries(self, layer: int, q: torch.Tensor) -> None:
        """q (B, T, H*D) pre-RoPE: the step's queries, for a query summary where the step keeps one."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q (B, H, T, D), k and v (B, Hkv, T, D), all unrotated -> attention output (B, H, T, D)."""
        ...


class CausalStep:
    """A pass without a cache (training, scoring): tokens at positions 0..T-1, each attending to those before it
    (within its window, in a sliding-window layer), and to the later tokens `runs` (B, T, T) names (a picture's own,
    in a model whose pictures attend both ways: engine.model.slots.image_runs)."""

    def __init__(self, rope: RotaryTable, tokens: int, cfg: ModelConfig, runs: torch.Tensor | None = None) -> None:
        self.rope = rope.leading(tokens)  # cos, sin (1, 1, T, D) or (K, 1, 1, T, D)
        self.kinds = layer_rope_kinds(cfg)
        self.windows = cfg.layer_windows
        pos = torch.arange(tokens, device=rope.cos.device)  # (T,)
        self.local = {  # window -> (T, T) True where a query may attend
            w: (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w) for w in set(self.windows) if w
        }
        self.runs = None if runs is None or not bool(runs.any()) else runs[:, None]  # (B, 1, T, T)
        self.causal = pos[None, :] <= pos[:, None]  # (T, T)

    def record_queries(self, layer: int, q: torch.Tensor) -> None:
        pass  # no memory routes on a causal pass

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cos, sin = pick_rope(self.rope, self.kinds[layer])
        q = apply_rope(q, cos, sin)  # (B, H, T, D)
        k = apply_rope(k, cos, sin)  # (B, Hkv, T, D)
        window = self.windows[layer] if self.windows else 0
        if self.runs is not None:  # transformers' or-mask: a sliding layer's window still bounds the past
            mask = (self.local[window] if window else self.causal) | self.runs
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if window:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.local[window], enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Many queries: q (B, H, T, D), keys/values (B, Hkv, S', D), mask (B, 1, T, S') True where allowed -> (B, H, T, D),
    PyTorch's fused kernel."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


def small_step_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None
) -> torch.Tensor:
    """GQA attention for few queries: q (B, H, T, D), keys/values (B, Hkv, S', D), blocked (B, 1, 1, T, S') or None
    when every slot may be attended.

    Query heads are grouped under their KV head (H = Hkv * G, heads of a group adjacent), so each KV head is read
    once per step. Blocked scores get the dtype's lowest finite value, not -inf: a row with nothing to attend to
    (a padding row in a batch) then stays finite instead of turning into NaN.
    """
    b, h, t, d = q.shape
    hkv, live = keys.shape[1], keys.shape[2]
    if t == 1 and blocked is None:
        # One token, nothing masked: each KV head's G query heads are G query rows of plain attention, which
        # PyTorch's fused kernel does faster than the matmuls below.
        # reshape, not view: CUDA's fused kernels may hand back (or take) a transposed layout
        return F.scaled_dot_product_attention(q.reshape(b, hkv, h // hkv, d), keys, values).reshape(b, h, t, d)
    qg = q.reshape(b, hkv, h // hkv * t, d)  # (B, Hkv, G*T, D)
    scores = (qg @ keys.transpose(-1, -2)).mul_(d**-0.5).view(b, hkv, h // hkv, t, live)  # (B, Hkv, G, T, S')
    if blocked is not None:
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1)  # (B, Hkv, G, T, S')
    return (probs.view(b, hkv, -1, live) @ values).view(b, h, t, d)  # (B, H, T, D)


def split_frame_attention(
    q_plain: torch.Tensor,
    q_framed: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    split: int,
    blocked: torch.Tensor | None,
) -> torch.Tensor:
    """Attention where keys [0, split) are scored by q_plain and keys [split, S') by q_framed (SlotBatch.frame):
    q_* (1, H, T, D), keys/values (1, Hkv, S', D), blocked (1, 1, 1, T, S') or None. One softmax over all keys."""
    b, h, t, d = q_plain.shape
    hkv, live = keys.shape[1], keys.shape[2]
    g = h // hkv
    if split == 0 or split == live:
        return small_step_attention(q_framed if split == 0 else q_plain, keys, values, blocked)
    if t == 1 and blocked is None and keys.device.type == "cpu":
        # Two fused attentions, merged by their log-sum-exps: softmax over the union, no score matrix built. The
        # public SDPA returns no log-sum-exp, hence the private CPU op (present in torch 2.x's CPU builds).
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o0, lse0 = flash(q_plain.view(b, hkv, g, d), keys[:, :, :split], values[:, :, :split])[
            :2
        ]  # (1, Hkv, G, D), (1, Hkv, G)
        o1, lse1 = flash(q_framed.view(b, hkv, g, d), keys[:, :, split:], values[:, :, split:])[:2]
        share = torch.sigmoid(lse1 - lse0).unsqueeze(-1).to(o0.dtype)  # (1, Hkv, G, 1) of the framed keys
        return torch.lerp(o0, o1, share).view(b, h, t, d)
    s0 = q_plain.reshape(b, hkv, g * t, d) @ keys[:, :, :split].transpose(-1, -2)  # (1, Hkv, G*T, split)
    s1 = q_framed.reshape(b, hkv, g * t, d) @ keys[:, :, split:].transpose(-1, -2)  # (1, Hkv, G*T, S' - split)
    scores = torch.cat((s0, s1), dim=-1).mul_(d**-0.5).view(b, hkv, g, t, live)  # (1, Hkv, G, T, S')
    if blocked is not None:
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1).view(b, hkv, -1, live) @ values).view(b, h, t, d)  # (1, H, T, D)
