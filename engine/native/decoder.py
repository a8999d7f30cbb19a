"""The model's int8 CPU path on the native kernels: linear layers, and a whole decoding step in one call.

`use_native_int8(model, kernels)` replaces every linear layer with a NativeInt8Linear (any number of rows: prefill
chunks and batches call it like nn.Linear) and attaches a NativeDecoder, which `Transformer.forward` uses for
the common decoding step: one new token in one row whose only stale read copy is its own (plain decoding, and
the cascade between evictions). Every other step runs the PyTorch code over the same NativeInt8Linear layers,
so both paths share weights, arithmetic and the slot table.
"""

from __future__ import annotations

import ctypes
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.backends.int8 import quantize_linears, quantize_rows
from engine.native import CacheDesc, ModelDesc, NativeKernels, QMat, StepDesc

if TYPE_CHECKING:
    from engine.model import KVCache, SlotBatch, StepReads, Transformer


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class NativeInt8Linear(nn.Module):
    """y = x @ W^T + b with W int8 per output channel, x quantized per row (symmetric, 8-bit) at call time."""

    def __init__(self, kernels: NativeKernels, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.kernels = kernels
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("q", q.contiguous(), persistent=False)  # (N, K) int8
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)  # (N,)
        self.register_buffer("row_sums", q.sum(dim=1, dtype=torch.int32), persistent=False)  # (N,)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)  # (N,)
        self.desc = QMat(_ptr(self.q), _ptr(self.scales), _ptr(self.row_sums), _ptr(self.bias), self.out_features, self.in_features)

    @classmethod
    def from_linear(cls, kernels: NativeKernels, linear: nn.Linear) -> "NativeInt8Linear":
        q, scales = quantize_rows(linear.weight)
        return cls(kernels, q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) float32 -> (..., N) float32
        rows = x.reshape(-1, self.in_features).contiguous()  # (M, K)
        m = rows.shape[0]
        if m > 1:
            # Several rows (prefill chunks, batches) reuse each weight row: PyTorch's int8 GEMM beats a row-at-a-time
            # kernel there (4x at 128 rows). Same quantization and exact int32 sums as spark_qgemv, same result.
            amax = rows.abs().amax(dim=1, keepdim=True)  # (M, 1)
            xq = torch.round(rows * torch.where(amax > 0, 127.0 / amax, 0.0)).to(torch.int8)  # (M, K)
            acc = torch._int_mm(xq, self.q.t())  # (M, N) int32
            y = acc.float().mul_((amax / 127.0) * self.scales)  # (M, N)
            return (y if self.bias is None else y.add_(self.bias)).view(*x.shape[:-1], self.out_features)
        y = torch.empty(1, self.out_features)  # (1, N)
        xq = torch.empty(self.in_features, dtype=torch.int8)  # the quantized row
        self.kernels.lib.spark_qgemv(ctypes.byref(self.desc), rows.data_ptr(), y.data_ptr(), xq.data_ptr())
        return y.view(*x.shape[:-1], self.out_features)


class NativeDecoder:
    """One decoding step of a fused, NativeInt8Linear model in a single native call (spark_decode)."""

    def __init__(self, kernels: NativeKernels, model: "Transformer") -> None:
        cfg = model.config
        layers = list(model.model.layers)
        n = len(layers)
        self.kernels = kernels
        self.model = model  # holds every buffer the descriptors point into

        def mats(get) -> ctypes.Array:  # type: ignore[no-untyped-def]
            return (QMat * n)(*[get(layer).desc for layer in layers])

        self._arrays = (
            (ctypes.c_void_p * n)(*[layer.input_layernorm.weight.data_ptr() for layer in layers]),
            (ctypes.c_void_p * n)(*[layer.post_attention_layernorm.weight.data_ptr() for layer in layers]),
            mats(lambda layer: layer.self_attn.qkv_proj),
            mats(lambda layer: layer.self_attn.o_proj),
            mats(lambda layer: layer.mlp.gate_up_proj),
            mats(lambda layer: layer.mlp.down_proj),
        )
        attn_norm, mlp_norm, qkv, o, gate_up, down = self._arrays
        self.desc = ModelDesc(
            n,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            cfg.rms_norm_eps,
            ctypes.cast(attn_norm, ctypes.POINTER(ctypes.c_void_p)),
            ctypes.cast(mlp_norm, ctypes.POINTER(ctypes.c_void_p)),
            qkv,
            o,
            gate_up,
            down,
            model.model.norm.weight.data_ptr(),
            ctypes.pointer(model.lm_head.desc),
        )
        self.vocab = model.lm_head.out_features
        self.scratch_floats = int(kernels.lib.spark_decode_scratch_floats(ctypes.byref(self.desc)))

    def accepts(self, cache: "KVCache", reads: "StepReads") -> bool:
        """The native step covers one row and one token whose only stale read copy is its own, nothing masked."""
        return (
            cache.batch == 1
            and reads.width > 0
            and reads.write_ranks is not None
            and reads.blocked is None
            and cache.k.dtype in (torch.float16, torch.float32)
            and cache.k_read.dtype == torch.float32
        )

    def decode(self, x: torch.Tensor, cache: "KVCache", batch: "SlotBatch", reads: "StepReads") -> torch.Tensor:
        """x (1, 1, C) embedded token -> logits (1, 1, V); writes the token's k, v and read copies into `cache`."""
        assert reads.write_ranks is not None
        residual = x.reshape(-1).contiguous().clone()  # (C,) updated in place by the kernel
        cos_plain, sin_plain = (t.contiguous() for t in reads.rope_q)  # (1, 1, 1, D)
        cos_new, sin_new = (t.contiguous() for t in (reads.rope_q_framed or reads.rope_q))
        step = StepDesc(
            cos_new.data_ptr(),
            sin_new.data_ptr(),
            cos_plain.data_ptr(),
            sin_plain.data_ptr(),
            int(batch.write_slots[0, 0]),
            int(reads.write_ranks[0]),
            reads.width,
            reads.split,
            cache.summary.data_ptr(),  # (L, 1, Hkv, D): the step's query summary, as the PyTorch path writes it
        )
        table = CacheDesc(
            cache.k.data_ptr(), cache.v.data_ptr(), cache.k_read.data_ptr(), cache.v_read.data_ptr(), cache.num_slots, int(cache.k.dtype == torch.float16)
        )
        logits = torch.empty(self.vocab)  # (V,)
        scores = torch.empty(reads.width)  # (m,) one head's attention weights at a time
        # Per call, not per decoder: forked backends share the model, and ctypes lets their threads run at once.
        scratch = torch.empty(self.scratch_floats)
        self.kernels.lib.spark_decode(
            ctypes.byref(self.desc), ctypes.byref(table), ctypes.byref(step), residual.data_ptr(), logits.data_ptr(), scratch.data_ptr(), scores.data_ptr()
        )
        return logits.view(1, 1, -1)


def use_native_int8(model: "Transformer", kernels: NativeKernels) -> None:
    """Run every linear layer of a fused fp32 `model` on the native kernels (NativeInt8Linear) and attach a
    NativeDecoder. The model's head_dim fits kernels.max_head_dim (checked by the backend)."""
    quantize_linears(model, partial(NativeInt8Linear, kernels))
    model.native_decoder = NativeDecoder(kernels, model)
