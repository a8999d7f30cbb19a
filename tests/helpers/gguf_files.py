"""GGUF files written by the tests themselves from the tiny checkpoints (engine.bench.gguf_export), including the
K-quant types the `gguf` package cannot quantize: for those, rows of random but valid blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.bench.gguf_export import K_TYPES, export_gguf

# Byte offsets of each block's fp16 scale fields (llama.cpp's block_q*_K, block_iq4_* structs): (d, dmin or None).
K_SCALE_OFFSETS: dict[str, tuple[int, int | None]] = {
    "Q2_K": (80, 82),
    "Q3_K": (108, None),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
    "IQ4_NL": (0, None),
    "IQ4_XS": (0, None),
}


def random_blocks(a: np.ndarray, kind: Any, seed: int = 0) -> np.ndarray:
    """(rows, cols) float32 -> (rows, bytes) of random K-quant blocks with small, finite scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = a.shape
    n = cols // block
    rng = np.random.default_rng(seed + rows * 7 + cols)
    raw = rng.integers(0, 256, size=(rows, n, size), dtype=np.uint8)
    d_at, dmin_at = K_SCALE_OFFSETS[kind.name]
    raw[:, :, d_at : d_at + 2] = np.full((rows, n), 0.004, np.float16).view(np.uint8).reshape(rows, n, 2)
    if dmin_at is not None:
        raw[:, :, dmin_at : dmin_at + 2] = np.full((rows, n), 0.002, np.float16).view(np.uint8).reshape(rows, n, 2)
    return raw.reshape(rows, n * size)


def write_gguf(model_dir: Path, out: Path, dtype: str) -> Path:
    return export_gguf(model_dir, out, dtype, quantizer=random_blocks if dtype in K_TYPES else None)


def with_tensor_as(path: Path, out: Path, name: str, kind: Any) -> Path:
    """A copy of the GGUF at `path` with tensor `name` re-quantized to `kind` (a gguf.GGMLQuantizationType)."""
    return rewritten(path, out, tensors={name: kind})


def rewritten(
    path: Path, out: Path, values: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None
) -> Path:
    """A copy of the GGUF at `path` with the metadata `values` (key -> value, written as the stored key's type) and
    the tensors in `tensors` re-quantized (name -> gguf.GGMLQuantizationType); the rest as stored."""
    import gguf

    values, tensors = values or {}, tensors or {}
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(str(out), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value = values[key] if key in values else f.contents()
        vtype = f.types[0]
        w.add_key_value(key, value, vtype, sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        kind = tensors.get(t.name)
        if kind is not None:
            w.add_tensor(
                t.name, gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), kind), raw_dtype=kind
            )
        else:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
