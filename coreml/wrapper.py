"""The torch modules traced and converted to Core ML: the engine's Transformer re-expressed for the ANE, in pieces.

A converted model is a bundle of programs (see engine.backends.coreml.bundle; the constants named below are
engine.backends.coreml.programs'): the embedding is looked up on the host, the
decoder layers run in chunks (`LayerChunk`, each ≤ ~1 GB of weights, one package per chunk), and the final norm
plus LM head run in a separate package (`Head`). Every package has one function per token count T
(FUNCTIONS: prefill T=64, prefill_8 T=8, decode T=1), all traced from the same weights, so `save_multifunction`
stores them once.

LayerChunk inputs (B = 1; T = chunk; S = slots; C = hidden; D = head dim; every float is fp16 when converted):
    hidden      (1, C, 1, T)      the residual stream, channels-first (the ANE's native conv layout)
    q_cos/q_sin (1, 1, T, D)      RoPE of the new tokens' positions
    k_cos/k_sin (1, 1, S, D)      RoPE of every slot's position after this step's writes (keys are stored
                                  unrotated and rotated on read, as in engine.model.network)
    mask        (1, 1, T, S)      additive attention mask over slots: 0 = may attend, MASK_MIN = may not
    write       (1, 1, S, T)      one-hot: write[s, t] = 1 when token t's K/V go to slot s (a column of zeros
                                  writes nothing, so a call may carry padding rows)
    keep        (1, 1, S, 1)      1 - (row sums of write): 1 where a slot keeps its content
  and only for a model with sliding-window layers (Gemma 3; LOCAL_INPUTS):
    q_cos_l .. k_sin_l            as q_cos .. k_sin, at the sliding layers' own rope base
    mask_l      (1, 1, T, S)      what a sliding layer's tokens may attend (its window; never a retrieved block)
States:
    k_cache, v_cache (L_chunk, Hkv, S, D) fp16   the chunk's layers of one sequence's slot table; keys unrotated
Outputs:
    hidden_out  (1, C, 1, T)
    qsum        (1, L_chunk, Hkv, D)   per layer, the mean of the pre-RoPE queries (after q_proj + bias) over the
                                       call's tokens and over the query heads of each KV-head group (the memory
                                       cascade's retrieval signal; the host averages calls weighted by tokens)

Head inputs: hidden (1, C, 1, T). Outputs: logits_0 .. logits_{n-1} (1, T, V_i), the LM head split into pieces
of at most ANE_MAX_DIM classes.

Writing K/V is arithmetic, not indexing: cache' = cache * keep + write @ new (exact in fp16: one-hot factors).
So the graph has no dynamic-offset slice_update, no int32 index arithmetic between layers (a concat per write)
and no gather, all of which run on the CPU; the layer slice of the state is updated at a static offset.
"""

from __future__ import annotations

import math
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.coreml.programs import strip_var_suffix, vocab_pieces
from engine.model.attention import layer_rope_kinds
from engine.model.config import ModelConfig
from engine.model.network import DecoderLayer, Transformer

FP16_MAX = float(torch.finfo(torch.float16).max)


def conv_weight(linear: nn.Linear) -> nn.Parameter:
    """(out, in) linear weight -> (out, in, 1, 1) 1x1-conv weight.

    ANE rule: projections run as 1x1 convolutions over a channels-first (1, C, 1, T) tensor, the layout the
    ANE's convolution engine consumes natively (no transposes around every matmul).
    """
    return nn.Parameter(linear.weight.detach().half()[:, :, None, None].clone(), requires_grad=False)


def conv_bias(linear: nn.Linear) -> nn.Parameter | None:
    return None if linear.bias is None else nn.Parameter(linear.bias.detach().half().clone(), requires_grad=False)


class ConvProj(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = conv_weight(linear)
        self.bias = conv_bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, Cin, 1, T) -> (1, Cout, 1, T)
        return F.conv2d(x, self.weight, self.bias)


