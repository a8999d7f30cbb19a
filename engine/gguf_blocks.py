"""A GGUF file's block-quantized matrices as StoredTensor (engine.quant), keyed by Hugging Face parameter name.

What the benchmarks use to run a GGUF as stored until (and unless) the GGUF loader hands the backend the same
mapping: the file is memory-mapped by the `gguf` package, 2-D tensors in a quantized type come back as their raw
blocks, and q/k rows are un-permuted from llama.cpp's interleaved rotary order back to Hugging Face's (a row
reordering, which keeps every block intact). Float tensors (norms, F32/F16 matrices) are not included.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from engine.errors import SparkError
from engine.quant import StoredTensor

_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """(n_head*D, ...) rows from llama.cpp's interleaved rotary order back to Hugging Face's half-split order."""
    return rows.reshape(n_head, rows.shape[0] // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _field_int(reader, key: str) -> int:  # type: ignore[no-untyped-def]
    field = reader.fields.get(key)
    if field is None:
        raise SparkError(f"The GGUF file has no {key} entry; it is not a Llama-family model this engine can run.")
    return int(field.parts[field.data[0]][0])


def stored_from_gguf(path: str | Path) -> dict[str, StoredTensor]:
    """Every quantized 2-D weight of a Llama-family GGUF, as its raw blocks in torch (out, in) order."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except (OSError, ValueError) as exc:
        raise SparkError(f"{path} could not be read as a GGUF file ({exc}).") from None
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field is not None else "llama"
    n_head = _field_int(reader, f"{arch}.attention.head_count")
    n_head_kv = _field_int(reader, f"{arch}.attention.head_count_kv")
    out: dict[str, StoredTensor] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype in _FLOAT_TYPES or len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF lists (in, out)
        data = np.asarray(t.data).reshape(shape[0], -1)  # (out, bytes per row), memory-mapped
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        else:
            m = _LAYER.match(t.name)
            if m is None or m.group(2) not in _LAYER_NAMES:
                continue
            name = f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
            if m.group(2) in ("attn_q", "attn_k"):
                data = unpermute_rows(data, n_head if m.group(2) == "attn_q" else n_head_kv)
        out[name] = StoredTensor(qtype, shape, data)
    return out
