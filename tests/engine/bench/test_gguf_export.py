"""The GGUF export that gives llama.cpp our weights in `bench decode`: right tensor types, right values."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.bench.gguf_export import FILE_TYPES, K_TYPES, export_gguf, permute_for_gguf
from engine.errors import SparkError
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden 64 and intermediate 128: every row is a whole number of 32-weight blocks, as Q8_0/Q4_0 need.
    return make_tiny_model(tmp_path_factory.mktemp("gguf"), "llama")


# TQ1_0 and TQ2_0 blocks are 256 weights wide, wider than this model's rows (their bytes are checked against
# gguf's dequantizer in tests/engine/model/test_quant_types.py).
@pytest.mark.parametrize("dtype", [t for t in FILE_TYPES if t not in K_TYPES and t not in ("tq1_0", "tq2_0")])
def test_export_writes_each_type_with_the_same_values(model_dir: Path, tmp_path: Path, dtype: str) -> None:
    path = export_gguf(model_dir, tmp_path / f"m-{dtype}.gguf", dtype)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    sd = load_file(model_dir / "model.safetensors")
    want_type = getattr(gguf.GGMLQuantizationType, FILE_TYPES[dtype][1])
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # norms stay f32
    for name, hf, permute_heads in [
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 4),
        ("token_embd.weight", "model.embed_tokens.weight", None),
    ]:
        t = tensors[name]
        assert t.tensor_type == want_type
        ref = sd[hf].float().numpy()
        if permute_heads:
            ref = permute_for_gguf(ref, permute_heads)
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
        # Worst case per element: half a step of the format (Q4_0: 1/16 of a block's range, Q8_0: 1/254).
        tol = {
            "f32": 0.0,
            "f16": 1e-3,
            "bf16": 8e-3,
            "q8_0": 4e-3,
            "q4_0": 7e-2,
            "q4_1": 7e-2,
            "q5_0": 4e-2,
            "q5_1": 4e-2,
        }[dtype] * max(1.0, float(np.abs(ref).max()))
        assert np.abs(got - ref).max() <= tol, (name, np.abs(got - ref).max())


def test_unknown_type_is_one_sentence(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(SparkError, match="q9_9"):
        export_gguf(model_dir, tmp_path / "x.gguf", "q9_9")
    with pytest.raises(SparkError, match="cannot quantize to q2_k"):
        export_gguf(model_dir, tmp_path / "x.gguf", "q2_k")


def test_rows_of_q_and_k_are_interleaved_per_head() -> None:
    w = torch.arange(8 * 3).reshape(8, 3).numpy()  # 2 heads of D=4: rows [0 1 | 2 3] -> [0 2 1 3] per head
    assert permute_for_gguf(w, 2)[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
