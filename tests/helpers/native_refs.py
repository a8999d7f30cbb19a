"""References the native kernels are checked against: the integer block products each format must give (the legacy
formats' and the K-quants'), the activation quantizer they share, and small native linears to check them on."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch

from engine.backends.blocks import BlockWeights
from engine.backends.native import NativeKernels
from engine.backends.native.decoder import NativeBlockLinear
from engine.model.quant import LEVELS, BlockType, k3_scales, k4_scales, k6_quants, quantize, tq1_trits
from tests.helpers.quant_blocks import random_blocks

X86 = platform.machine().lower() in ("x86_64", "amd64")


def has_cpu_flags(*names: str) -> bool:
    """Whether /proc/cpuinfo (Linux) lists every one of these CPU feature flags."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(f in flags for f in names)


LEGACY = [
    BlockType.Q8_0,
    BlockType.Q4_0,
    BlockType.Q4_1,
]  # spark_kernels.c's own formats (the rest: test_native_kquants)
F32 = np.float32


def quantize_activation(x: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """x (nb, 32) float32 -> (q (nb, 32) int64, d (nb,) float32), as the kernels' quantize_row: one scale per
    block, int8 for parts = 1 (llama.cpp's Q8), int16 for parts = 2."""
    qmax = F32(32767 if parts == 2 else 127)
    amax = np.abs(x).max(axis=1)  # (nb,)
    with np.errstate(divide="ignore"):
        inv = np.where(amax == 0, F32(0), qmax / amax).astype(F32)
    q = np.rint(x * inv[:, None]).astype(np.int64)
    return q, (amax / qmax).astype(F32)


def legacy_reference(w: BlockWeights, bias: np.ndarray | None, x: np.ndarray, parts: int) -> np.ndarray:
    """What the kernel must compute for one activation row x (K,): exact integer block sums, then the float terms
    in spark_kernels.c's fixed order (block b into partial sum b % 8, then a fixed tree)."""
    n, k = w.shape
    nb = k // 32
    raw = w.blocks.numpy().reshape(n, nb, w.qtype.block_bytes)
    dw = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(F32)  # (N, nb)
    if w.qtype is BlockType.Q8_0:
        wq = raw[:, :, 2:].view(np.int8).astype(np.int64)  # (N, nb, 32)
    else:
        qs = raw[:, :, 4:] if w.qtype is BlockType.Q4_1 else raw[:, :, 2:]
        wq = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64)  # unsigned nibbles
    q, d = quantize_activation(x.reshape(nb, 32).astype(F32), parts)
    isum = (wq * q[None]).sum(axis=2)  # (N, nb) exact
    assert np.abs(isum).max(initial=0) < 2**31  # what the kernel's int32 lanes hold
    if w.qtype is BlockType.Q4_0:
        isum = isum - 8 * q.sum(axis=1)[None]
    term = ((dw * d[None]).astype(F32) * isum.astype(F32)).astype(F32)
    if w.qtype is BlockType.Q4_1:
        mw = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(F32)
        ds = (d * q.sum(axis=1).astype(F32)).astype(F32)  # Q4_1's min term
        term = (term + mw * ds[None]).astype(F32)
    acc = np.zeros((n, 8), F32)
    for b in range(nb):
        acc[:, b % 8] = (acc[:, b % 8] + term[:, b]).astype(F32)
    y = ((acc[:, 0] + acc[:, 4]) + (acc[:, 1] + acc[:, 5])) + ((acc[:, 2] + acc[:, 6]) + (acc[:, 3] + acc[:, 7]))
    return y if bias is None else (y + bias).astype(F32)


def block_linear(
    kernels: NativeKernels, qtype: BlockType, n: int, k: int, parts: int, seed: int = 0
) -> NativeBlockLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # (N, K), rows of differing scale
    bw = BlockWeights(qtype, (n, k), torch.from_numpy(quantize(w.numpy(), qtype)))
    return NativeBlockLinear(kernels, bw, torch.randn(n, generator=g), parts)


def lin_weights(lin: NativeBlockLinear) -> BlockWeights:
    return BlockWeights(lin.qtype, (lin.out_features, lin.padded), lin.blocks, lin.in_features)


