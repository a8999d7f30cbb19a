"""A loaded model's weights as MLX arrays: dense matrices in the compute dtype, or GGUF's Q8_0, Q4_0, Q4_1 and Q4_K
blocks repacked, bit for bit, as MLX's affine quantization (groups of 32: w = scale * q + bias).

Those formats are affine per block of 32, so the repacking is exact: Q8_0's w = d * q (q signed) is MLX's 8 bits
with scale d and bias -128 d over q + 128; Q4_0's w = d * (q - 8) is 4 bits, bias -8 d; Q4_1's is 4 bits as stored
(scale d, bias m); Q5_0 and Q5_1 are 5 bits likewise (bias -16 d, or m). Q4_K is affine too, per sub-block of 32:
scale d * sc, bias -dmin * m (exact in fp32; in fp16, on the GPU, d * sc rounds to 11 bits). The other block formats
(Q6_K's scales per 16 weights, Q2_K/Q3_K's too, Q5_K, IQ4's non-uniform levels, ternary) have no MLX form here: they
arrive dequantized to the compute dtype (the loader's fp32 decode). An HF folder's matrices are quantized by
our own GGUF quantizers (engine.model.quant, the bytes llama.cpp's converter writes) when asked, then repacked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import torch

from engine.model.quant import BLOCK, BlockType, StoredTensor, dequantize, k4_scales, quantize

# The block formats MLX runs as they are stored: its bits per weight.
MLX_BITS: dict[BlockType, int] = {
    BlockType.Q8_0: 8,
    BlockType.Q4_0: 4,
    BlockType.Q4_1: 4,
    BlockType.Q4_K: 4,
    BlockType.Q5_0: 5,
    BlockType.Q5_1: 5,
}


@dataclass(frozen=True)
class QuantWeight:
    """A matrix (out, in) in MLX's affine quantization: `packed` (out, in * bits / 32) uint32, `scales` and
    `biases` (out, in / group_size) in the compute dtype."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int = BLOCK

    @property
    def nbytes(self) -> int:
        return int(self.packed.nbytes + self.scales.nbytes + self.biases.nbytes)

    def rows(self, ids: mx.array) -> mx.array:
        """The dequantized rows `ids` (an embedding lookup through a quantized table): ids (...) -> (..., in)."""
        return mx.dequantize(
            self.packed[ids], self.scales[ids], self.biases[ids], group_size=self.group_size, bits=self.bits
        )


Weight = mx.array | QuantWeight


def _f16(b: np.ndarray) -> np.ndarray:
    """(blocks, 2) uint8 -> (blocks,) float32: a block's fp16 field."""
    return np.ascontiguousarray(b).view(np.float16)[:, 0].astype(np.float32)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """(rows, in) integers in [0, 2**bits) -> (rows, in * bits / 32) uint32 as MLX packs them: a little-endian bit
    stream, element i in bits [i * bits, (i + 1) * bits)."""
    v = values.astype(np.uint8)
    if bits == 8:
        return np.ascontiguousarray(v).view("<u4")
    if bits == 4:  # two elements a byte, the first low (the bit stream, without unpacking it)
        return np.ascontiguousarray(v[:, 0::2] | (v[:, 1::2] << 4)).view("<u4")
    stream = np.unpackbits(v[..., None], axis=-1, bitorder="little")[..., :bits]  # (rows, in, bits)
    packed = np.packbits(stream.reshape(v.shape[0], -1), axis=-1, bitorder="little")  # (rows, in * bits / 8)
    return np.ascontiguousarray(packed).view("<u4")


