"""Block-quantized weights in GGUF's exact layouts: Q8_0, Q4_0, Q4_1, Q5_0 (a scale per 32 weights) and the
K-quants Q4_K, Q6_K (super-blocks of 256 with a scale per 32 or per 16 weights).

A matrix (N, K) is N rows of K/E blocks (E = 32, or 256 for a K-quant), row-major, each block as ggml lays it out:
  Q8_0: fp16 d, 32 x int8 q                                  w = d * q                   (34 bytes)
  Q4_0: fp16 d, 16 bytes of nibbles                          w = d * (nib - 8)           (18 bytes)
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles                  w = d * nib + m             (20 bytes)
  Q5_0: fp16 d, 32 high bits (uint32), 16 bytes of nibbles   w = d * (nib | hi << 4 - 16) (22 bytes)
  Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32, 128 bytes of nibbles
        w = d * sc_j * nib - dmin * m_j                                                  (144 bytes)
  Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales (sub-blocks of 16), fp16 d
        w = d * sc_j * (q6 - 32)                                                         (210 bytes)
Nibbles of the 32-blocks: byte i holds element i in its low half and element i + 16 in its high half (Q5_0's bit i
of the high bits belongs to element i). Q4_K's 32 bytes per pair of sub-blocks hold sub-block 2j in the low halves
and 2j + 1 in the high halves; Q6_K's layout is ggml's dequantize_row_q6_K (spelled out in `_q6_k`).

`quantize` reproduces ggml's reference quantizers (quantize_row_*_ref) in float32 for the 32-blocks, so an HF folder
quantized here holds the bytes llama.cpp's converter writes; the K-quants have no quantizer here (they run as a
GGUF stores them). `dequantize` equals `gguf.quants.dequantize` of the same bytes.
A GGUF's tensors arrive as StoredTensor (the raw blocks) and run as stored: never dequantized and re-quantized.
Leaf module: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

BLOCK = 32  # weights per block of the legacy formats, and per activation block of every kernel
SUPER = 256  # weights per K-quant super-block


class BlockType(Enum):
    """A block format: its GGUF name (gguf.GGMLQuantizationType), ggml type id, bytes per block and weights per
    block (32, or 256 for a K-quant's super-block)."""

    Q4_0 = ("Q4_0", 2, 18, BLOCK)
    Q4_1 = ("Q4_1", 3, 20, BLOCK)
    Q5_0 = ("Q5_0", 6, 22, BLOCK)
    Q8_0 = ("Q8_0", 8, 34, BLOCK)
    Q4_K = ("Q4_K", 12, 144, SUPER)
    Q6_K = ("Q6_K", 14, 210, SUPER)

    def __init__(self, gguf_name: str, ggml_id: int, block_bytes: int, elements: int) -> None:
        self.gguf_name = gguf_name
        self.ggml_id = ggml_id
        self.block_bytes = block_bytes
        self.elements = elements

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.elements

    @property
    def quantizable(self) -> bool:
        """Whether `quantize` writes this format (an HF folder can be held in it), not only a GGUF's bytes."""
        return self.elements == BLOCK

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


# Byte ranges of each block's float fields (d, and Q4_1's m or Q4_K's dmin); the other formats' d is bytes 0..2.
_FLOAT_FIELDS = {"Q4_1": (0, 4), "Q4_K": (0, 4), "Q6_K": (208, 210)}


def row_bytes(qtype: BlockType, k: int) -> int:
    return (k // qtype.elements) * qtype.block_bytes


def check_stored(t: StoredTensor, name: str = "weight") -> BlockType:
    """The tensor's block format after checking its bytes fit its shape; ValueError in one sentence otherwise."""
    qtype = BlockType.named(t.qtype)
    n, k = t.shape
    if k % qtype.elements or n <= 0 or k <= 0:
        raise ValueError(
            f"{name} has shape {t.shape}, which {t.qtype} cannot hold (the input size must be a multiple of {qtype.elements})"
        )
    if t.data.dtype != np.uint8 or t.data.size != n * row_bytes(qtype, k):
        raise ValueError(
            f"{name} holds {t.data.size} bytes, not the {n * row_bytes(qtype, k)} a {t.qtype} matrix of shape {t.shape} needs"
        )
    return qtype


def scales_finite(t: StoredTensor) -> bool:
    """Whether every block's scale (and Q4_1's minimum, Q4_K's dmin) is finite: a block's only float fields (the
    K-quants' sub-block scales are integers), so the matrix holds NaN or infinity exactly when one of them does.
    `t` has passed check_stored."""
    qtype = BlockType.named(t.qtype)
    b = np.asarray(t.data, dtype=np.uint8).reshape(-1, qtype.block_bytes)  # (blocks, bytes)
    lo, hi = _FLOAT_FIELDS.get(qtype.name, (0, 2))
    fields = np.ascontiguousarray(b[:, lo:hi]).view(np.float16)  # (blocks, 1 or 2)
    return bool(np.isfinite(fields).all())


def _f16_bytes(a: np.ndarray) -> np.ndarray:  # (n, 1) float32 -> (n, 2) uint8, round to nearest even
    return a.astype(np.float16).view(np.uint8).reshape(-1, 2)


def quantize(w: np.ndarray, qtype: BlockType) -> np.ndarray:
    """w (N, K) float -> raw blocks (N, K/32 * block_bytes) uint8, as ggml's reference quantizer writes them."""
    if not qtype.quantizable:
        raise ValueError(f"there is no {qtype.name} quantizer here; {qtype.name} runs only as a GGUF file stores it")
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
        elif qtype is BlockType.Q5_0:
            at = np.abs(x).argmax(axis=1)[:, None]
            d = np.take_along_axis(x, at, axis=1) / np.float32(-16)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            q = np.minimum(np.trunc(x * inv + np.float32(16.5)), 31).astype(np.uint8)  # (blocks, 32) in 0..31
            qh = ((q >> np.uint8(4)).astype(np.uint32) << np.arange(BLOCK, dtype=np.uint32)).sum(
                axis=1, dtype=np.uint32
            )
            qh_bytes = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
            out = np.concatenate([_f16_bytes(d), qh_bytes, _pack(q & np.uint8(0x0F))], axis=1)
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
    """Raw blocks of a (N, K) matrix (or any rows of one: data (n, K/E * block_bytes)) -> float32 (n, K)."""
    k = shape[1]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, qtype.block_bytes)  # (blocks, bytes)
    if qtype is BlockType.Q4_K:
        return _q4_k(b).reshape(-1, k)
    if qtype is BlockType.Q6_K:
        return _q6_k(b).reshape(-1, k)
    d = _f16(b[:, :2])  # (blocks, 1)
    if qtype is BlockType.Q8_0:
        w = b[:, 2:].copy().view(np.int8).astype(np.float32) * d
    elif qtype is BlockType.Q5_0:
        qh = b[:, 2:6].copy().view("<u4").astype(np.uint32)  # (blocks, 1): bit i is element i's fifth bit
        hi = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8) << np.uint8(4)  # (blocks, 32)
        q = (_nibbles(b[:, 6:]) | hi).astype(np.int8) - np.int8(16)
        w = d * q.astype(np.float32)
    else:
        nib = _nibbles(b[:, 4:] if qtype is BlockType.Q4_1 else b[:, 2:]).astype(np.float32)  # (blocks, 32)
        if qtype is BlockType.Q4_1:
            w = d * nib + _f16(b[:, 2:4])
        else:
            w = d * (nib - np.float32(8))
    out: np.ndarray = w.reshape(-1, k)
    return out


