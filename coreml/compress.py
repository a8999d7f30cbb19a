"""Weight compression chosen for the compute units, and what each choice costs in bytes.

- `int8`: linear symmetric, one scale per output channel: runs on the ANE (per-channel / per-tensor
  quantization is what the ANE executes; coremltools #2510).
- `lut4` / `lut6`: palettization with one 16- or 64-entry palette per LUT_GROUP output channels (iOS 18
  grouped-channel LUTs, what Anemll ships for the ANE).
- `int4`: linear symmetric per block of 32 input channels: a GPU format (coremltools' quantization guide); on
  the ANE those convs fall back to the CPU, so it is refused unless the compute units include the GPU.
- `none`: fp16.

`auto` is DEFAULT_QUANTIZE (the names and `resolve` are engine.backends.coreml.programs': the runtime keys its cache by them), the most faithful Neural Engine choice as measured against fp32 (coreml/README.md,
"Compression"): fp16. int8 per channel is the most faithful compressed choice, but coremltools emits it as
constexpr_blockwise_shift_scale, which a CPU_AND_NE bundle is meant to be free of until a Mac's compute plan shows
the ANE runs it; the grouped-channel LUTs measured far less faithful on SmolLM2-135M. The palette is a deterministic numpy k-means: every function of a package compresses the same
weights, and only identical results are stored once (coremltools' own kmeans mode also needs scikit-learn).
`simulate` applies the same arithmetic in numpy, so faithfulness is measured on exactly what ships.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Weights smaller than this stay fp16: compressing them saves nothing and costs accuracy.
QUANT_MIN_WEIGHT = 1024
INT4_BLOCK = 32
LUT_GROUP = 16  # output channels sharing one palette (iOS18 grouped-channel palettization)
LUT_BITS = {"lut4": 4, "lut6": 6, "lut8": 8}
KMEANS_ITERS = 16


_LUT_MEMO: dict[
    tuple[int, bytes], tuple[np.ndarray, np.ndarray]
] = {}  # each function of a program compresses the same weights


def clear_memo() -> None:
    _LUT_MEMO.clear()


def kmeans_lut(bits: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Deterministic 1-D k-means palette (Lloyd's algorithm from quantile seeds) for one group of channels.

    Results are memoised by the weights' bytes: a program's functions share their weights, so each group is
    clustered once per conversion instead of once per function (clear_memo() after a program)."""

    def lut_function(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = (
            bits,
            hashlib.sha256(np.ascontiguousarray(weight).tobytes()).digest()
            + str(weight.shape).encode()
            + str(weight.dtype).encode(),
        )
        if key not in _LUT_MEMO:
            _LUT_MEMO[key] = _kmeans(weight, bits)
        return _LUT_MEMO[key]

    return lut_function


def _kmeans(weight: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    w = np.asarray(weight, dtype=np.float32).ravel()
    k = 1 << bits
    centers = np.quantile(w, (np.arange(k) + 0.5) / k)
    for _ in range(KMEANS_ITERS):
        centers = np.sort(centers)
        idx = np.searchsorted((centers[1:] + centers[:-1]) / 2, w)
        sums = np.bincount(idx, weights=w, minlength=k)
        counts = np.bincount(idx, minlength=k)
        centers = np.where(counts > 0, sums / np.maximum(counts, 1), centers)
    centers = np.sort(centers)
    idx = np.searchsorted((centers[1:] + centers[:-1]) / 2, w)
    return centers.astype(weight.dtype), idx.astype(np.uint8)


def optimization_config(quantize: str) -> Any:  # coremltools.optimize.coreml.OptimizationConfig (untyped)
    import coremltools.optimize.coreml as cto

    if quantize == "int8":
        op = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=QUANT_MIN_WEIGHT
        )
    elif quantize == "int4":
        op = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric",
            dtype="int4",
            granularity="per_block",
            block_size=INT4_BLOCK,
            weight_threshold=QUANT_MIN_WEIGHT,
        )
    else:
        op = cto.OpPalettizerConfig(
            mode="custom",
            lut_function=kmeans_lut(LUT_BITS[quantize]),
            granularity="per_grouped_channel",
            group_size=LUT_GROUP,
            weight_threshold=QUANT_MIN_WEIGHT,
        )
    # Only the matmul weights (1x1 convs): norms stay fp16.
    return cto.OptimizationConfig(op_type_configs={"conv": op})


def compress_package(path: Path, quantize: str) -> None:  # an .mlpackage, rewritten in place
    import shutil

    import coremltools as ct
    import coremltools.optimize.coreml as cto

    model = ct.models.MLModel(str(path), skip_model_load=True)
    fn = cto.linear_quantize_weights if quantize.startswith("int") else cto.palettize_weights
    compressed = fn(model, optimization_config(quantize))
    shutil.rmtree(path)
    compressed.save(str(path))


def simulate(weight: np.ndarray, quantize: str) -> np.ndarray:
    """(out, in) fp16 matrix -> what `quantize` makes of it, dequantized to fp16 (the conversion's arithmetic)."""
    w = np.asarray(weight, dtype=np.float16)
    if quantize == "none" or w.size < QUANT_MIN_WEIGHT:
        return w
    if quantize == "int8":
        scale = (np.abs(w.astype(np.float32)).max(axis=1, keepdims=True) / 127.0).astype(np.float16)  # (out, 1)
        safe = np.where(scale == 0, np.float16(1), scale).astype(np.float32)
        q = np.clip(np.round(w.astype(np.float32) / safe), -127, 127)
        return np.asarray(q * scale.astype(np.float32), np.float16)
    if quantize == "int4":
        o, i = w.shape
        blocks = w.astype(np.float32).reshape(o, i // INT4_BLOCK, INT4_BLOCK)
        scale = (np.abs(blocks).max(axis=2, keepdims=True) / 7.0).astype(np.float16).astype(np.float32)
        q = np.clip(np.round(blocks / np.where(scale == 0, 1, scale)), -8, 7)
        return np.asarray((q * scale).reshape(o, i), np.float16)
    lut = kmeans_lut(LUT_BITS[quantize])
    out = np.empty_like(w)
    for g in range(0, w.shape[0], LUT_GROUP):
        centers, idx = lut(w[g : g + LUT_GROUP])
        out[g : g + LUT_GROUP] = centers[idx].reshape(w[g : g + LUT_GROUP].shape)
    return out


def nominal_bytes(shapes: list[tuple[int, ...]], quantize: str) -> int:
    """What a set of weights (all matrices the conversion would compress, plus fp16 vectors) should occupy:
    the compressed payload and its scales / palettes, with no duplicate and no padding."""
    total = 0
    for shape in shapes:
        n = int(np.prod(shape))
        if quantize == "none" or n < QUANT_MIN_WEIGHT or len(shape) < 2:
            total += 2 * n
        elif quantize == "int8":
            total += n + 2 * shape[0]
        elif quantize == "int4":
            total += n // 2 + 2 * (n // INT4_BLOCK)
        else:
            bits = LUT_BITS[quantize]
            total += n * bits // 8 + 2 * (shape[0] // LUT_GROUP) * (1 << bits)
    return total