class ChannelRMSNorm(nn.Module):
    """RMSNorm over the channel axis of (1, C, 1, T) as one LayerNorm over concat([y, -y, c, -c]) (Anemll's form).

    The concatenation has mean 0, so LayerNorm's variance is the mean square: one fused ANE op instead of a
    dozen. fp16 safety: y = x / m with m = max(|x|, 1), so no square inside the norm exceeds 1 (x² overflows fp16
    once |x| > 256). The two extra channels ±c, c = sqrt(C·eps) / m, put the model's epsilon back exactly:
    LN = y / sqrt((Σy² + c²) / (C + 1)) = sqrt((C + 1) / C) · x / sqrt(mean(x²) + eps), and the constant factor
    is folded into the weight. LayerNorm's own epsilon is 0 (c > 0 keeps the variance positive).
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        c = weight.numel()
        fold = math.sqrt(c / (c + 1))
        self.weight = nn.Parameter(
            (weight.detach().float() * fold).half()[None, :, None, None].clone(), requires_grad=False
        )  # (1, C, 1, 1)
        self.c_num = math.sqrt(c * eps)
        self.channels = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, C, 1, T) -> (1, C, 1, T)
        # An explicit fp16 upper bound: a one-sided clamp lowers to clip(beta=FLT_MAX), an fp16 inf constant.
        m = torch.clamp(x.abs().amax(dim=1, keepdim=True), min=1.0, max=FP16_MAX)  # (1, 1, 1, T)
        y = (x / m).permute(0, 3, 2, 1)  # (1, T, 1, C): LayerNorm normalises the last axis
        c = (self.c_num / m).permute(0, 3, 2, 1)  # (1, T, 1, 1)
        doubled = torch.cat((y, -y, c, -c), dim=-1)  # (1, T, 1, 2C + 2)
        normed = F.layer_norm(doubled, (2 * self.channels + 2,), eps=0.0)[..., : self.channels]  # (1, T, 1, C)
        return normed.permute(0, 3, 2, 1) * self.weight


class HeadRMSNorm(nn.Module):
    """RMSNorm over the last axis of (1, heads, T, D) (Qwen3's and Gemma 3's per-head q/k norms), in
    ChannelRMSNorm's fp16-safe LayerNorm form; the axis is already last, so no transposes."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        d = weight.numel()
        fold = math.sqrt(d / (d + 1))
        self.weight = nn.Parameter((weight.detach().float() * fold).half().clone(), requires_grad=False)  # (D,)
        self.c_num = math.sqrt(d * eps)
        self.dim = d

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, N, T, D) -> (1, N, T, D)
        m = torch.clamp(x.abs().amax(dim=-1, keepdim=True), min=1.0, max=FP16_MAX)  # (1, N, T, 1)
        y = x / m
        c = self.c_num / m  # (1, N, T, 1)
        doubled = torch.cat((y, -y, c, -c), dim=-1)  # (1, N, T, 2D + 2)
        return F.layer_norm(doubled, (2 * self.dim + 2,), eps=0.0)[..., : self.dim] * self.weight


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """(-x2, x1) for x = (x1, x2) on the last axis; `half` is a Python int (a traced shape would become an op)."""
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    """One decoder layer's weights in the ANE layout. Beyond Llama's: per-head q/k norms (Qwen3, Gemma 3) and
    sandwich norms (Gemma 3: post_norm then normalizes attention's output, ff_pre_norm / ff_post_norm wrap the MLP),
    each None where the model has none."""

    def __init__(self, layer: DecoderLayer, eps: float) -> None:
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.input_norm = ChannelRMSNorm(layer.input_layernorm.weight, eps)
        self.post_norm = ChannelRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.q_norm = HeadRMSNorm(a.q_norm.weight, eps) if a.q_norm is not None else None
        self.k_norm = HeadRMSNorm(a.k_norm.weight, eps) if a.k_norm is not None else None
        self.ff_pre_norm = self.ff_post_norm = None
        if layer.sandwich:
            self.ff_pre_norm = ChannelRMSNorm(layer.pre_feedforward_layernorm.weight, eps)
            self.ff_post_norm = ChannelRMSNorm(layer.post_feedforward_layernorm.weight, eps)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            ConvProj(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
        )
        self.gate_proj, self.up_proj, self.down_proj = (ConvProj(p) for p in (m.gate_proj, m.up_proj, m.down_proj))