# Formats whose every block is a Q8_0 block with the same fp16 d and integer quants in -16..15 (Q5_0) or -8..7.
WIDENS_TO_Q8_0 = ("Q4_0", "Q5_0", "Q8_0")


def widen_to_q8_0(data: np.ndarray, qtype: BlockType) -> np.ndarray:
    """Blocks of a format in WIDENS_TO_Q8_0 (n, bytes) -> Q8_0 blocks (n, K/32 * 34) of the very same values: the
    fp16 d copied, each quant widened to int8. Lossless (dequantize gives equal floats, the kernels equal bits), so
    a matrix fused from rows of mixed formats (a Q4_K_M file's q, k as Q5_0 beside v as Q8_0) still runs as stored."""
    if qtype.name not in WIDENS_TO_Q8_0:
        raise ValueError(f"{qtype.name} blocks do not widen to Q8_0 without loss")
    n = data.shape[0]
    b = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, qtype.block_bytes)  # (blocks, bytes)
    if qtype is BlockType.Q8_0:
        return b.reshape(n, -1)
    if qtype is BlockType.Q5_0:
        qh = b[:, 2:6].copy().view("<u4").astype(np.uint32)  # (blocks, 1)
        hi = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8) << np.uint8(4)
        q = (_nibbles(b[:, 6:]) | hi).astype(np.int8) - np.int8(16)  # (blocks, 32)
    else:
        q = _nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return np.concatenate([b[:, :2], q.view(np.uint8)], axis=1).reshape(n, -1)


def _f16(b: np.ndarray) -> np.ndarray:  # (blocks, 2) uint8 -> (blocks, 1) float32
    return b.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # (blocks, 16) -> (blocks, 32): low halves, then high halves
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def k4_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes (blocks, 12) -> 6-bit scales and mins (blocks, 8) each, as ggml's get_scale_min_k4:
    sub-blocks 0..3 in the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7 in the nibbles of bytes 8..11
    with their top two bits in the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    s = scales.astype(np.uint8)
    lo, mid, top = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (top & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _q4_k(b: np.ndarray) -> np.ndarray:  # (blocks, 144) -> (blocks, 256)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])  # (blocks, 1)
    sc, mn = k4_scales(b[:, 4:16])  # (blocks, 8)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(0x0F)).reshape(-1, 8, 32).astype(np.float32)  # (blocks, 8 sub-blocks, 32)
    scale = (d * sc.astype(np.float32))[:, :, None]  # exact: an fp16 times a 6-bit integer
    low = (dmin * mn.astype(np.float32))[:, :, None]
    w: np.ndarray = (scale * q - low).reshape(-1, SUPER)
    return w


def k6_quants(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks (blocks, 210) -> the signed 6-bit quants (blocks, 256) int8 in -32..31. Element 128h + 32t + l
    (half h, quarter t) takes its low 4 bits from ql[64h + l + 32 (t & 1)] (the high nibble when t >= 2) and its
    top 2 bits from bits 2t of qh[32h + l]."""
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(-1, 2, 4, 32)  # (blocks, half, quarter, l)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = qh & np.uint8(0x03)  # (blocks, half, quarter, l)
    q: np.ndarray = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(-1, SUPER)
    return q


def _q6_k(b: np.ndarray) -> np.ndarray:  # (blocks, 210) -> (blocks, 256)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # (blocks, 16): one per 16 weights
    scale = (_f16(b[:, 208:210]) * sc)[:, :, None]  # exact: an fp16 times an int8
    return (scale * k6_quants(b).reshape(-1, 16, 16).astype(np.float32)).reshape(-1, SUPER)