TYPES = [t for t in BlockType if t.name not in ("Q8_0", "Q4_0", "Q4_1")]
HALF_SCALED = (BlockType.Q6_K, BlockType.Q3_K, BlockType.Q2_K)  # a scale per 16 weights
WITH_MIN = (BlockType.Q4_K, BlockType.Q5_K, BlockType.Q5_1)  # w = scale * q + mw, mw per block of 32


def _f16(b: np.ndarray) -> np.ndarray:  # (..., 2) uint8 -> (...) float32
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(F32)


def _pairs(qs: np.ndarray) -> np.ndarray:  # (blocks, 64) 2-bit fields -> (blocks, 8, 32): weight 128h + 32s + l
    return ((qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(
        -1, 8, 32
    )


def _bits(qh: np.ndarray) -> np.ndarray:  # (blocks, 32) -> (blocks, 8, 32): bit j of byte e
    return (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1


def block_factors(qtype: BlockType, raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """raw (N, row bytes) -> per block of 32: signed quants (N, nb, 32) int64, dw, mw (N, nb) float32, the halves'
    scales s0, s1 and (Q2_K) mins m0, m1 (N, nb) int64, as the kernels' kq_unpack."""
    n = raw.shape[0]
    b = raw.reshape(-1, qtype.block_bytes)
    per = qtype.elements // 32  # blocks of 32 per block of the format
    zero = np.zeros((len(b), per), np.int64)
    s0, s1, m0, m1 = zero, zero, zero, zero
    mw = np.zeros((len(b), per), F32)
    if qtype in (BlockType.Q5_0, BlockType.Q5_1):
        off = 2 if qtype is BlockType.Q5_0 else 4
        qh = b[:, off : off + 4].copy().view("<u4").astype(np.uint32)
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        q = np.concatenate([b[:, off + 4 :] & 0x0F, b[:, off + 4 :] >> 4], axis=1).astype(np.int64) | hi
        q = q - 16 if qtype is BlockType.Q5_0 else q
        dw = _f16(b[:, 0:2])[:, None]
        if qtype is BlockType.Q5_1:
            mw = _f16(b[:, 2:4])[:, None]
    elif qtype is BlockType.IQ4_NL:
        q = LEVELS[np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1)].astype(np.int64)
        dw = _f16(b[:, 0:2])[:, None]
    elif qtype in (BlockType.Q4_K, BlockType.Q5_K):
        sc, mn = k4_scales(b[:, 4:16])  # (blocks, 8)
        at = 16 if qtype is BlockType.Q4_K else 48
        qs = b[:, at:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 8, 32).astype(np.int64)
        if qtype is BlockType.Q5_K:
            q = q | (_bits(b[:, 16:48]).astype(np.int64) << 4)
        dw = (_f16(b[:, 0:2])[:, None] * sc.astype(F32)).astype(F32)
        mw = -(_f16(b[:, 2:4])[:, None] * mn.astype(F32)).astype(F32)
    elif qtype is BlockType.Q6_K:
        q = k6_quants(b).astype(np.int64).reshape(-1, 8, 32)
        sc = b[:, 192:208].copy().view(np.int8).astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 208:210])[:, None], 8, axis=1)
        s0, s1 = sc[..., 0], sc[..., 1]
    elif qtype is BlockType.Q3_K:
        q = _pairs(b[:, 32:96]).astype(np.int64) - 4 * (1 - _bits(b[:, :32]).astype(np.int64))
        sc = k3_scales(b[:, 96:108]).astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 108:110])[:, None], 8, axis=1)
        s0, s1 = sc[..., 0], sc[..., 1]
    elif qtype is BlockType.Q2_K:
        q = _pairs(b[:, 16:80]).astype(np.int64)
        sc = b[:, :16].astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 80:82])[:, None], 8, axis=1)
        mw = np.repeat(-_f16(b[:, 82:84])[:, None], 8, axis=1)
        s0, s1, m0, m1 = sc[..., 0] & 15, sc[..., 1] & 15, sc[..., 0] >> 4, sc[..., 1] >> 4
    elif qtype is BlockType.IQ4_XS:
        high = (b[:, 2:4].copy().view("<u2").astype(np.int64) >> (2 * np.arange(8))) & 3
        low = (b[:, 4:8].astype(np.int64)[:, :, None] >> np.array([0, 4])).reshape(-1, 8) & 15
        dw = (_f16(b[:, 0:2])[:, None] * ((low | high << 4) - 32).astype(F32)).astype(F32)
        qs = b[:, 8:].reshape(-1, 8, 16)
        q = LEVELS[np.concatenate([qs & 0x0F, qs >> 4], axis=2)].astype(np.int64)
    elif qtype is BlockType.TQ2_0:
        q = _pairs(b[:, :64]).astype(np.int64) - 1
        dw = np.repeat(_f16(b[:, 64:66])[:, None], 8, axis=1)
    else:  # TQ1_0
        q = tq1_trits(b).astype(np.int64).reshape(-1, 8, 32)
        dw = np.repeat(_f16(b[:, 52:54])[:, None], 8, axis=1)
    factors = (dw.astype(F32), mw.astype(F32), s0, s1, m0, m1)
    return (q.reshape(n, -1, 32), *(np.broadcast_to(f, (len(b), per)).reshape(n, -1) for f in factors))


