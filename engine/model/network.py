"""One PyTorch implementation of the Llama family (Llama 2/3, Mistral, Qwen2/3, SmolLM, TinyLlama, Phi-3, Gemma 3):
the network only. The variants are per-layer options of the one Llama layer (ModelConfig): Qwen3's and Gemma 3's
per-head q/k norms, Gemma 3's sandwich norms, GeGLU, scaled embeddings, query scale and sliding-window layers with
their own rope base; Phi-3's fused projections are split on loading.

The model attends over a slot table (engine.model.slots): the caller (the memory cascade) decides which token lives in
which slot and at which position. Each layer's attention hands its projections to one interface
(engine.model.attention.StepAttention): the slot table for generation, a plain causal pass for training and scoring.
Which kernels run a decoding step (PyTorch here, or the native CPU kernels) is the backend's choice.

Shapes: B batch, T new tokens, C hidden, H query heads, Hkv key/value heads, D head dim, V vocab.
Module and parameter names mirror Hugging Face so a state dict loads without renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import (
    ROTARY_HEADROOM,
    CausalStep,
    Rope,
    RotaryTable,
    StepAttention,
    apply_rope,
    mrope_turn,
    rope_inv_freq,
)
from engine.model.config import ModelConfig
from engine.model.kv_types import KVType
from engine.model.slots import KVCache, SlotBatch, SlotStep, StepReads, image_runs, open_image_runs

# ROTARY_HEADROOM, SlotBatch and rope_inv_freq are re-exported: the cascade, batching and Core ML import them here.
__all__ = [
    "ROTARY_HEADROOM",
    "ForwardCancelled",
    "KVCache",
    "SlotBatch",
    "Transformer",
    "fuse_projections",
    "replace_linears",
    "rope_inv_freq",
]


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = h, hkv, d
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # The kernels scale scores by D**-0.5; a model with another scale gets its queries pre-multiplied instead.
        self.q_factor = None if cfg.query_scale is None else cfg.query_scale * d**0.5
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

    def forward(
        self, x: torch.Tensor, layer: int, step: StepAttention, turn: Rope | None = None
    ) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        b, t, _ = x.shape
        q, k, v = self.project(x)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before the rotation
            q = self.q_norm(q.view(b, t, self.n_heads, self.head_dim)).view(b, t, -1)  # (B, T, H*D)
            k = self.k_norm(k.view(b, t, self.n_kv_heads, self.head_dim)).view(b, t, -1)  # (B, T, Hkv*D)
        if self.q_factor is not None:
            q = q * self.q_factor
        step.record_queries(layer, q)  # pre-RoPE, after q_proj, its bias and norm
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        if turn is not None:  # multimodal rotary: each token's own offsets first, its slot's position on reading
            q, k = apply_rope(q, *turn), apply_rope(k, *turn)
        out = step.attend(layer, q, k, v)  # (B, H, T, D)
        y: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))  # (B, T, C)
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # gate and up stacked into one matrix by fuse_projections()
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, I) each
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, I) each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        out: torch.Tensor = self.down_proj(act.mul_(up))
        return out


def _cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along rows; for meta tensors (weights a backend holds in its own format) only the shape, since
    torch.cat on meta runs through torch._refs, whose import pulls in torch._dynamo (~70 MB resident)."""
    if any(p.is_meta for p in parts):
        return torch.empty(sum(p.shape[0] for p in parts), *parts[0].shape[1:], device="meta", dtype=parts[0].dtype)
    return torch.cat(parts)


def _stacked(linears: list[nn.Linear]) -> nn.Linear:
    """One nn.Linear whose output is the given linears' outputs side by side."""
    w = _cat_rows([lin.weight.detach() for lin in linears])  # (sum out, in)
    out = nn.Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(
            _cat_rows([lin.bias.detach() for lin in linears if lin.bias is not None]), requires_grad=False
        )
    return out


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Swap every nn.Linear in `model` for make(linear): the inference paths' weight layouts and quantizations."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def fuse_projections(model: Transformer) -> None:
    """Stack q/k/v and gate/up into one matrix each (inference only): a decode step then makes 4 matrix calls per
    layer instead of 7, and the int8 path quantizes each activation row once instead of three times."""
    for layer in model.decoder_layers():
        a, m = layer.self_attn, layer.mlp
        a.qkv_proj = _stacked([a.q_proj, a.k_proj, a.v_proj])
        m.gate_up_proj = _stacked([m.gate_proj, m.up_proj])
        del a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj


