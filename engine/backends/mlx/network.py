"""The Llama family (Llama/SmolLM, Mistral, Qwen2/3, Gemma 3, Phi-3) in MLX ops, reading the same ModelConfig and
the same parameter names as engine.model.network, whose arithmetic it follows step for step (norms, per-head q/k
norms, sandwich norms, GeGLU, scaled embeddings, the query scale folded into the queries): the two backends then
differ by rounding only.

Each layer's attention goes through one interface, `Attend` (the slot table's step: engine.backends.mlx.slots).

Shapes: B rows, T new tokens, C hidden, H query heads, Hkv key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Protocol

import mlx.core as mx

from engine.backends.mlx.weights import QuantWeight, Weight
from engine.model.config import ModelConfig
from engine.model.network import ForwardCancelled


class Attend(Protocol):
    """What a layer's attention asks of the step it runs in."""

    def record_queries(self, layer: int, q: mx.array) -> None:
        """q (B, T, H*D) pre-RoPE (after q_proj, its bias, norm and scale): the step's query summary."""

    def attend(self, layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        """q (B, H, T, D), k and v (B, Hkv, T, D), unrotated -> attention output (B, H, T, D)."""
        ...


def gelu_tanh(x: mx.array) -> mx.array:
    return 0.5 * x * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class MLXNetwork:
    """The network's forward over MLX weights (engine.backends.mlx.weights), keyed by the HF parameter names."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Weight], dtype: mx.Dtype) -> None:
        self.cfg = cfg
        self.w = dict(weights)
        self.dtype = dtype
        self.q_factor = None if cfg.query_scale is None else cfg.query_scale * cfg.head_dim**0.5
        self.embed_scale = cfg.hidden_size**0.5 if cfg.scale_embeddings else None

    def _dense(self, name: str) -> mx.array:
        w = self.w[name]
        assert not isinstance(w, QuantWeight), name  # norms and biases are never quantized
        return w

    def linear(self, name: str, x: mx.array) -> mx.array:
        """x (..., in) @ the matrix `name`.weight (out, in) transposed, plus `name`.bias where it has one."""
        w = self.w[name + ".weight"]
        if isinstance(w, QuantWeight):
            y = mx.quantized_matmul(
                x, w.packed, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
            )
        else:
            y = x @ w.T
        return y if name + ".bias" not in self.w else y + self._dense(name + ".bias")

    def norm(self, name: str, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self._dense(name + ".weight"), self.cfg.rms_norm_eps)

    def embed(self, ids: mx.array) -> mx.array:  # (B, T) int -> (B, T, C)
        w = self.w["model.embed_tokens.weight"]
        x = w.rows(ids) if isinstance(w, QuantWeight) else w[ids]
        x = x.astype(self.dtype)
        if self.embed_scale is not None:
            x = x * mx.array(self.embed_scale, dtype=self.dtype)  # as transformers: the scale in the weights' dtype
        return x

    def attention(self, i: int, x: mx.array, step: Attend) -> mx.array:  # (B, T, C) -> (B, T, C)
        cfg = self.cfg
        b, t, _ = x.shape
        h, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        p = f"model.layers.{i}.self_attn."
        q, k, v = self.linear(p + "q_proj", x), self.linear(p + "k_proj", x), self.linear(p + "v_proj", x)
        if cfg.qk_norm:  # per head, before the rotation
            q = self.norm(p + "q_norm", q.reshape(b, t, h, d)).reshape(b, t, h * d)
            k = self.norm(p + "k_norm", k.reshape(b, t, hkv, d)).reshape(b, t, hkv * d)
        if self.q_factor is not None:
            q = q * self.q_factor
        step.record_queries(i, q)
        q = q.reshape(b, t, h, d).transpose(0, 2, 1, 3)  # (B, H, T, D)
        k = k.reshape(b, t, hkv, d).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        v = v.reshape(b, t, hkv, d).transpose(0, 2, 1, 3)  # (B, Hkv, T, D)
        out = step.attend(i, q, k, v)  # (B, H, T, D)
        return self.linear(p + "o_proj", out.transpose(0, 2, 1, 3).reshape(b, t, h * d))

    def mlp(self, i: int, x: mx.array) -> mx.array:
        p = f"model.layers.{i}.mlp."
        gate, up = self.linear(p + "gate_proj", x), self.linear(p + "up_proj", x)
        act = gelu_tanh(gate) if self.cfg.hidden_act == "gelu_pytorch_tanh" else gate * mx.sigmoid(gate)
        return self.linear(p + "down_proj", act * up)

    def layer(self, i: int, x: mx.array, step: Attend) -> mx.array:
        p = f"model.layers.{i}."
        if not self.cfg.sandwich_norms:
            x = x + self.attention(i, self.norm(p + "input_layernorm", x), step)
            return x + self.mlp(i, self.norm(p + "post_attention_layernorm", x))
        x = x + self.norm(p + "post_attention_layernorm", self.attention(i, self.norm(p + "input_layernorm", x), step))
        return x + self.norm(
            p + "post_feedforward_layernorm", self.mlp(i, self.norm(p + "pre_feedforward_layernorm", x))
        )

    def forward(
        self,
        ids: mx.array,
        step: Attend,
        last_only: bool,
        should_stop: Callable[[], bool] | None,
        settle: Callable[[mx.array], None],
    ) -> mx.array:
        """ids (B, T) -> logits (B, T, V) or (B, 1, V). `should_stop` is polled before every layer after the first
        (ForwardCancelled when true); with it, `settle` evaluates each layer's output and table writes first, so a
        stop lands between layers that have run rather than before a lazy graph of them all."""
        x = self.embed(ids)
        for i in range(self.cfg.num_hidden_layers):
            if i and should_stop is not None:
                settle(x)
                if should_stop():
                    raise ForwardCancelled
            x = self.layer(i, x, step)
        h = self.norm("model.norm", x)
        if last_only:
            h = h[:, -1:, :]
        return self.linear("lm_head", h)
