"""Block-quantized weights in GGUF's exact layouts: Q8_0, Q4_0, Q4_1 (a scale per 32 weights).

A matrix (N, K) is N rows of K/32 blocks, row-major, each block as ggml lays it out:
  Q8_0: fp16 d, 32 x int8 q                       w = d * q                   (34 bytes)
  Q4_0: fp16 d, 16 bytes of nibbles               w = d * (nib - 8)           (18 bytes)
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles       w = d * nib + m             (20 bytes)
Nibbles: byte i holds element i in its low half and element i + 16 in its high half.

`quantize` reproduces ggml's reference quantizers (quantize_row_*_ref) in float32, so an HF folder quantized here
holds the bytes llama.cpp's converter writes; `dequantize` equals `gguf.quants.dequantize` of the same bytes.
A GGUF's tensors arrive as StoredTensor (the raw blocks) and run as stored: never dequantized and re-quantized.
Leaf module: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

BLOCK = 32  # weights per block in every format here


class BlockType(Enum):
    """A block format: its GGUF name (gguf.GGMLQuantizationType), ggml type id and bytes per block."""

    Q4_0 = ("Q4_0", 2, 18)
    Q4_1 = ("Q4_1", 3, 20)
    Q8_0 = ("Q8_0", 8, 34)

    def __init__(self, gguf_name: str, ggml_id: int, block_bytes: int) -> None:
        self.gguf_name = gguf_name
        self.ggml_id = ggml_id
        self.block_bytes = block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / BLOCK

    @classmethod
    def named(cls, name: str) -> BlockType:
        """'q8_0' or 'Q8_0' -> BlockType.Q8_0; ValueError naming the choices otherwise."""
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(
                f"{name!r} is not a block format here; choose one of {', '.join(t.name.lower() for t in cls)}"
            ) from None


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D weight as a GGUF stores it: `qtype` a gguf.GGMLQuantizationType name ("Q4_1", "Q8_0", ...), `shape`
    in torch order (out, in), `data` the raw bytes (uint8, rows of in/32 blocks, row-major)."""

    qtype: str
    shape: tuple[int, int]
    data: np.ndarray


def row_bytes(qtype: BlockType, k: int) -> int:
    return (k // BLOCK) * qtype.block_bytes


def check_stored(t: StoredTensor, name: str = "weight") -> BlockType:
    """The tensor's block format after checking its bytes fit its shape; ValueError in one sentence otherwise."""
    qtype = BlockType.named(t.qtype)
    n, k = t.shape
    if k % BLOCK or n <= 0 or k <= 0:
        raise ValueError(
            f"{name} has shape {t.shape}, which {t.qtype} cannot hold (the input size must be a multiple of {BLOCK})"
        )
    if t.data.dtype != np.uint8 or t.data.size != n * row_bytes(qtype, k):
        raise ValueError(
            f"{name} holds {t.data.size} bytes, not the {n * row_bytes(qtype, k)} a {t.qtype} matrix of shape {t.shape} needs"
        )
    return qtype


def scales_finite(t: StoredTensor) -> bool:
    """Whether every block's scale (and Q4_1's minimum) is finite: a block's only float fields, so the matrix holds
    NaN or infinity exactly when one of them does. `t` has passed check_stored."""
    qtype = BlockType.named(t.qtype)
    b = np.asarray(t.data, dtype=np.uint8).reshape(-1, qtype.block_bytes)  # (blocks, bytes)
    fields = np.ascontiguousarray(b[:, : 4 if qtype is BlockType.Q4_1 else 2]).view(np.float16)  # (blocks, 1 or 2)
    return bool(np.isfinite(fields).all())


def _f16_bytes(a: np.ndarray) -> np.ndarray:  # (n, 1) float32 -> (n, 2) uint8, round to nearest even
    return a.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize(w: np.ndarray, qtype: BlockType) -> np.ndarray:
    """w (N, K) float -> raw blocks (N, K/32 * block_bytes) uint8, as ggml's reference quantizer writes them."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"{qtype.name} needs an input size that is a multiple of {BLOCK}, not {k}")
    x = w.reshape(-1, BLOCK)  # (blocks, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if qtype is BlockType.Q8_0:
            d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)  # (blocks, 1)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            v = x * inv
            q = (np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))).astype(np.int8)  # roundf: half away from zero
            out = np.concatenate([_f16_bytes(d), q.view(np.uint8)], axis=1)
        elif qtype is BlockType.Q4_0:
            at = np.abs(x).argmax(axis=1)[:, None]  # the first element of largest magnitude, with its sign
            d = np.take_along_axis(x, at, axis=1) / np.float32(-8)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            q = np.minimum(np.trunc(x * inv + np.float32(8.5)), 15).astype(np.uint8)
            out = np.concatenate([_f16_bytes(d), _pack(q)], axis=1)
        else:
            lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
            d = (hi - lo) / np.float32(15)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            q = np.minimum(np.trunc((x - lo) * inv + np.float32(0.5)), 15).astype(np.uint8)
            out = np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack(q)], axis=1)
    return out.reshape(n, -1)


def _pack(q: np.ndarray) -> np.ndarray:  # (blocks, 32) in 0..15 -> (blocks, 16) bytes
    packed: np.ndarray = (q[:, : BLOCK // 2] | (q[:, BLOCK // 2 :] << np.uint8(4))).astype(np.uint8)
    return packed


def dequantize(data: np.ndarray, qtype: BlockType, shape: tuple[int, int]) -> np.ndarray:
    """Raw blocks of a (N, K) matrix (or any rows of one: data (n, K/32 * block_bytes)) -> float32 (n, K)."""
    k = shape[1]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, qtype.block_bytes)  # (blocks, bytes)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)  # (blocks, 1)
    if qtype is BlockType.Q8_0:
        w = b[:, 2:].copy().view(np.int8).astype(np.float32) * d
    else:
        qs = b[:, 4:] if qtype is BlockType.Q4_1 else b[:, 2:]
        nib = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1).astype(np.float32)  # (blocks, 32)
        if qtype is BlockType.Q4_1:
            w = d * nib + b[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            w = d * (nib - np.float32(8))
    return w.reshape(-1, k)