class DecoderLayer(nn.Module):
    """Llama's pre-norm layer: post_attention_layernorm is the norm before the MLP. With sandwich norms (Gemma 3,
    its names) post_attention_layernorm normalizes attention's output, and pre/post_feedforward_layernorm wrap the
    MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, layer: int, step: StepAttention, turn: Rope | None = None
    ) -> torch.Tensor:  # (B, T, C) -> (B, T, C)
        if not self.sandwich:
            x = x + self.self_attn(self.input_layernorm(x), layer, step, turn)
            y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
            return y
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), layer, step, turn))
        out: torch.Tensor = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return out


class Backbone(nn.Module):
    embed_tokens: nn.Module  # an nn.Embedding, or a backend's lookup sharing the LM head's storage

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # Built to have its weights assigned: no initialisation. (nn.Embedding's normal_ on a meta tensor runs
            # through torch._refs, whose import pulls in torch._dynamo: ~70 MB resident for nothing.)
            weight = torch.empty(cfg.vocab_size, cfg.hidden_size)  # (V, C) on meta
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ForwardCancelled(Exception):
    """A forward's `should_stop` turned true between two layers: the step stopped midway, with some layers' K/V of
    its tokens written into their slots; the caller takes the step back (engine.memory.base.Memory.rollback)."""


class Transformer(nn.Module):
    """Llama-family causal LM over a slot-table KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            assert isinstance(self.model.embed_tokens, nn.Embedding)  # as built; backends swap it later
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryTable | None = None
        # (a conversation's tokens, start) -> the multimodal rotary offsets (T - start, 3) of tokens[start:], or None:
        # set by engine.vision for a model with mrope (Backend.position_offsets reads it), None otherwise.
        self.position_offsets: Callable[[Sequence[int], int], torch.Tensor | None] | None = None
        self.embed_scale = cfg.hidden_size**0.5 if cfg.scale_embeddings else None

    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """The layers, typed (iterating an nn.ModuleList yields plain Modules)."""
        return cast(Sequence[DecoderLayer], self.model.layers)

    def setup_rope(self) -> None:
        """Build the cos/sin table on the weights' device (call after loading weights)."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        self.rope = RotaryTable(self.config, self.config.max_position_embeddings + ROTARY_HEADROOM, p.device, p.dtype)

    def rotary(self) -> RotaryTable:
        """The cos/sin table, (re)built when missing or on another device than the weights."""
        if self.rope is None or self.rope.cos.device != self.model.norm.weight.device:
            self.setup_rope()
        assert self.rope is not None
        return self.rope

    def new_cache(
        self, batch: int, num_slots: int, dtype: torch.dtype | None = None, kv_type: KVType = KVType.F16
    ) -> KVCache:
        """A slot table on the weights' device; `dtype` defaults to the compute dtype."""
        p = self.model.norm.weight  # any parameter gives device and compute dtype; the norm is never swapped
        return KVCache(self.config, batch, num_slots, p.device, dtype or p.dtype, p.dtype, kv_type)

    def hidden_states(
        self,
        tokens: torch.Tensor,
        step: StepAttention,
        should_stop: Callable[[], bool] | None = None,
        offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> final normed hidden states (B, T, C), each layer attending through `step`.
        `should_stop` is polled before every layer after the first; when true, raises ForwardCancelled.
        `offsets` (B, T, 3) long: each token's multimodal rotary offsets (attention.mrope_turn), or None."""
        x = self.model.embed_tokens(tokens)  # (B, T, C)
        turn: Rope | None = None
        if offsets is not None and self.config.mrope_section and bool(offsets.any()):
            cos, sin = mrope_turn(self.config, offsets)
            turn = cos.to(x.dtype), sin.to(x.dtype)
        if self.embed_scale is not None:
            scaled = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # as transformers: in the weights' dtype
            # A picture's rows (ids from the vocabulary up) go in as the tower gave them: transformers puts them
            # in after the scale.
            x = (
                torch.where((tokens < self.config.vocab_size)[..., None], scaled, x)
                if self.config.image_ids
                else scaled
            )
        for i, layer in enumerate(self.decoder_layers()):
            if i and should_stop is not None and should_stop():  # a long prefill chunk stops within one layer
                raise ForwardCancelled
            x = layer(x, i, step, turn)
        h: torch.Tensor = self.model.norm(x)
        return h

    def forward_causal(self, tokens: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:
        """Training / scoring path without a cache: tokens (B, T) -> logits (B, T, V), causal, positions 0..T-1
        (each turned by its `offsets` (B, T, 3), multimodal rotary, when given)."""
        runs = image_runs(tokens, self.config.vocab_size) if self.config.images_bidirectional else None
        logits: torch.Tensor = self.lm_head(
            self.hidden_states(tokens, CausalStep(self.rotary(), tokens.shape[1], self.config, runs), offsets=offsets)
        )
        return logits

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        batch: SlotBatch,
        last_only: bool = False,
        reads: StepReads | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (B, 1, V) for the last token only when `last_only`; writes this
        step's K/V into `cache`. `reads`: the step's plan when the caller already made it (KVCache.plan).
        `should_stop`: polled between layers (see hidden_states)."""
        if self.config.images_bidirectional and tokens.shape[1] > 1 and reads is None:
            batch = open_image_runs(batch, tokens, self.config.vocab_size)
        reads = reads or cache.plan(batch, self.rotary())
        h = self.hidden_states(tokens, SlotStep(cache, batch, reads), should_stop, batch.offsets)
        if last_only:
            h = h[:, -1:, :]
        logits: torch.Tensor = self.lm_head(h)
        return logits
