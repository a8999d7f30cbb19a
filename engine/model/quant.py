"""Block-quantized weights in GGUF's exact layouts: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (a scale per 32 weights),
the K-quants Q2_K..Q6_K and IQ4_XS (super-blocks of 256 with a scale per 32 or per 16 weights) and the ternary
TQ1_0, TQ2_0 (BitNet b1.58's weights: one scale per 256).

A matrix (N, K) is N rows of K/E blocks (E = 32, or 256 for a K-quant), row-major, each block as ggml lays it out:
  Q8_0: fp16 d, 32 x int8 q                                  w = d * q                   (34 bytes)
  Q4_0: fp16 d, 16 bytes of nibbles                          w = d * (nib - 8)           (18 bytes)
  Q4_1: fp16 d, fp16 m, 16 bytes of nibbles                  w = d * nib + m             (20 bytes)
  Q5_0: fp16 d, 32 high bits (uint32), 16 bytes of nibbles   w = d * (nib | hi << 4 - 16) (22 bytes)
  Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32, 128 bytes of nibbles
        w = d * sc_j * nib - dmin * m_j                                                  (144 bytes)
  Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales (sub-blocks of 16), fp16 d
        w = d * sc_j * (q6 - 32)                                                         (210 bytes)
  Q5_1: fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles   w = d * (nib | hi << 4) + m   (24 bytes)
  Q5_K: Q4_K's d, dmin and scales, 32 bytes of high bits (bit j of byte e: sub-block j's weight e), 128 bytes of
        nibbles as Q4_K's                        w = d * sc_j * q5 - dmin * m_j          (176 bytes)
  Q3_K: 32 bytes of high bits (as Q5_K's, set: no offset), 64 bytes of 2-bit pairs (weight 128h + 32s + l at bits
        2s of byte 32h + l), 12 bytes of 6-bit scales (sub-blocks of 16), fp16 d
        w = d * (sc_j - 32) * (q2 - (hi ? 0 : 4))                                         (110 bytes)
  Q2_K: 16 bytes of a 4-bit scale and min per 16 weights, 64 bytes of 2-bit pairs as Q3_K's, fp16 d, fp16 dmin
        w = d * sc_j * q2 - dmin * m_j                                                  (84 bytes)
  IQ4_NL: fp16 d, 16 bytes of nibbles as Q4_0's             w = d * LEVELS[nib]         (18 bytes)
  IQ4_XS: fp16 d, 16 high bits and 4 bytes of low nibbles of 8 6-bit scales, 128 bytes of nibbles (16 per
        sub-block, as IQ4_NL's)                 w = d * (ls_j - 32) * LEVELS[nib]       (136 bytes)
  TQ2_0: 64 bytes of 2-bit pairs as Q3_K's, fp16 d           w = d * (q2 - 1)            (66 bytes)
  TQ1_0: 48 + 4 bytes of base-3 fractions (5 or 4 trits each), fp16 d   w = d * (trit - 1) (54 bytes)
Nibbles of the 32-blocks: byte i holds element i in its low half and element i + 16 in its high half (Q5_0's bit i
of the high bits belongs to element i). Q4_K's 32 bytes per pair of sub-blocks hold sub-block 2j in the low halves
and 2j + 1 in the high halves; Q6_K's layout is ggml's dequantize_row_q6_K (spelled out in `_q6_k`).

`quantize` reproduces ggml's reference quantizers (quantize_row_*_ref) in float32 for Q8_0, Q4_0, Q4_1 and Q5_0, so
an HF folder quantized here holds the bytes llama.cpp's converter writes; the other formats have no quantizer here
(they run as a GGUF stores them). `dequantize` equals `gguf.quants.dequantize` of the same bytes.
A GGUF's tensors arrive as StoredTensor (the raw blocks) and run as stored: never dequantized and re-quantized.
Leaf module: numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

BLOCK = 32  # weights per block of the legacy formats, and per activation block of every kernel
SUPER = 256  # weights per K-quant super-block
RELEASE_CHUNK_BYTES = 8 << 20  # StoredTensor.row_chunks


class BlockType(Enum):
    """A block format: its GGUF name (gguf.GGMLQuantizationType), ggml type id, bytes per block and weights per
    block (32, or 256 for a K-quant's super-block)."""

    Q4_0 = ("Q4_0", 2, 18, BLOCK)
    Q4_1 = ("Q4_1", 3, 20, BLOCK)
    Q5_0 = ("Q5_0", 6, 22, BLOCK)
    Q8_0 = ("Q8_0", 8, 34, BLOCK)
    Q4_K = ("Q4_K", 12, 144, SUPER)
    Q6_K = ("Q6_K", 14, 210, SUPER)
    Q5_1 = ("Q5_1", 7, 24, BLOCK)
    Q2_K = ("Q2_K", 10, 84, SUPER)
    Q3_K = ("Q3_K", 11, 110, SUPER)
    Q5_K = ("Q5_K", 13, 176, SUPER)
    IQ4_NL = ("IQ4_NL", 20, 18, BLOCK)
    IQ4_XS = ("IQ4_XS", 23, 136, SUPER)
    TQ1_0 = ("TQ1_0", 34, 54, SUPER)
    TQ2_0 = ("TQ2_0", 35, 66, SUPER)

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
        return self.name in ("Q4_0", "Q4_1", "Q5_0", "Q8_0")

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
    # Gives back the file pages of `data`'s bytes [lo, hi) (GGUFModel.release_pages); None where `data` is no view
    # of a file.
    releaser: Callable[[int, int], None] | None = field(default=None, compare=False, repr=False)

    def release(self, rows: tuple[int, int] | None = None) -> None:
        """Give back the file pages `data` views (those of rows [a, b) with `rows`), once whoever needed them has
        its own copy (nothing where `data` is no view of a file); a later read of `data` faults them back in."""
        if self.releaser is not None:
            a, b = rows or (0, self.shape[0])
            self.releaser(a * self.row_bytes, b * self.row_bytes)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of `data`."""
        return self.data.nbytes // self.shape[0]

    def row_chunks(self) -> Iterator[tuple[int, int]]:
        """Row ranges [a, b) of about RELEASE_CHUNK_BYTES each: what a reader copying or checking a large matrix
        releases as it goes, so that the file's pages and its copy are not both resident whole (a 262k-token
        embedding is 170 MB)."""
        step = max(1, RELEASE_CHUNK_BYTES // max(1, self.row_bytes))
        for a in range(0, self.shape[0], step):
            yield a, min(self.shape[0], a + step)


# Byte ranges of each block's float fields (d, and Q4_1's m or a K-quant's dmin); the other formats' d is bytes 0..2.
_FLOAT_FIELDS = {
    "Q4_1": (0, 4),
    "Q5_1": (0, 4),
    "Q4_K": (0, 4),
    "Q5_K": (0, 4),
    "Q6_K": (208, 210),
    "Q2_K": (80, 84),
    "Q3_K": (108, 110),
    "TQ1_0": (52, 54),
    "TQ2_0": (64, 66),
}


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


def scales_finite(t: StoredTensor, rows: tuple[int, int] | None = None) -> bool:
    """Whether every block's scale (and Q4_1's minimum, Q4_K's dmin) is finite, of rows [a, b) with `rows`: a
    block's only float fields (the K-quants' sub-block scales are integers), so the matrix holds NaN or infinity
    exactly when one of them does. `t` has passed check_stored."""
    qtype = BlockType.named(t.qtype)
    a, z = rows or (0, t.shape[0])
    data = np.asarray(t.data, dtype=np.uint8).reshape(-1)[a * t.row_bytes : z * t.row_bytes]
    b = data.reshape(-1, qtype.block_bytes)  # (blocks, bytes)
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
    if qtype.name in _SUPER_DEQUANT:
        return _SUPER_DEQUANT[qtype.name](b).reshape(-1, k)
    d = _f16(b[:, :2])  # (blocks, 1)
    if qtype is BlockType.Q8_0:
        w = b[:, 2:].copy().view(np.int8).astype(np.float32) * d
    elif qtype is BlockType.Q5_0:
        qh = b[:, 2:6].copy().view("<u4").astype(np.uint32)  # (blocks, 1): bit i is element i's fifth bit
        hi = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8) << np.uint8(4)  # (blocks, 32)
        q = (_nibbles(b[:, 6:]) | hi).astype(np.int8) - np.int8(16)
        w = d * q.astype(np.float32)
    elif qtype is BlockType.Q5_1:
        qh = b[:, 4:8].copy().view("<u4").astype(np.uint32)  # (blocks, 1)
        hi = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8) << np.uint8(4)
        w = d * (_nibbles(b[:, 8:]) | hi).astype(np.float32) + _f16(b[:, 2:4])
    elif qtype is BlockType.IQ4_NL:
        w = d * LEVELS[_nibbles(b[:, 2:])].astype(np.float32)
    else:
        nib = _nibbles(b[:, 4:] if qtype is BlockType.Q4_1 else b[:, 2:]).astype(np.float32)  # (blocks, 32)
        if qtype is BlockType.Q4_1:
            w = d * nib + _f16(b[:, 2:4])
        else:
            w = d * (nib - np.float32(8))
    out: np.ndarray = w.reshape(-1, k)
    return out


# Formats whose every block is a Q8_0 block with the same fp16 d and integer quants in -16..15 (Q5_0), -8..7 (Q4_0)
# or IQ4_NL's levels.
WIDENS_TO_Q8_0 = ("Q4_0", "Q5_0", "Q8_0", "IQ4_NL")


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
    elif qtype is BlockType.IQ4_NL:
        q = LEVELS[_nibbles(b[:, 2:])]
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


# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl).
LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _pairs(qs: np.ndarray) -> np.ndarray:
    """2-bit fields (blocks, 64) -> (blocks, 256) in 0..3: weight 128h + 32s + l at bits 2s of byte 32h + l."""
    shifted = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    out: np.ndarray = (shifted & np.uint8(3)).reshape(-1, SUPER)
    return out


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """32 bytes of high bits (blocks, 32) -> (blocks, 256) in 0..1: weight 32j + e is bit j of byte e."""
    out: np.ndarray = ((qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(-1, SUPER)
    return out


def k3_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes (blocks, 12) -> 16 signed scales (blocks, 16) in -32..31: scale i's low 4 bits are
    nibble i // 8 of byte i % 8, its top 2 bits are bits 2 (i // 4) of byte 8 + i % 4."""
    i = np.arange(16)
    low = (scales[:, i % 8] >> (4 * (i // 8)).astype(np.uint8)) & np.uint8(0x0F)
    high = (scales[:, 8 + i % 4] >> (2 * (i // 4)).astype(np.uint8)) & np.uint8(3)
    out: np.ndarray = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return out


def _q2_k(b: np.ndarray) -> np.ndarray:  # (blocks, 84) -> (blocks, 256)
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])  # (blocks, 1)
    scale = (d * (b[:, :16] & np.uint8(0x0F)).astype(np.float32))[:, :, None]  # (blocks, 16, 1)
    low = (dmin * (b[:, :16] >> np.uint8(4)).astype(np.float32))[:, :, None]
    q = _pairs(b[:, 16:80]).reshape(-1, 16, 16).astype(np.float32)
    w: np.ndarray = (scale * q - low).reshape(-1, SUPER)
    return w


def _q3_k(b: np.ndarray) -> np.ndarray:  # (blocks, 110) -> (blocks, 256)
    scale = (_f16(b[:, 108:110]) * k3_scales(b[:, 96:108]).astype(np.float32))[:, :, None]  # (blocks, 16, 1)
    q = _pairs(b[:, 32:96]).astype(np.int8) - ((_high_bits(b[:, :32]) ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    w: np.ndarray = (scale * q.reshape(-1, 16, 16).astype(np.float32)).reshape(-1, SUPER)
    return w


def _q5_k(b: np.ndarray) -> np.ndarray:  # (blocks, 176) -> (blocks, 256)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = k4_scales(b[:, 4:16])  # (blocks, 8)
    ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = ((ql & np.uint8(0x0F)).reshape(-1, SUPER) | (_high_bits(b[:, 16:48]) << np.uint8(4))).astype(np.float32)
    scale = (d * sc.astype(np.float32))[:, :, None]
    low = (dmin * mn.astype(np.float32))[:, :, None]
    w: np.ndarray = (scale * q.reshape(-1, 8, 32) - low).reshape(-1, SUPER)
    return w


def _iq4_xs(b: np.ndarray) -> np.ndarray:  # (blocks, 136) -> (blocks, 256)
    high = (b[:, 2:4].copy().view("<u2").astype(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))) & np.uint16(3)
    low = (b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(-1, 8) & 15
    ls = (low | (high.astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(32)  # (blocks, 8)
    scale = (_f16(b[:, 0:2]) * ls.astype(np.float32))[:, :, None]
    q = LEVELS[_nibbles(b[:, 8:].reshape(-1, 16))].reshape(-1, 8, 32).astype(np.float32)
    w: np.ndarray = (scale * q).reshape(-1, SUPER)
    return w


def _tq2_0(b: np.ndarray) -> np.ndarray:  # (blocks, 66) -> (blocks, 256)
    w: np.ndarray = _f16(b[:, 64:66]) * (_pairs(b[:, :64]).astype(np.int8) - np.int8(1)).astype(np.float32)
    return w


def tq1_trits(b: np.ndarray) -> np.ndarray:
    """TQ1_0 blocks (blocks, 54) -> trits (blocks, 256) in -1..1. A byte holds a base-3 fraction: its trit n is
    the top of (byte * 3^n mod 256) * 3 / 256. Weights 0..159: trit n of qs[l] is weight 32n + l; 160..239: of
    qs[32 + l], 160 + 16n + l; 240..255: of qh[l] (bytes 48..51), 240 + 4n + l."""
    pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
    parts = [
        b[:, None, 0:32] * pow3[:, None],  # (blocks, 5, 32), uint8 products wrap as ggml's
        b[:, None, 32:48] * pow3[:, None],
        b[:, None, 48:52] * pow3[:4, None],
    ]
    fractions = np.concatenate([p.reshape(len(b), -1) for p in parts], axis=1)  # (blocks, 256)
    out: np.ndarray = ((fractions.astype(np.uint16) * 3) >> 8).astype(np.int8) - np.int8(1)
    return out


def _tq1_0(b: np.ndarray) -> np.ndarray:  # (blocks, 54) -> (blocks, 256)
    w: np.ndarray = _f16(b[:, 52:54]) * tq1_trits(b).astype(np.float32)
    return w


_SUPER_DEQUANT = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q5_K": _q5_k, "IQ4_XS": _iq4_xs, "TQ1_0": _tq1_0, "TQ2_0": _tq2_0}