def kquant_reference(qtype: BlockType, raw: np.ndarray, bias: np.ndarray, x: np.ndarray, parts: int) -> np.ndarray:
    """One activation row x (K,) through raw (N, row bytes): exact integer half-block sums, then the float terms of
    the kernels in their fixed order (block b into partial sum b % 8, then a fixed tree)."""
    q, dw, mw, s0, s1, m0, m1 = block_factors(qtype, raw)
    n, nb = dw.shape
    xq, d = quantize_activation(x.reshape(nb, 32).astype(F32), parts)
    h0 = (q[:, :, :16] * xq[None, :, :16]).sum(axis=2)  # (N, nb) exact
    h1 = (q[:, :, 16:] * xq[None, :, 16:]).sum(axis=2)
    assert max(np.abs(h0).max(), np.abs(h1).max()) < 2**31  # what the kernel's int32 lanes hold
    scale = (dw * d[None]).astype(F32)
    if qtype is BlockType.Q2_K:  # one int32 sum of the halves' products, and the mins against the halves' sums
        x0, x1 = xq[:, :16].sum(axis=1), xq[:, 16:].sum(axis=1)  # (nb,)
        term = (scale * (s0 * h0 + s1 * h1).astype(F32)).astype(F32)
        term = (term + (mw * d[None]).astype(F32) * (m0 * x0[None] + m1 * x1[None]).astype(F32)).astype(F32)
    elif qtype in HALF_SCALED:
        halves = ((s0 * h0).astype(F32) + (s1 * h1).astype(F32)).astype(F32)  # each product an exact int32
        term = (scale * halves).astype(F32)
    else:
        term = (scale * (h0 + h1).astype(F32)).astype(F32)
    if qtype in WITH_MIN:
        ds = (d * xq.sum(axis=1).astype(F32)).astype(F32)
        term = (term + mw * ds[None]).astype(F32)
    acc = np.zeros((n, 8), F32)
    for b in range(nb):
        acc[:, b % 8] = (acc[:, b % 8] + term[:, b]).astype(F32)
    y = ((acc[:, 0] + acc[:, 4]) + (acc[:, 1] + acc[:, 5])) + ((acc[:, 2] + acc[:, 6]) + (acc[:, 3] + acc[:, 7]))
    out: np.ndarray = (y + bias).astype(F32)
    return out


def kquant_linear(kernels: NativeKernels, qtype: BlockType, n: int, k: int, parts: int) -> NativeBlockLinear:
    raw = random_blocks(qtype, n, k, seed=k + qtype.ggml_id)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    return NativeBlockLinear(kernels, BlockWeights(qtype, (n, k), torch.from_numpy(raw)), bias, parts)


def bias_of(lin: NativeBlockLinear) -> np.ndarray:
    assert lin.bias is not None
    return lin.bias.numpy()


def activations(k: int) -> torch.Tensor:
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))  # (6, K)
    x[3] = 0  # an all-zero row quantizes to zeros with scale 0: just the bias
    x[4, :32] *= 1e4  # an outlier block
    return x
