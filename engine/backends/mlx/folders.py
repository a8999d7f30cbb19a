"""MLX's own quantized folders (mlx-community's, or `mlx_lm.convert -q`'s): config.json with a `quantization`
entry (group_size, bits) and safetensors whose quantized matrices are three tensors each — `X.weight` (out,
in * bits / 32) uint32, `X.scales` and `X.biases` (out, in / group_size) — beside plain norms and biases. Read
directly into the MLX backend's weights, quantized as they are stored.

The Llama layout only (Llama, SmolLM, Mistral, Qwen2, Qwen3: unfused projections under Hugging Face's names);
other families' MLX folders store their own layouts (Gemma's raw norm weights and multimodal prefixes, Phi-3's fused
projections) and are refused in one sentence. Every header is checked before MLX reads a byte of data, and every
tensor's shape against the configuration, so a damaged or hostile folder is refused, never allocated for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import torch

from engine.backends.mlx.weights import QuantWeight, Weight
from engine.errors import ModelLoadError
from engine.fileio import reject_constant
from engine.loading.weights import MAX_HEADER_BYTES, TensorInfo, fingerprint, weight_files
from engine.model.config import ModelConfig
from engine.model.network import Transformer

# What MLX folders store: the quantized matrices' packed words, and floats. Bytes per element.
ITEMSIZE: dict[str, int] = {"U32": 4, "F32": 4, "F16": 2, "BF16": 2}
GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class Quantization:
    group_size: int
    bits: int


def folder_quantization(model_dir: Path) -> Quantization | None:
    """The folder's MLX quantization when it is an MLX-quantized folder (config.json's `quantization`), else None.
    ModelLoadError for an entry MLX itself would not write."""
    config = model_dir / "config.json"
    if not model_dir.is_dir() or not config.is_file():
        return None
    raw = ModelConfig.from_file(config).raw  # size and syntax checked there
    q = raw.get("quantization")
    if q is None:
        return None
    if not (isinstance(q, dict) and q.get("group_size") in GROUP_SIZES and q.get("bits") in BITS):
        raise ModelLoadError(
            f"{config} has a `quantization` entry MLX does not write (group size 32, 64 or 128; 2 to 8 bits)."
        )
    return Quantization(int(q["group_size"]), int(q["bits"]))


def _header(path: Path) -> list[TensorInfo]:
    """The tensor table of one safetensors file, checked: dtypes MLX folders use, whole sizes matching their
    byte spans, every span inside the file and none overlapping."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        n = int.from_bytes(first, "little") if len(first) == 8 else -1
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{path.name} has a corrupt header; it is truncated or not a safetensors file.")
        raw = f.read(n)
    try:
        table = json.loads(raw.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ModelLoadError(f"{path.name} has an unreadable header; it is not a valid safetensors file.") from None
    if not isinstance(table, dict):
        raise ModelLoadError(f"{path.name} has an unreadable header; it is not a valid safetensors file.")
    table.pop("__metadata__", None)
    base, out, at = 8 + n, [], 8 + n
    for name, entry in table.items():
        try:
            dtype, shape, (a, b) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(
                f"{path.name} has a malformed entry for tensor {name!r}; the file is corrupt."
            ) from None
        if dtype not in ITEMSIZE:
            raise ModelLoadError(f"{path.name} stores {name!r} as {str(dtype)[:16]}, which an MLX folder does not.")
        if not (
            isinstance(shape, list)
            and len(shape) <= 4
            and all(type(x) is int and 0 <= x < 1 << 40 for x in (*shape, a, b))
            and b - a == math.prod(shape) * ITEMSIZE[dtype]
            and base + b <= size
        ):
            raise ModelLoadError(f"{path.name} has inconsistent sizes for {name!r}; the file is corrupt.")
        out.append(TensorInfo(name, dtype, tuple(shape), base + a, base + b))
    for t in sorted(out, key=lambda t: t.start):
        if t.start < at:
            raise ModelLoadError(f"{path.name} has overlapping data for {t.name!r}; the file is corrupt.")
        at = t.end
    return out


def _check_family(config: ModelConfig, path: Path) -> None:
    if config.sandwich_norms or config.rotary_dims or config.architecture.startswith("Phi3"):
        raise ModelLoadError(
            f"{path.name} is an MLX-quantized {config.architecture} folder, whose layout is not read here (only the "
            "Llama layout: Llama, SmolLM, Mistral, Qwen2, Qwen3); open its GGUF or Hugging Face folder instead."
        )


def load_mlx_folder(
    model_dir: Path, quant: Quantization, dtype: mx.Dtype
) -> tuple[ModelConfig, str, dict[str, Weight], str]:
    """config, fingerprint, weights (HF names), note of an MLX-quantized folder."""
    config = ModelConfig.from_file(model_dir / "config.json")
    _check_family(config, model_dir)
    files = weight_files(model_dir)
    tables = [_header(f) for f in files]
    shapes = {t.name: t.shape for table in tables for t in table}
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    g, bits = quant.group_size, quant.bits
    arrays: dict[str, Any] = {}
    for f in files:
        loaded = mx.load(str(f))  # the headers are checked above: MLX reads spans inside each file
        assert isinstance(loaded, dict)  # a .safetensors file loads as a dict of arrays
        arrays.update(loaded)
    weights: dict[str, Weight] = {}
    quantized = 0
    for name, shape in expected.items():
        stem = name.removesuffix(".weight")
        if stem + ".scales" in shapes and name.endswith(".weight") and len(shape) == 2:
            out, k = shape
            if k % g or (k * bits) % 32:
                raise ModelLoadError(f"{name} has {k} columns, which groups of {g} do not divide.")
            want = {name: (out, k * bits // 32), stem + ".scales": (out, k // g), stem + ".biases": (out, k // g)}
            for part, part_shape in want.items():
                if shapes.get(part) != part_shape:
                    raise ModelLoadError(
                        f"Tensor {part} has shape {shapes.get(part)} but the configuration implies {part_shape}."
                    )
            if arrays[name].dtype != mx.uint32:
                raise ModelLoadError(f"Tensor {name} is quantized but not stored as uint32 words.")
            weights[name] = QuantWeight(
                arrays[name], arrays[stem + ".scales"].astype(dtype), arrays[stem + ".biases"].astype(dtype), bits, g
            )
            quantized += 1
            continue
        if shapes.get(name) != shape:
            got = "nothing" if name not in shapes else f"shape {shapes[name]}"
            raise ModelLoadError(f"Tensor {name}: the folder holds {got}, the configuration implies {shape}.")
        a = arrays[name]
        if a.dtype == mx.uint32:
            raise ModelLoadError(f"Tensor {name} is stored as uint32 words without scales; the folder is damaged.")
        weights[name] = a.astype(dtype)
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for w in weights.values():
        finite = mx.isfinite(w.scales if isinstance(w, QuantWeight) else w).all()
        if not bool(finite.item()):
            raise ModelLoadError("The folder holds NaN or infinite values; the model is corrupt, download it again.")
    note = f"MLX: {quantized} matrices as the folder stores them, {bits}-bit affine groups of {g}"
    return config, fingerprint(config, files, tables), weights, note
