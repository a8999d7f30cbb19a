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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,) including Llama 3 / linear `rope_scaling`, as transformers computes them."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (D/2,)
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
    """cos/sin lookup by position: a precomputed table (P, D) indexed per step instead of recomputing trig."""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str, dtype: torch.dtype) -> None:
        inv = rope_inv_freq(cfg)  # (D/2,)
        pos = torch.arange(max_positions, dtype=torch.float32)  # (P,)
        freqs = torch.outer(pos, inv)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos = emb.cos().to(device=device, dtype=dtype)  # (P, D)
        self.sin = emb.sin().to(device=device, dtype=dtype)  # (P, D)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, N) long -> cos, sin (B, 1, N, D), broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, N, D) rotated by cos/sin (B, 1, N, D)."""
    return x * cos + rotate_half(x) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like transformers does, then cast back before the weight.
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

    Only the leading S' slots take part (S' = slot_positions.shape[1]): a memory that has filled 300 of 4096 slots
    pays for 300, and a backend with a fixed shape (Core ML) pads the plan to its S with masked-off slots.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    slot_positions: torch.Tensor
    mask: torch.Tensor


class KVCache(nn.Module):
    """Preallocated slot table: k, v (L, B, Hkv, S, D). Keys are stored unrotated (see module doc)."""

    def __init__(self, cfg: ModelConfig, batch: int, num_slots: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, num_slots, cfg.head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)  # (L,B,Hkv,S,D)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)  # (L,B,Hkv,S,D)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def num_slots(self) -> int:
        return self.k.shape[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (B, T); k, v (B, Hkv, T, D) -> stored at [layer, b, :, slots[b]]."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if slots.shape[0] == 1:
            # One sequence: a plain index_copy_ is the cheapest write.
            self.k[layer].index_copy_(2, slots[0], k)
            self.v[layer].index_copy_(2, slots[0], v)
            return
        idx = slots[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, Hkv, T, D)
        self.k[layer].scatter_(2, idx, k)
        self.v[layer].scatter_(2, idx, v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, d
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        layer: int,
        cache: KVCache,
        batch: SlotBatch,
        rope_q: tuple[torch.Tensor, torch.Tensor],  # cos, sin (B, 1, T, D)
        rope_k: tuple[torch.Tensor, torch.Tensor],  # cos, sin (B, 1, S', D)
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        cache.write(layer, batch.write_slots, k, v)
        live = batch.slot_positions.shape[1]  # S'
        q = apply_rope(q, *rope_q)  # (B, H, T, D)
        # The cache may hold a narrower dtype than the compute (fp16 KV, fp32 math on CPU): widen on read.
        keys = apply_rope(cache.k[layer][:, :, :live].to(q.dtype), *rope_k)  # (B, Hkv, S', D)
        values = cache.v[layer][:, :, :live].to(q.dtype)  # (B, Hkv, S', D)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, enable_gqa=True)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def setup_rope(self, max_positions: int | None = None) -> None:
        """Build the cos/sin table on the weights' device (call after loading weights)."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        self.rope = RotaryTable(self.config, max_positions or self.config.max_position_embeddings, p.device, p.dtype)

    def new_cache(self, batch: int, num_slots: int, dtype: torch.dtype | None = None) -> KVCache:
        """A slot table on the weights' device; `dtype` defaults to the compute dtype."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        return KVCache(self.config, batch, num_slots, p.device, dtype or p.dtype)

    def hidden_states(self, tokens: torch.Tensor, cache: KVCache, batch: SlotBatch) -> torch.Tensor:
        """tokens (B, T) -> final normed hidden states (B, T, C); writes this step's K/V into `cache`."""
        if self.rope is None:
            self.setup_rope()
        assert self.rope is not None
        rope_q = self.rope.lookup(batch.positions)  # (B, 1, T, D) each
        rope_k = self.rope.lookup(batch.slot_positions)  # (B, 1, S', D) each
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn(layer.input_layernorm(x), i, cache, batch, rope_q, rope_k)
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
            h = layer.input_layernorm(x)
            q = apply_rope(a.q_proj(h).view(b, t, a.n_heads, a.head_dim).transpose(1, 2), cos, sin)  # (B, H, T, D)
            k = apply_rope(a.k_proj(h).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2), cos, sin)  # (B, Hkv, T, D)
            v = a.v_proj(h).view(b, t, a.n_kv_heads, a.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))

    def forward(self, tokens: torch.Tensor, cache: KVCache, batch: SlotBatch, last_only: bool = False) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last token only when `last_only`."""
        h = self.hidden_states(tokens, cache, batch)
        if last_only:
            h = h[:, -1:, :]
        return self.lm_head(h)
