"""Int8 weights for the CPU path: dynamic-quantized linears and the tied embedding that shares their matrix.

Decoding one token reads every weight once, so CPU decode speed is memory bandwidth. Int8 weights (one scale per
output channel) move a quarter of fp32's bytes; the activation row is quantized on the fly per call (one scale per
row, i.e. per token) and the product runs in int8 with int32 accumulation: PyTorch's FBGEMM kernels on x86,
QNNPACK on Arm. llama.cpp's Q8_0 is the same idea with a scale per 32 weights; `bench decode --quantize int8`
compares the two at that precision.

Measured on one Zen 4 core for a SmolLM-135M shape: the 211 decode matmuls of one token take 9.8 ms in int8
against 40.7 ms in fp32 (fp32 K-major) and 37.4 ms in bf16.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from engine.model import replace_linears

# Smallest per-channel scale: an all-zero row would otherwise get scale 0 and quantize to NaN.
_MIN_SCALE = 1e-12


def quantized_engine() -> str:
    """The quantized kernel library for this CPU: FBGEMM (via `x86`) on Intel/AMD, QNNPACK on Arm."""
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm", "qnnpack"):
        if name in engines:
            return name
    raise RuntimeError("This PyTorch build has no quantized CPU kernels (fbgemm or qnnpack).")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (N, K) float -> int8 (N, K) and per-row scales (N,) float32, symmetric: w ~= q * scale."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=_MIN_SCALE)  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


class Int8Linear(nn.Module):
    """y = x @ W^T + b with W int8 per output channel and x quantized per row at call time."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        zeros = torch.zeros(q.shape[0], dtype=torch.long)
        with warnings.catch_warnings():
            # PyTorch marks quantized *tensors* deprecated; this one only lives until prepack below.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(q, scales.double(), zeros, 0)  # (N, K) qint8
        b = None if bias is None else bias.detach().float()
        # The packed form is the kernel library's own blocked layout; the int8 `q` is not kept beside it.
        self._packed = torch.ops.quantized.linear_prepack(qweight, b)
        # FBGEMM's AVX2 path multiplies u8 x s8 pairs into saturating int16: 7-bit activations keep that exact.
        # QNNPACK requires the full 8-bit range.
        self._reduce_range = torch.backends.quantized.engine != "qnnpack"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        q, scales = quantize_rows(linear.weight)
        return cls(q, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) float32 -> (..., N) float32
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features), self._packed, self._reduce_range)
        return y.view(*x.shape[:-1], self.out_features)


class Int8Embedding(nn.Module):
    """Embedding rows dequantized from the same int8 matrix and scales as the tied LM head."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("q", q, persistent=False)  # (V, C) int8
        self.register_buffer("scales", scales, persistent=False)  # (V,) float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) long -> (B, T, C) float32
        flat = ids.reshape(-1)
        rows = self.q.index_select(0, flat).float() * self.scales.index_select(0, flat)[:, None]  # (B*T, C)
        return rows.view(*ids.shape, -1)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes the weights occupy after quantizing: parameters and buffers (each storage once: a tied embedding
    shares its LM head's int8 matrix), plus the kernel library's packed matrices, which are neither."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.in_features * m.out_features + 8 * m.out_features  # int8 matrix, fp32 scale + bias per row
    return total


def quantize_linears(model: nn.Module, make: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], nn.Module]) -> None:
    """Swap every nn.Linear of `model` (a Transformer) for make(int8 rows, scales, bias). A tied LM head quantizes
    the vocabulary matrix once: the embedding dequantizes rows of the same int8 copy."""
    cfg = model.config  # type: ignore[attr-defined]
    if cfg.tie_word_embeddings:
        q, scales = quantize_rows(model.lm_head.weight)  # type: ignore[union-attr]
        model.lm_head = make(q, scales, None)  # type: ignore[assignment]
        model.model.embed_tokens = Int8Embedding(q, scales)  # type: ignore[union-attr]
    replace_linears(model, lambda linear: make(*quantize_rows(linear.weight), linear.bias))


def use_int8_linears(model: nn.Module) -> None:
    """Run every linear layer of `model` on PyTorch's quantized kernels (Int8Linear)."""
    torch.backends.quantized.engine = quantized_engine()
    quantize_linears(model, Int8Linear)