def repack(t: StoredTensor, dtype: mx.Dtype) -> QuantWeight:
    """A GGUF matrix in a format of MLX_BITS -> the same numbers as MLX's affine quantization (exact in fp32)."""
    qtype = BlockType.named(t.qtype)
    n, k = t.shape
    b = np.asarray(t.data, dtype=np.uint8).reshape(n * k // qtype.elements, qtype.block_bytes)  # (blocks, bytes)
    d = _f16(b[:, 0:2])  # (blocks,)
    if qtype is BlockType.Q4_K:  # 8 sub-blocks of 32, each its own scale d * sc and bias -dmin * m
        sc, mn = k4_scales(b[:, 4:16])  # (blocks, 8) each
        scales = d[:, None] * sc.astype(np.float32)  # exact in fp32: an fp16 times a 6-bit integer
        low = -_f16(b[:, 2:4])[:, None] * mn.astype(np.float32)
        pairs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = pairs & 0x0F  # (blocks, 4, 2, 32): sub-block 2j in the low halves of pair j, 2j + 1 in the high
        return QuantWeight(
            packed=mx.array(_pack(q.reshape(n, k), 4)),
            scales=mx.array(scales.reshape(n, k // BLOCK)).astype(dtype),
            biases=mx.array(low.reshape(n, k // BLOCK)).astype(dtype),
            bits=4,
        )
    if qtype is BlockType.Q8_0:
        q = b[:, 2:].view(np.int8).astype(np.int16) + 128  # (blocks, 32) in [0, 256)
        bias = -128.0 * d
    elif qtype in (BlockType.Q5_0, BlockType.Q5_1):  # nibbles as Q4's, bit i of qh element i's fifth bit
        at = 4 if qtype is BlockType.Q5_1 else 2
        qh = np.ascontiguousarray(b[:, at : at + 4]).view("<u4")  # (blocks, 1)
        hi = ((qh >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # (blocks, 32)
        nib = b[:, at + 4 :]
        q = np.concatenate((nib & 0x0F, nib >> 4), axis=1) | hi
        bias = _f16(b[:, 2:4]) if qtype is BlockType.Q5_1 else -16.0 * d
    else:
        nib = b[:, 4:] if qtype is BlockType.Q4_1 else b[:, 2:]  # (blocks, 16)
        q = np.concatenate((nib & 0x0F, nib >> 4), axis=1)  # (blocks, 32): byte i holds elements i and i + 16
        bias = _f16(b[:, 2:4]) if qtype is BlockType.Q4_1 else -8.0 * d
    bits = MLX_BITS[qtype]
    return QuantWeight(
        packed=mx.array(_pack(q.reshape(n, k), bits)),
        scales=mx.array(d.reshape(n, k // BLOCK)).astype(dtype),
        biases=mx.array(bias.reshape(n, k // BLOCK)).astype(dtype),
        bits=bits,
    )


def dense(t: torch.Tensor, dtype: mx.Dtype) -> mx.array:
    """A torch tensor (fp32 or fp16 on the CPU) as an MLX array in `dtype`."""
    return mx.array(t.detach().to("cpu").numpy()).astype(dtype)


def linear_names(num_layers: int) -> list[str]:
    """The parameter names of every matrix a forward multiplies by (the LM head's included)."""
    names = ["lm_head.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
    return names


def convert(
    params: Mapping[str, torch.Tensor],
    stored: Mapping[str, StoredTensor],
    num_layers: int,
    dtype: mx.Dtype,
    blocks: BlockType | None,
) -> tuple[dict[str, Weight], str, str]:
    """The model's parameters (HF names; meta where `stored` holds the blocks) -> MLX weights, the block format
    most matrices run in ("none" where all are dense) and the note saying what runs how.

    `blocks` None: every matrix dense in `dtype` (stored blocks dequantized). Else the stored blocks MLX can run stay
    quantized (the file's own format), and an HF folder's matrices (nothing stored) are quantized to `blocks`."""
    out: dict[str, Weight] = {}
    matrices = set(linear_names(num_layers))
    kept: dict[str, int] = {}
    decoded: dict[str, int] = {}
    for name, p in params.items():
        s = stored.get(name)
        if blocks is not None and s is not None and s.qtype in BlockType.__members__ and BlockType[s.qtype] in MLX_BITS:
            out[name] = repack(s, dtype)
            kept[s.qtype] = kept.get(s.qtype, 0) + 1
            continue
        if p.is_meta:  # left undecoded by the loader, in a format MLX does not run as stored
            assert s is not None  # the loader leaves only stored blocks on the meta device
            p = torch.from_numpy(dequantize(np.asarray(s.data), BlockType.named(s.qtype), s.shape))
        if s is not None:
            decoded[s.qtype] = decoded.get(s.qtype, 0) + 1
        if blocks is not None and not stored and name in matrices and p.shape[1] % BLOCK == 0:
            raw = quantize(p.detach().float().numpy(), blocks)
            out[name] = repack(StoredTensor(blocks.name, (int(p.shape[0]), int(p.shape[1])), raw), dtype)
            kept[blocks.name] = kept.get(blocks.name, 0) + 1
            continue
        out[name] = dense(p, dtype)
    held = max(kept, key=lambda q: kept[q]).lower() if kept else "none"
    return out, held, _note(kept, decoded, dtype)


def _note(kept: Mapping[str, int], decoded: Mapping[str, int], dtype: mx.Dtype) -> str:
    dt = str(dtype).removeprefix("mlx.core.")
    parts = [f"{n} {q} matrices as MLX {MLX_BITS[BlockType.named(q)]}-bit affine groups of 32" for q, n in kept.items()]
    parts += [f"{n} {q} matrices dequantized to {dt} (no exact MLX form)" for q, n in decoded.items()]
    return "MLX: " + ("; ".join(parts) if parts else f"{dt} weights")


def weight_bytes(weights: Mapping[str, Any]) -> int:
    """Bytes the weights hold (a tied head counted once)."""
    seen: set[int] = set()
    total = 0
    for w in weights.values():
        if id(w) not in seen:
            seen.add(id(w))
            total += w.nbytes if isinstance(w, QuantWeight) else int(w.nbytes)
    return total
