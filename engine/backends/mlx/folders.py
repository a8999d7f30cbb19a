"""MLX's own quantized folders (mlx-community's, or `mlx_lm.convert -q`'s): config.json with a `quantization`
entry (group_size, bits) and safetensors whose quantized matrices are three tensors each — `X.weight` (out,
in * bits / 32) uint32, `X.scales` and `X.biases` (out, in / group_size) — beside plain norms and biases. Read
directly into the MLX backend's weights, quantized as they are stored.

mlx-lm's text-model layouts: Hugging Face's names, Phi-3's fused projections (split here by rows), Gemma's raw norm
weights (held as the 1 + w they scale by, as our loaders hold them); a partial-rotary model is refused in one
sentence. Every header is checked before MLX reads a byte of data, and every
tensor's shape against the configuration, so a damaged or hostile folder is refused, never allocated for.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

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
    if config.rotary_dims:
        raise ModelLoadError(
            f"{path.name} is an MLX-quantized {config.architecture} folder with partial rotary embeddings, whose "
            "layout is not read here; open its GGUF or Hugging Face folder instead."
        )


def _tensors(
    files: list[Path], tables: list[list[TensorInfo]], quant: Quantization, dtype: mx.Dtype
) -> dict[str, Weight]:
    """Every tensor of the folder, its quantized matrices as QuantWeight (each checked: uint32 words, scales and
    biases matching them), the rest in `dtype`."""
    arrays: dict[str, mx.array] = {}
    for f in files:
        loaded = mx.load(str(f))  # the headers are checked above: MLX reads spans inside each file
        assert isinstance(loaded, dict)  # a .safetensors file loads as a dict of arrays
        arrays.update(loaded)
    g, bits = quant.group_size, quant.bits
    out: dict[str, Weight] = {}
    for name, a in arrays.items():
        stem = name.removesuffix(".weight")
        if (
            name.endswith((".scales", ".biases"))
            and stem.removesuffix(".scales").removesuffix(".biases") + ".weight" in arrays
        ):
            continue
        if name.endswith(".weight") and stem + ".scales" in arrays:
            scales, biases = arrays[stem + ".scales"], arrays.get(stem + ".biases")
            rows, words = (a.shape[0], a.shape[1]) if a.ndim == 2 else (0, 0)
            if a.dtype != mx.uint32 or biases is None or (words * 32) % bits:
                raise ModelLoadError(
                    f"Tensor {name} is not stored as MLX's quantized matrices are; the folder is damaged."
                )
            cols = words * 32 // bits
            if cols % g or scales.shape != (rows, cols // g) or biases.shape != scales.shape:
                raise ModelLoadError(f"Tensor {stem}.scales does not match {name}'s {cols} columns in groups of {g}.")
            out[name] = QuantWeight(a, scales.astype(dtype), biases.astype(dtype), bits, g)
        elif a.dtype == mx.uint32:
            raise ModelLoadError(f"Tensor {name} is stored as uint32 words without scales; the folder is damaged.")
        else:
            out[name] = a.astype(dtype)
    return out


def _rows(w: Weight, a: int, b: int) -> Weight:
    if isinstance(w, QuantWeight):
        return QuantWeight(w.packed[a:b], w.scales[a:b], w.biases[a:b], w.bits, w.group_size)
    return w[a:b]


def _family_layout(config: ModelConfig, tensors: dict[str, Weight]) -> dict[str, Weight]:
    """mlx-lm's layouts into the network's: Phi-3's fused q/k/v and gate/up split by rows (a quantized matrix's rows
    are independent), Gemma's norm weights w as the 1 + w they scale by (as our loaders hold them)."""
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    out: dict[str, Weight] = {}
    for name, w in tensors.items():
        shape = (w.packed if isinstance(w, QuantWeight) else w).shape
        if name.endswith("self_attn.qkv_proj.weight") and shape[0] == q_rows + 2 * kv_rows:
            stem = name.removesuffix("qkv_proj.weight")
            out[stem + "q_proj.weight"] = _rows(w, 0, q_rows)
            out[stem + "k_proj.weight"] = _rows(w, q_rows, q_rows + kv_rows)
            out[stem + "v_proj.weight"] = _rows(w, q_rows + kv_rows, q_rows + 2 * kv_rows)
        elif name.endswith("mlp.gate_up_proj.weight") and shape[0] == 2 * config.intermediate_size:
            stem = name.removesuffix("gate_up_proj.weight")
            out[stem + "gate_proj.weight"] = _rows(w, 0, config.intermediate_size)
            out[stem + "up_proj.weight"] = _rows(w, config.intermediate_size, 2 * config.intermediate_size)
        elif config.sandwich_norms and name.endswith("norm.weight") and not isinstance(w, QuantWeight):
            out[name] = w.astype(mx.float32) + 1.0  # Gemma scales by (1 + w), computed in fp32 as transformers does
        else:
            out[name] = w
    return out


def load_mlx_folder(
    model_dir: Path, quant: Quantization, dtype: mx.Dtype
) -> tuple[ModelConfig, str, dict[str, Weight], str]:
    """config, fingerprint, weights (HF names), note of an MLX-quantized folder."""
    config = ModelConfig.from_file(model_dir / "config.json")
    _check_family(config, model_dir)
    files = weight_files(model_dir)
    tables = [_header(f) for f in files]
    tensors = _family_layout(config, _tensors(files, tables, quant, dtype))
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(config).state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    weights: dict[str, Weight] = {}
    for name, shape in expected.items():
        w = tensors.get(name)
        if w is None:
            raise ModelLoadError(f"The folder lacks {name}; it does not match its configuration.")
        got = (w.packed.shape[0], w.scales.shape[1] * w.group_size) if isinstance(w, QuantWeight) else w.shape
        if tuple(got) != shape:
            raise ModelLoadError(f"Tensor {name} has shape {tuple(got)} but the configuration implies {shape}.")
        weights[name] = w.astype(dtype) if isinstance(w, mx.array) else w
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for w in weights.values():
        finite = mx.isfinite(w.scales if isinstance(w, QuantWeight) else w).all()
        if not bool(finite.item()):
            raise ModelLoadError("The folder holds NaN or infinite values; the model is corrupt, download it again.")
    quantized = len({id(w) for w in weights.values() if isinstance(w, QuantWeight)})  # a tied head once
    note = f"MLX: {quantized} matrices as the folder stores them, {quant.bits}-bit affine groups of {quant.group_size}"
    return config, fingerprint(config, files, tables), weights, note
