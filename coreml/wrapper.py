"""The torch module that is traced and converted to Core ML: the engine's Transformer re-expressed for the ANE.

One instance per function of the package, each with a fixed chunk of T tokens (FUNCTIONS: prefill T=64,
prefill_8 T=8, decode T=1), all built from the same weights, so `save_multifunction` stores the weights once.
The host splits any step into contiguous runs and each run into chunks of exactly these sizes, so a function never
sees padding: a padded row would write its K/V over a slot that other rows of the same call may attend to, and
avoiding that in-graph needs a dynamic-offset read of the cache, whose shape Core ML cannot infer statically.

Inputs (B = 1; T = chunk; S = slots; D = head dim; every float is fp16 in the converted program):
    input_ids   (1, T) int32      token ids
    q_cos/q_sin (1, 1, T, D)      RoPE of the new tokens' positions
    k_cos/k_sin (1, 1, S, D)      RoPE of every slot's position after this step's writes (keys are stored
                                  unrotated and rotated on read, as in engine.model)
    mask        (1, 1, T, S)      additive attention mask over slots: 0 = may attend, MASK_MIN = may not
    write_start (1,) int32        the chunk's K/V go to slots write_start .. write_start+T-1 (one contiguous run)
States:
    k_cache, v_cache (L, Hkv, S, D) fp16  the slot table of one sequence; keys unrotated
Outputs:
    logits_0 .. logits_{n-1} (1, T, V_i)  the LM head split into pieces of at most ANE_MAX_DIM classes

The RoPE tables are computed on the host: the graph then has no gather over a (max_positions, D) table (a large
gather does not run on the ANE), and slot positions stay whatever the cascade says they are.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.model import Transformer

# ANE rule: no tensor dimension may exceed 16384 (larger ones fall back to CPU or fail to compile), so a large
# vocabulary is split for the LM head (and for the embedding lookup) into pieces of at most this many rows.
ANE_MAX_DIM = 16384
# ANE rule: state dimensions are multiples of 32 (the slot axis and head dim tile without padding).
ANE_STATE_ALIGN = 32
# function name -> tokens per call. 64 amortises the weights over many tokens; 8 and 1 cover the remainder of a
# run in at most 7 + 7 calls instead of 63 single-token calls.
FUNCTIONS: dict[str, int] = {"prefill": 64, "prefill_8": 8, "decode": 1}
FP16_MAX = float(torch.finfo(torch.float16).max)
MASK_MIN = float(torch.finfo(torch.float16).min)  # finite: fp16 arithmetic never meets inf - inf


def vocab_pieces(vocab: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of the embedding / LM head, each at most ANE_MAX_DIM rows."""
    return [(a, min(a + ANE_MAX_DIM, vocab)) for a in range(0, vocab, ANE_MAX_DIM)]


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
    """RMSNorm over the channel axis of (1, C, 1, T), safe in fp16.

    ANE rule: everything runs in fp16, where x² overflows once |x| > 256 (Llama residual streams reach
    thousands). Dividing by max(|x|, 1) first keeps every square ≤ 1; the result is mathematically the same:
    x / sqrt(mean(x²) + eps) = y / sqrt(mean(y²) + eps / m²) with y = x / m.
    """

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().half()[None, :, None, None].clone(), requires_grad=False)  # (1, C, 1, 1)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An explicit fp16 upper bound: a one-sided clamp lowers to clip(beta=FLT_MAX), an fp16 inf constant.
        m = torch.clamp(x.abs().amax(dim=1, keepdim=True), min=1.0, max=FP16_MAX)  # (1, 1, 1, T)
        y = x / m
        var = (y * y).mean(dim=1, keepdim=True) + self.eps / (m * m)  # (1, 1, 1, T)
        return y * torch.rsqrt(var) * self.weight