class LayerChunk(nn.Module):
    """Decoder layers [first, last) over a state-held slot table; see the module doc for inputs and outputs."""

    k_cache: torch.Tensor  # (L_chunk, Hkv, S, D) fp16 buffers, registered below: the program's states
    v_cache: torch.Tensor

    def __init__(self, model: Transformer, first: int, last: int, num_slots: int, chunk: int) -> None:
        super().__init__()
        cfg = model.config
        self.chunk = chunk
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.groups = cfg.num_kv_groups
        # Gemma 3 scales scores by query_pre_attn_scalar**-0.5; the engine records its queries pre-multiplied by
        # q_factor (query_scale * sqrt(D)), so the summary is too.
        self.scale = cfg.head_dim**-0.5 if cfg.query_scale is None else cfg.query_scale
        self.q_factor = 1.0 if cfg.query_scale is None else cfg.query_scale * cfg.head_dim**0.5
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        kinds = layer_rope_kinds(cfg)
        self.local_rope = tuple(kinds[i] == 1 for i in range(first, last))  # rotates at the sliding layers' base
        self.sliding = tuple(cfg.is_sliding(i) for i in range(first, last))  # reads mask_l
        self.layers = nn.ModuleList(
            Layer(cast(DecoderLayer, model.model.layers[i]), cfg.rms_norm_eps) for i in range(first, last)
        )
        # States: one slot table per K and V. Buffers updated in place become Core ML states.
        shape = (last - first, self.n_kv, num_slots, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.float16))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.float16))

    @staticmethod
    def store(
        cache: torch.Tensor, layer: int, new: torch.Tensor, write: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """new (1, Hkv, T, D) -> cache[layer] with slot s = write[s] @ new where written, else kept; returns the
        layer's (1, Hkv, S, D). The slice offsets are Python ints, so the update has static begin/end."""
        updated = cache[layer : layer + 1] * keep + torch.matmul(write, new)  # (1, Hkv, S, D)
        cache[layer : layer + 1] = updated
        return updated

    def forward(
        self,
        hidden: torch.Tensor,  # (1, C, 1, T)
        q_cos: torch.Tensor,  # (1, 1, T, D)
        q_sin: torch.Tensor,  # (1, 1, T, D)
        k_cos: torch.Tensor,  # (1, 1, S, D)
        k_sin: torch.Tensor,  # (1, 1, S, D)
        mask: torch.Tensor,  # (1, 1, T, S) additive
        write: torch.Tensor,  # (1, 1, S, T) one-hot
        keep: torch.Tensor,  # (1, 1, S, 1)
        q_cos_l: torch.Tensor | None = None,  # (1, 1, T, D) LOCAL_INPUTS: only a model with sliding layers
        q_sin_l: torch.Tensor | None = None,  # (1, 1, T, D)
        k_cos_l: torch.Tensor | None = None,  # (1, 1, S, D)
        k_sin_l: torch.Tensor | None = None,  # (1, 1, S, D)
        mask_l: torch.Tensor | None = None,  # (1, 1, T, S) additive
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, h, hkv, d, g = self.chunk, self.n_heads, self.n_kv, self.head_dim, self.groups
        # GQA without repeating K/V: query heads kv*G .. kv*G+G-1 share KV head kv, so queries are grouped as
        # (1, Hkv, G*T, D) and the mask tiled to (1, 1, G*T, S) once for all layers.
        mask_g = mask.repeat(1, 1, g, 1) if g > 1 else mask
        local_g = mask_l.repeat(1, 1, g, 1) if mask_l is not None and g > 1 else mask_l
        x = hidden
        summaries = []
        for i, module in enumerate(self.layers):
            layer = cast(Layer, module)
            hn = layer.input_norm(x)
            q = layer.q_proj(hn).view(1, h, d, t).transpose(2, 3)  # (1, H, T, D)
            k = layer.k_proj(hn).view(1, hkv, d, t).transpose(2, 3)  # (1, Hkv, T, D)
            v = layer.v_proj(hn).view(1, hkv, d, t).transpose(2, 3)  # (1, Hkv, T, D)
            if layer.q_norm is not None and layer.k_norm is not None:  # per head, before the rotation
                q, k = layer.q_norm(q), layer.k_norm(k)
            summary = q.reshape(1, hkv, g * t, d).mean(dim=2)  # (1, Hkv, D) pre-RoPE, per KV group
            summaries.append(summary * self.q_factor if self.q_factor != 1.0 else summary)
            keys = self.store(self.k_cache, i, k, write, keep)  # (1, Hkv, S, D) unrotated
            values = self.store(self.v_cache, i, v, write, keep)
            rope = (q_cos_l, q_sin_l, k_cos_l, k_sin_l) if self.local_rope[i] else (q_cos, q_sin, k_cos, k_sin)
            qc, qs, kc, ks = (cast(torch.Tensor, r) for r in rope)
            q = (q * qc + rotate_half(q, d // 2) * qs) * self.scale  # (1, H, T, D), scaled before the matmul: T < S
            keys = keys * kc + rotate_half(keys, d // 2) * ks
            m = cast(torch.Tensor, local_g) if self.sliding[i] else mask_g
            scores = torch.matmul(q.reshape(1, hkv, g * t, d), keys.transpose(2, 3)) + m  # (1, Hkv, G*T, S)
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, values)  # (1, Hkv, G*T, D)
            o = o.reshape(1, h, t, d).transpose(2, 3).reshape(1, h * d, 1, t)  # (1, H*D, 1, T)
            attn = layer.o_proj(o)  # (1, C, 1, T)
            if layer.ff_pre_norm is None or layer.ff_post_norm is None:
                x = x + attn
                hn = layer.post_norm(x)
            else:  # sandwich norms (Gemma 3)
                x = x + layer.post_norm(attn)
                hn = layer.ff_pre_norm(x)
            gate = layer.gate_proj(hn)
            mlp = layer.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * layer.up_proj(hn))
            x = x + (layer.ff_post_norm(mlp) if layer.ff_post_norm is not None else mlp)
        return x, torch.stack(summaries, dim=1)  # (1, C, 1, T), (1, L_chunk, Hkv, D)


class Head(nn.Module):
    """Final norm + LM head split into ≤ ANE_MAX_DIM-class pieces: (1, C, 1, T) -> logits_i (1, T, V_i).

    With tied embeddings this is the only copy of the matrix: the host's embedding lookup reads these weights.
    """

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        cfg = model.config
        self.norm = ChannelRMSNorm(model.model.norm.weight, cfg.rms_norm_eps)
        head = model.lm_head.weight.detach().half()  # (V, C)
        self.pieces = vocab_pieces(cfg.vocab_size)
        self.lm_head = nn.ParameterList(
            nn.Parameter(head[a:b, :, None, None].clone(), requires_grad=False) for a, b in self.pieces
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hn = self.norm(hidden)  # (1, C, 1, T)
        return tuple(F.conv2d(hn, w).squeeze(2).transpose(1, 2) for w in self.lm_head)  # each (1, T, V_i)


_PROJ_MODULE = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"ff_pre_norm": "pre_feedforward_layernorm", "ff_post_norm": "post_feedforward_layernorm"}
_HEAD_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def unfold_norm(weight: np.ndarray) -> torch.Tensor:
    c = weight.size
    return torch.from_numpy((np.asarray(weight, np.float32).reshape(-1) / math.sqrt(c / (c + 1))).astype(np.float16))


def engine_state_dict(
    chunks: list[tuple[int, dict[str, np.ndarray]]], head: dict[str, np.ndarray], embed: np.ndarray, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Inverse of the bundle's weight layout: each chunk's (first layer, program weights), the head program's
    weights and the host embedding (V, C) -> an engine Transformer state dict, so the torch engine can run exactly
    the weights a bundle uses (e.g. after dequantization). Norm weights are unfolded (see ChannelRMSNorm)."""
    biases = {
        "q_proj": config.qkv_bias,
        "k_proj": config.qkv_bias,
        "v_proj": config.qkv_bias,
        "o_proj": config.o_bias,
        "gate_proj": config.mlp_bias,
        "up_proj": config.mlp_bias,
        "down_proj": config.mlp_bias,
    }

    def table(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {strip_var_suffix(k): v for k, v in weights.items()}

    def take(t: dict[str, np.ndarray], name: str) -> np.ndarray:
        if name not in t:
            raise KeyError(f"the program has no weight for {name}")
        return np.asarray(t[name], dtype=np.float16)

    out: dict[str, torch.Tensor] = {}
    h = table(head)
    n_pieces = len(vocab_pieces(config.vocab_size))
    out["lm_head.weight"] = torch.from_numpy(
        np.concatenate([take(h, f"lm_head_{i}")[:, :, 0, 0] for i in range(n_pieces)])
    )
    out["model.norm.weight"] = unfold_norm(take(h, "norm_weight"))
    out["model.embed_tokens.weight"] = torch.from_numpy(np.asarray(embed, np.float16))
    for first, weights in chunks:
        t = table(weights)
        n = len({k.split("_")[1] for k in t if k.startswith("layers_")})
        for j in range(n):
            i = first + j
            norms = {**_NORMS, **(_SANDWICH_NORMS if config.sandwich_norms else {})}
            norms.update(_HEAD_NORMS if config.qk_norm else {})
            for short, full in norms.items():
                out[f"model.layers.{i}.{full}.weight"] = unfold_norm(take(t, f"layers_{j}_{short}_weight"))
            for proj, module in _PROJ_MODULE.items():
                out[f"model.layers.{i}.{module}.{proj}.weight"] = torch.from_numpy(
                    take(t, f"layers_{j}_{proj}_weight")[:, :, 0, 0].copy()
                )
                if biases[proj]:
                    out[f"model.layers.{i}.{module}.{proj}.bias"] = torch.from_numpy(
                        take(t, f"layers_{j}_{proj}_bias").copy()
                    )
    return out
