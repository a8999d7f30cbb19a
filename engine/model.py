"""One PyTorch implementation of the Llama family (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama).

The model attends over a *slot table*: a preallocated, fixed-shape KV cache of S slots per layer. The caller
(the memory cascade) decides which token lives in which slot and at which position, so the same forward serves
full attention, StreamingLLM-style sink+window, paged-in episodic blocks, batching and Core ML conversion.

Keys are stored *without* rotary embedding and rotated on read with the slot's current position. That is what
lets the cascade re-number positions as the window slides (so no position ever exceeds the trained context)
without rewriting the cache; while positions equal absolute token indices the result equals standard
attention exactly.

Shapes: B batch, T new tokens, S slots, C hidden, H query heads, Hkv key/value heads, D head dim, V vocab.
Module and parameter names mirror Hugging Face so a state dict loads without renaming.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig

if TYPE_CHECKING:
    from engine.native.decoder import NativeDecoder


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) including Llama 3 / linear `rope_scaling`, as transformers computes them."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (D/2,)
    if cfg.rope_freq_factors is not None:
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    if sc.rope_type == "linear":
        return inv / sc.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth blend in between.
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * inv_llama / sc.factor + smooth * inv_llama
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_llama)


class RotaryTable:
    """cos/sin lookup by position: a precomputed table (P, D) indexed per step instead of recomputing trig.

    The sin table is stored *signed* (first half negated), so rotating is x*cos + roll(x)*sin: four kernels instead
    of rotate-half's seven, and bit-identical (negating a factor is exact)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str, dtype: torch.dtype) -> None:
        inv = rope_inv_freq(cfg)  # (D/2,)
        pos = torch.arange(max_positions, dtype=torch.float32)  # (P,)
        freqs = torch.outer(pos, inv)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # (P, D)
        sin = emb.sin()  # (P, D)
        sin[:, : inv.shape[0]].neg_()
        self.sin = sin.to(device=device, dtype=dtype)  # (P, D) signed: (-sin, +sin) halves
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, N) long -> cos, signed sin (B, 1, N, D), broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, N, D) rotated by cos and *signed* sin (B, 1, N, D) from RotaryTable, with Hugging Face's
    half-split pairing: (x1, x2) -> (x1*cos - x2*sin, x2*cos + x1*sin)."""
    return (x * cos).add_(x.roll(x.shape[-1] // 2, dims=-1).mul_(sin))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like transformers does, then cast back before the weight.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel, same arithmetic
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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


class KVCache(nn.Module):
    """Preallocated slot table: k, v (L, B, Hkv, S, D). Keys are stored unrotated (see module doc).

    Beside it live *read copies* in the compute dtype, in read order rather than slot order: rank r of
    `k_read`/`v_read` holds slot `read_slots[r]`, its key rotated at `read_positions[b, r]` and its value widened.
    A step of few tokens attends to the slots it may see, ranked in slot order, so its keys and values are the
    leading m ranks (no gather, even though a cascade's attended slots have gaps), and it re-derives only the ranks
    whose slot, rotation or content changed: in plain decoding just the new token's (SlotBatch.frame keeps a
    sliding window's rotations fixed; without it a sliding window re-rotates them all). The copies are always
    derived from the stored k, v, so results are exactly those of converting and rotating on read.
    """

    def __init__(self, cfg: ModelConfig, batch: int, num_slots: int, device: torch.device | str, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
        super().__init__()
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, num_slots, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)  # (L,B,Hkv,S,D)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)  # (L,B,Hkv,S,D)
        self.register_buffer("k_read", torch.zeros(shape, device=device, dtype=compute_dtype), persistent=False)  # (L,B,Hkv,S,D)
        self.register_buffer("v_read", torch.zeros(shape, device=device, dtype=compute_dtype), persistent=False)  # (L,B,Hkv,S,D)
        self.register_buffer("read_slots", torch.full((num_slots,), -1, device=device, dtype=torch.long), persistent=False)  # (S,)
        self.register_buffer("read_positions", torch.full((batch, num_slots), -1, device=device, dtype=torch.long), persistent=False)  # (B,S)
        # The last forward's query summary (see Attention.summarize): what the cascade routes episodic blocks with.
        summary_shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim)
        self.register_buffer("summary", torch.zeros(summary_shape, device=device, dtype=torch.float32), persistent=False)  # (L,B,Hkv,D)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every (L, B, Hkv, S, D) buffer, for whole-row operations such as beam reordering."""
        return [self.k, self.v, self.k_read, self.v_read]

    def leading_rows(self, n: int) -> "KVCache":
        """This table's rows [0, n) as a KVCache sharing its storage and its read-copy bookkeeping (views).

        The read copies of rows left out are not kept up to date by forwards over the view: whoever switches
        between views of different sizes must `forget()` the read copies first (TorchBackend.forward does)."""
        view = copy.copy(self)
        view._buffers = dict(self._buffers)  # a module's shallow copy would share (and so overwrite) the dict
        for name in ("k", "v", "k_read", "v_read"):
            view._buffers[name] = self._buffers[name][:, :n]  # (L, n, Hkv, S, D)
        view._buffers["read_positions"] = self._buffers["read_positions"][:n]  # (n, S)
        view._buffers["summary"] = self._buffers["summary"][:, :n]  # (L, n, Hkv, D): rows past n keep their last summary
        return view

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (B, T); k, v (B, Hkv, T, D) -> stored at [layer, b, :, slots[b]]. Returns k, v as stored (in the
        table's dtype)."""
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

    def forget(self, slots: torch.Tensor | None = None) -> None:
        """Drop the read copies of `slots` (all when None) after their k, v changed: restores, paging in, writes."""
        if slots is None:
            self.read_slots.fill_(-1)
        else:
            self.read_slots.masked_fill_(torch.isin(self.read_slots, slots), -1)

    def plan_reads(self, batch: "SlotBatch", attended: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        self, layer: int, slots: torch.Tensor, ranks: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Plain decoding, one row whose only stale ranks are the slots it writes: store k, v (1, Hkv, T, D) at
        `slots` (1, T), and rotate the queries (1, H, T, D) and the stored keys in one pass with cos/sin (1, 1, T, D)
        into the read copies at `ranks` (T,), instead of reading the keys back. Returns the rotated queries."""
        k, v = self.write(layer, slots, k, v)
        h = q.shape[1]
        qk = apply_rope(torch.cat((q, k.to(q.dtype)), dim=1), *rope)  # (1, H + Hkv, T, D)
        self.k_read[layer].index_copy_(2, ranks, qk[:, h:])
        self.v_read[layer].index_copy_(2, ranks, v.to(self.v_read.dtype))
        return qk[:, :h]

    def refresh(self, layer: int, reads: "StepReads") -> None:
        """Re-derive the stale read copies: keys at reads.refresh_ranks from reads.refresh_slots, rotated by
        reads.rope_refresh (all leading ranks when refresh_ranks is None), values at reads.value_ranks."""
        fresh_k = apply_rope(self.k[layer].index_select(2, reads.refresh_slots).to(self.k_read.dtype), *reads.rope_refresh)  # (B, Hkv, n, D)
        if reads.refresh_ranks is None:
            n = reads.refresh_slots.numel()
            self.k_read[layer][:, :, :n] = fresh_k
            self.v_read[layer][:, :, :n] = self.v[layer].index_select(2, reads.refresh_slots)
            return
        self.k_read[layer].index_copy_(2, reads.refresh_ranks, fresh_k)
        if reads.value_ranks.numel():
            fresh_v = self.v[layer].index_select(2, reads.value_slots).to(self.v_read.dtype)  # (B, Hkv, n_v, D)
            self.v_read[layer].index_copy_(2, reads.value_ranks, fresh_v)


@dataclass
class StepReads:
    """What every layer of one forward shares about reading the slot table (built once per forward).

    rope_q:         cos, sin (B, 1, T, D) at the new tokens' positions (+ the row's frame in small steps)
    width:          m, the attended slots held in read ranks [0, m) (small steps), or 0: read all S' slots in
                    slot order (large steps, where converting on read is amortized over many tokens)
    write_ranks:    (T,) ranks of the written slots when they are the only stale ranks of a one-row step, else None
    refresh_ranks:  (n,) stale ranks to re-derive, or None to rewrite all m
    refresh_slots:  (n or m,) the slots they hold
    rope_refresh:   cos, sin (B, 1, n or m, D) at those slots' positions; for large steps, at all S' slots
    value_ranks:    (n_v,) ranks whose value copies are stale too (their slot changed); a subset of refresh_ranks
    value_slots:    (n_v,) the slots they hold
    split:          with a frame, ranks [0, split) are scored by queries at their positions (rope_q) and ranks
                    [split, m) by queries in the frame (rope_q_framed); 0 without a frame
    blocked:        (B, 1, 1, T, m) bool, True where a new token may NOT attend; None when nothing is
    """

    rope_q: tuple[torch.Tensor, torch.Tensor]
    width: int
    write_ranks: torch.Tensor | None
    refresh_ranks: torch.Tensor | None
    refresh_slots: torch.Tensor
    rope_refresh: tuple[torch.Tensor, torch.Tensor]
    blocked: torch.Tensor | None
    value_ranks: torch.Tensor | None = None
    value_slots: torch.Tensor | None = None
    split: int = 0
    rope_q_framed: tuple[torch.Tensor, torch.Tensor] | None = None
    pre: StepReads | None = None  # stale ranks besides the written one (a page-in), re-derived before the write


# The rotary table reaches this far past the trained context. Only rotation frames (SlotBatch.frame) use it: a
# frame adds the same offset to queries and keys, so attention still sees distances inside the trained context,
# and a slot table as large as that context can still slide its window in a frame.
ROTARY_HEADROOM = 4096

# Steps of at most this many new tokens (decoding, short chunks) read the slot table through its read copies
# (KVCache); larger steps (prefill chunks) convert and rotate every live slot on read, which their many queries
# amortize, and attend with PyTorch's fused kernel.
SMALL_STEP = 8


def small_step_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
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
        # PyTorch's fused kernel does faster than the matmuls below (25 vs 33 us over 183 slots).
        return F.scaled_dot_product_attention(q.view(b, hkv, h // hkv, d), keys, values).view(b, h, t, d)
    qg = q.reshape(b, hkv, h // hkv * t, d)  # (B, Hkv, G*T, D)
    scores = (qg @ keys.transpose(-1, -2)).mul_(d**-0.5).view(b, hkv, h // hkv, t, live)  # (B, Hkv, G, T, S')
    if blocked is not None:
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    probs = scores.softmax(-1)  # (B, Hkv, G, T, S')
    return (probs.view(b, hkv, -1, live) @ values).view(b, h, t, d)  # (B, H, T, D)


def split_frame_attention(
    q_plain: torch.Tensor, q_framed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, split: int, blocked: torch.Tensor | None
) -> torch.Tensor:
    """Attention where keys [0, split) are scored by q_plain and keys [split, S') by q_framed (SlotBatch.frame):
    q_* (1, H, T, D), keys/values (1, Hkv, S', D), blocked (1, 1, 1, T, S') or None. One softmax over all keys."""
    b, h, t, d = q_plain.shape
    hkv, live = keys.shape[1], keys.shape[2]
    g = h // hkv
    if split == 0 or split == live:
        return small_step_attention(q_framed if split == 0 else q_plain, keys, values, blocked)
    if t == 1 and blocked is None and keys.device.type == "cpu":
        # Two fused attentions, merged by their log-sum-exps: softmax over the union, no score matrix built.
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o0, lse0 = flash(q_plain.view(b, hkv, g, d), keys[:, :, :split], values[:, :, :split])[:2]  # (1, Hkv, G, D), (1, Hkv, G)
        o1, lse1 = flash(q_framed.view(b, hkv, g, d), keys[:, :, split:], values[:, :, split:])[:2]
        share = torch.sigmoid(lse1 - lse0).unsqueeze(-1).to(o0.dtype)  # (1, Hkv, G, 1) of the framed keys
        return torch.lerp(o0, o1, share).view(b, h, t, d)
    s0 = q_plain.reshape(b, hkv, g * t, d) @ keys[:, :, :split].transpose(-1, -2)  # (1, Hkv, G*T, split)
    s1 = q_framed.reshape(b, hkv, g * t, d) @ keys[:, :, split:].transpose(-1, -2)  # (1, Hkv, G*T, S' - split)
    scores = torch.cat((s0, s1), dim=-1).mul_(d**-0.5).view(b, hkv, g, t, live)  # (1, Hkv, G, T, S')
    if blocked is not None:
        scores.masked_fill_(blocked, torch.finfo(scores.dtype).min)
    return (scores.softmax(-1).view(b, hkv, -1, live) @ values).view(b, h, t, d)  # (1, H, T, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)
        self.qkv_proj: nn.Module | None = None  # q, k, v stacked into one matrix by fuse_projections()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> q (B, T, H*D), k and v (B, T, Hkv*D)."""
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split((self.n_heads * self.head_dim, kv, kv), dim=-1)
        return q, k, v

    def summarize(self, q: torch.Tensor, weights: torch.Tensor | None, out: torch.Tensor) -> None:
        """The query summary: q (B, T, H*D) pre-RoPE (after q_proj and its bias) -> out (B, Hkv, D) fp32, the mean
        over the step's tokens (weighted by `weights` (B, T) when given) and over the query heads of each KV-head
        group (heads of a group are adjacent). Computed in the forward that makes q, never in a pass of its own."""
        b, t, _ = q.shape
        g = self.n_heads // self.n_kv_heads
        per_group = q.reshape(b, t, self.n_kv_heads, g, self.head_dim).float().mean(dim=3)  # (B, T, Hkv, D)
        if weights is None:
            out.copy_(per_group.mean(dim=1))
        else:
            out.copy_(torch.einsum("bt,btkd->bkd", weights.float(), per_group))

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        layer: int,
        cache: KVCache,
        batch: SlotBatch,
        reads: StepReads,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.project(x)
        self.summarize(q, batch.summary_weights, cache.summary[layer])
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if reads.width == 0:  # a large step: convert and rotate every live slot on read
            cache.write(layer, batch.write_slots, k, v)
            live = batch.slot_positions.shape[1]  # S'
            keys = apply_rope(cache.k[layer][:, :, :live].to(q.dtype), *reads.rope_refresh)  # (B, Hkv, S', D)
            values = cache.v[layer][:, :, :live].to(q.dtype)  # (B, Hkv, S', D)
            q = apply_rope(q, *reads.rope_q)  # (B, H, T, D)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)  # (B, H, T, D)
        else:
            # New keys and the queries that score them share a rotation: in the frame when there is one.
            rope_new = reads.rope_q if reads.rope_q_framed is None else reads.rope_q_framed
            q_raw = q
            if reads.write_ranks is not None:
                if reads.pre is not None:
                    cache.refresh(layer, reads.pre)
                q = cache.write_rotated(layer, batch.write_slots, reads.write_ranks, q, k, v, rope_new)  # (B, H, T, D)
            else:
                cache.write(layer, batch.write_slots, k, v)
                q = apply_rope(q, *rope_new)  # (B, H, T, D)
                cache.refresh(layer, reads)
            m = reads.width
            keys, values = cache.k_read[layer][:, :, :m], cache.v_read[layer][:, :, :m]  # (B, Hkv, m, D) each
            if reads.rope_q_framed is None:
                out = small_step_attention(q, keys, values, reads.blocked)  # (B, H, T, D)
            else:
                out = split_frame_attention(apply_rope(q_raw, *reads.rope_q), q, keys, values, reads.split, reads.blocked)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up stacked into one matrix by fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, I) each
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        return self.down_proj(F.silu(gate).mul_(up))


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the given linears' outputs side by side."""
    w = torch.cat([lin.weight.detach() for lin in linears])  # (sum out, in)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)  # type: ignore[union-attr]
    return out


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Swap every nn.Linear in `model` for make(linear): the inference paths' weight layouts and quantizations."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def fuse_projections(model: "Transformer") -> None:
    """Stack q/k/v and gate/up into one matrix each (inference only): a decode step then makes 4 matrix calls per
    layer instead of 7, and the int8 path quantizes each activation row once instead of three times."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.qkv_proj = _stacked([a.q_proj, a.k_proj, a.v_proj])
        m.gate_up_proj = _stacked([m.gate_proj, m.up_proj])
        del a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """Llama-family causal LM over a slot-table KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryTable | None = None
        # One-call decoding steps on the native CPU kernels (engine.native.decoder), attached by the backend.
        self.native_decoder: NativeDecoder | None = None

    def setup_rope(self, max_positions: int | None = None) -> None:
        """Build the cos/sin table on the weights' device (call after loading weights)."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        self.rope = RotaryTable(self.config, max_positions or self.config.max_position_embeddings + ROTARY_HEADROOM, p.device, p.dtype)

    def new_cache(self, batch: int, num_slots: int, dtype: torch.dtype | None = None) -> KVCache:
        """A slot table on the weights' device; `dtype` defaults to the compute dtype."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        return KVCache(self.config, batch, num_slots, p.device, dtype or p.dtype, p.dtype)

    def step_reads(self, cache: KVCache, batch: SlotBatch) -> StepReads:
        if self.rope is None:
            self.setup_rope()
        assert self.rope is not None
        rope_q = self.rope.lookup(batch.positions)
        b, t = batch.positions.shape
        if t > SMALL_STEP:
            cache.forget(batch.write_slots.flatten())
            return StepReads(rope_q, 0, None, None, batch.write_slots, self.rope.lookup(batch.slot_positions), None)
        attended = batch.mask.flatten(0, 2).any(0).nonzero().squeeze(1)  # (m,) slots anything attends to
        positions = batch.slot_positions.index_select(1, attended)  # (B, m) rotation positions of their keys
        split, rope_q_framed = 0, None
        if b == 1 and batch.frame is not None and batch.frame_start is not None and int(batch.frame[0]):
            in_frame = attended >= batch.frame_start[0]  # (m,) a suffix: ranks follow slot order
            split = int(attended.numel() - in_frame.sum())
            positions = positions + batch.frame[:, None] * in_frame
            rope_q_framed = self.rope.lookup(batch.positions + batch.frame[:, None])
        stale, moved = cache.plan_reads(batch, attended, positions)
        m, n = attended.numel(), stale.numel()
        blocked: torch.Tensor | None = ~batch.mask.index_select(-1, attended).unsqueeze(1)  # (B, 1, 1, T, m)
        if not blocked.any():  # e.g. one new token over exactly the slots it attends: nothing to mask
            blocked = None
        if n * 2 > m:  # most ranks moved (e.g. a sliding window without a frame re-numbers its slots): rewrite all
            return StepReads(rope_q, m, None, None, attended, self.rope.lookup(positions), blocked, split=split, rope_q_framed=rope_q_framed)
        write_ranks, pre = None, None
        # The one-pass write rotates the new keys as their queries are rotated (in the frame when there is one), so
        # it serves only steps whose written slots all sit in that frame: not sinks written while a frame is on.
        same_frame = rope_q_framed is None or bool((batch.write_slots[0] >= batch.frame_start[0]).all())  # type: ignore[index]
        if b == 1 and n == t and same_frame:  # n stale ranks for T written slots: check they are theirs
            ranks = torch.searchsorted(attended, batch.write_slots[0]).clamp_(max=m - 1)  # (T,)
            if torch.equal(attended.index_select(0, ranks), batch.write_slots[0]):
                write_ranks = ranks
        elif b == 1 and t == 1 and same_frame:
            # A decoding step right after the memory changed (a page-in, a re-route): re-derive the other stale
            # ranks first, then take the one-pass write (and the native step) as in plain decoding.
            rank = torch.searchsorted(attended, batch.write_slots[0]).clamp_(max=m - 1)  # (1,)
            others = stale != rank
            if bool(attended[rank] == batch.write_slots[0, 0]) and int(others.sum()) == n - 1:
                write_ranks, o = rank, stale[others]
                vo = moved[moved != rank]
                pre = StepReads(rope_q, m, None, o, attended.index_select(0, o), self.rope.lookup(positions.index_select(1, o)), None, vo, attended.index_select(0, vo))
                stale = rank
        refresh = (attended.index_select(0, stale), self.rope.lookup(positions.index_select(1, stale)))
        if pre is not None:
            moved = moved[moved == stale]
        return StepReads(rope_q, m, write_ranks, stale, *refresh, blocked, moved, attended.index_select(0, moved), split, rope_q_framed, pre)

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache, batch: SlotBatch, reads: StepReads | None = None) -> torch.Tensor:
        """tokens (B, T) -> final normed hidden states (B, T, C); writes this step's K/V into `cache`."""
        reads = reads or self.step_reads(cache, batch)
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), i, cache, batch, reads)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def forward_causal(self, tokens: torch.Tensor) -> torch.Tensor:
        """Training / scoring path without a cache: tokens (B, T) -> logits (B, T, V), causal, positions 0..T-1."""
        if self.rope is None or self.rope.cos.device != self.model.norm.weight.device:
            self.setup_rope()
        assert self.rope is not None
        b, t = tokens.shape
        cos, sin = self.rope.cos[:t][None, None], self.rope.sin[:t][None, None]  # (1, 1, T, D)
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        for layer in self.model.layers:
            a = layer.self_attn
            q, k, v = a.project(layer.input_layernorm(x))
            q = apply_rope(q.view(b, t, a.n_heads, a.head_dim).transpose(1, 2), cos, sin)  # (B, H, T, D)
            k = apply_rope(k.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
            v = v.view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))

    def forward(self, tokens: torch.Tensor, cache: KVCache, batch: SlotBatch, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last token only when `last_only`."""
        reads = None
        if self.native_decoder is not None and tokens.shape == (1, 1):
            reads = self.step_reads(cache, batch)
            if self.native_decoder.accepts(cache, reads):
                if reads.pre is not None:
                    for i in range(self.config.num_hidden_layers):
                        cache.refresh(i, reads.pre)
                return self.native_decoder.decode(self.model.embed_tokens(tokens), cache, batch, reads)
        h = self.hidden_states(tokens, cache, batch, reads)
        if last_only:
            h = h[:, -1:, :]
        return self.lm_head(h)