def rotate_half(x: torch.Tensor, half: int) -> torch.Tensor:
    """(-x2, x1) for x = (x1, x2) on the last axis; `half` is a Python int (a traced shape would become an op)."""
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(nn.Module):
    def __init__(self, layer: nn.Module, eps: float) -> None:
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.input_norm = ChannelRMSNorm(layer.input_layernorm.weight, eps)
        self.post_norm = ChannelRMSNorm(layer.post_attention_layernorm.weight, eps)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (ConvProj(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj))
        self.gate_proj, self.up_proj, self.down_proj = (ConvProj(p) for p in (m.gate_proj, m.up_proj, m.down_proj))


class CoreMLWrapper(nn.Module):
    """Transformer over a state-held slot table; see the module doc for the inputs, states and outputs."""

    def __init__(self, model: Transformer, num_slots: int, chunk: int) -> None:
        super().__init__()
        cfg = model.config
        self.chunk = chunk
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.groups = cfg.num_kv_groups
        self.scale = cfg.head_dim**-0.5
        self.pieces = vocab_pieces(cfg.vocab_size)
        emb = model.model.embed_tokens.weight.detach().half()  # (V, C)
        self.embed = nn.ParameterList(nn.Parameter(emb[a:b].clone(), requires_grad=False) for a, b in self.pieces)
        self.layers = nn.ModuleList(Layer(layer, cfg.rms_norm_eps) for layer in model.model.layers)
        self.norm = ChannelRMSNorm(model.model.norm.weight, cfg.rms_norm_eps)
        head = model.lm_head.weight.detach().half()  # (V, C)
        self.lm_head = nn.ParameterList(nn.Parameter(head[a:b, :, None, None].clone(), requires_grad=False) for a, b in self.pieces)
        # States: one slot table per K and V, (L, Hkv, S, D) fp16. Buffers updated in place become Core ML states.
        shape = (cfg.num_hidden_layers, self.n_kv, num_slots, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.float16))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.float16))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (1, T) -> (1, T, C). With a vocabulary over ANE_MAX_DIM each piece looks up the ids in its range
        (clamped into range, then zeroed where out of range), so no tensor has a dimension over the limit."""
        if len(self.pieces) == 1:
            return F.embedding(ids, self.embed[0])
        out = None
        for (a, b), table in zip(self.pieces, self.embed):
            local = torch.clamp(ids - a, 0, b - a - 1)
            inside = ((ids >= a) & (ids < b)).unsqueeze(-1).half()  # (1, T, 1)
            part = F.embedding(local, table) * inside
            out = part if out is None else out + part
        return out

    def write(self, cache: torch.Tensor, layer: int, start: torch.Tensor, new: torch.Tensor) -> None:
        """new (1, Hkv, T, D) -> cache[layer, :, start:start+T] (traced as read_state, slice_update, write_state)."""
        t = self.chunk  # a Python int: a traced shape would become a runtime op
        cache[layer : layer + 1, :, start : start + t, :] = new

    def forward(
        self,
        input_ids: torch.Tensor,  # (1, T) int32
        q_cos: torch.Tensor,  # (1, 1, T, D)
        q_sin: torch.Tensor,  # (1, 1, T, D)
        k_cos: torch.Tensor,  # (1, 1, S, D)
        k_sin: torch.Tensor,  # (1, 1, S, D)
        mask: torch.Tensor,  # (1, 1, T, S) additive
        write_start: torch.Tensor,  # (1,) int32
    ) -> tuple[torch.Tensor, ...]:
        t, h, hkv, d, g = self.chunk, self.n_heads, self.n_kv, self.head_dim, self.groups
        start = write_start[0]
        # GQA without repeating K/V: query heads kv*G .. kv*G+G-1 share KV head kv, so queries are grouped as
        # (1, Hkv, G*T, D) and the mask tiled to (1, 1, G*T, S) once for all layers.
        mask_g = mask.repeat(1, 1, g, 1) if g > 1 else mask
        x = self.embed_tokens(input_ids).transpose(1, 2).unsqueeze(2)  # (1, C, 1, T) channels-first
        for i, layer in enumerate(self.layers):
            hn = layer.input_norm(x)
            q = layer.q_proj(hn).view(1, h, d, t).transpose(2, 3)  # (1, H, T, D)
            k = layer.k_proj(hn).view(1, hkv, d, t).transpose(2, 3)  # (1, Hkv, T, D)
            v = layer.v_proj(hn).view(1, hkv, d, t).transpose(2, 3)  # (1, Hkv, T, D)
            self.write(self.k_cache, i, start, k)
            self.write(self.v_cache, i, start, v)
            q = (q * q_cos + rotate_half(q, d // 2) * q_sin) * self.scale  # (1, H, T, D), scaled before the matmul: T < S
            keys = self.k_cache[i : i + 1]  # (1, Hkv, S, D) unrotated
            keys = keys * k_cos + rotate_half(keys, d // 2) * k_sin
            scores = torch.matmul(q.reshape(1, hkv, g * t, d), keys.transpose(2, 3)) + mask_g  # (1, Hkv, G*T, S)
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, self.v_cache[i : i + 1])  # (1, Hkv, G*T, D)
            o = o.reshape(1, h, t, d).transpose(2, 3).reshape(1, h * d, 1, t)  # (1, H*D, 1, T)
            x = x + layer.o_proj(o)
            hn = layer.post_norm(x)
            x = x + layer.down_proj(F.silu(layer.gate_proj(hn)) * layer.up_proj(hn))
        hn = self.norm(x)  # (1, C, 1, T)
        return tuple(F.conv2d(hn, w).squeeze(2).transpose(1, 2) for w in self.lm_head)  # each (1, T, V_i)


# Suffixes coremltools appends to a weight's var name (fp16 cast, compression) after the traced parameter name.
_VAR_SUFFIXES = ("_quantized", "_palettized", "_promoted_to_fp16", "_to_fp16", "_promoted")
_PROJ_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_NORMS = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}


def engine_state_dict(program_weights: dict[str, np.ndarray], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of CoreMLWrapper's weight layout: the weights a converted program uses (var name -> array, e.g.
    after dequantization) -> an engine Transformer state dict, so the torch engine can run exactly those weights."""
    by_param: dict[str, np.ndarray] = {}
    for var, value in program_weights.items():
        name = var
        for suffix in _VAR_SUFFIXES:
            name = name.removesuffix(suffix)
        by_param[name] = value
    out: dict[str, torch.Tensor] = {}
    n_pieces = len(vocab_pieces(config.vocab_size))

    def take(name: str) -> torch.Tensor:
        if name not in by_param:
            raise KeyError(f"the program has no weight for {name}")
        return torch.from_numpy(np.asarray(by_param[name], dtype=np.float16))

    out["model.embed_tokens.weight"] = torch.cat([take(f"embed_{i}") for i in range(n_pieces)])  # (V, C)
    out["lm_head.weight"] = torch.cat([take(f"lm_head_{i}")[:, :, 0, 0] for i in range(n_pieces)])  # (V, C)
    out["model.norm.weight"] = take("norm_weight").reshape(-1)
    biases = {"q_proj": config.qkv_bias, "k_proj": config.qkv_bias, "v_proj": config.qkv_bias, "o_proj": config.o_bias,
              "gate_proj": config.mlp_bias, "up_proj": config.mlp_bias, "down_proj": config.mlp_bias}
    for i in range(config.num_hidden_layers):
        for short, full in _NORMS.items():
            out[f"model.layers.{i}.{full}.weight"] = take(f"layers_{i}_{short}_weight").reshape(-1)
        for proj, module in _PROJ_MODULE.items():
            out[f"model.layers.{i}.{module}.{proj}.weight"] = take(f"layers_{i}_{proj}_weight")[:, :, 0, 0]
            if biases[proj]:
                out[f"model.layers.{i}.{module}.{proj}.bias"] = take(f"layers_{i}_{proj}_bias")
    return out
