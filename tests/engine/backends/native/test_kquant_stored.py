"""K-quant files run as stored without llama.cpp's quantizer (so CI, which has no llama-cpp-python, covers them):
a tiny model whose every matrix is of one format (Q4_K, Q6_K, every other K-quant, IQ4_NL/XS, Q5_1, TQ1_0, TQ2_0),
or whose fused q/k/v mixes two, holding random but valid blocks (small finite scales) written with
the GGUF export's quantizer hook. Each matrix holds the file's bytes, the native kernels give the logits of the same
blocks dequantized with fp32 activations, and the native decoding step agrees with the PyTorch step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.backends.native.decoder import NativeBlockLinear
from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import FILE_TYPES, export_gguf
from engine.loading.model_files import gguf_model
from engine.model.quant import BlockType
from tests.helpers.gguf_files import with_tensor_as, write_gguf
from tests.helpers.quant_blocks import IDS, logits_of
from tests.helpers.tiny import make_tiny_model

SUPER = 256  # weights per K-quant super-block


def random_blocks(a: np.ndarray, kind: Any) -> np.ndarray:
    """Valid random blocks of `kind` for a (rows, cols) matrix: fp16 super-block scales of ~1e-2, random quants."""
    qtype = BlockType[kind.name]
    rows, cols = a.shape
    n = cols // SUPER
    rng = np.random.default_rng(rows * 7919 + cols)
    raw = rng.integers(0, 256, size=(rows * n, qtype.block_bytes), dtype=np.uint8)
    scales = (rng.uniform(0.2, 1.0, size=(rows * n, 2)) * (2e-3 if qtype is BlockType.Q4_K else 4e-4)).astype(
        np.float16
    )
    if qtype is BlockType.Q4_K:  # d, dmin lead the block
        raw[:, :4] = scales.view(np.uint8)
    else:  # Q6_K: ql, qh, int8 scales, then d last
        raw[:, -2:] = scales[:, :1].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("dtype,qtype", [("q4_k", BlockType.Q4_K), ("q6_k", BlockType.Q6_K)])
def test_a_k_quant_file_runs_its_blocks_as_stored(tmp_path: Path, dtype: str, qtype: BlockType) -> None:
    folder = make_tiny_model(tmp_path / "hf", "llama", hidden=256, heads=4, kv_heads=2, intermediate=512, tie=True)
    path = export_gguf(folder, tmp_path / f"m-{dtype}.gguf", dtype, quantizer=random_blocks)
    runs_as_stored(path, qtype)


# The other formats a download may hold: random valid blocks (tests.helpers.gguf_files) where the gguf package has
# no quantizer, its own quantizer's bytes otherwise (Q5_1, the ternary TQ1_0 and TQ2_0).
OTHERS = ["q2_k", "q3_k", "q5_k", "iq4_xs", "iq4_nl", "q5_1", "tq1_0", "tq2_0"]


@pytest.mark.parametrize("dtype", OTHERS)
def test_every_other_format_runs_its_blocks_as_stored(tmp_path: Path, dtype: str) -> None:
    folder = make_tiny_model(tmp_path / "hf", "llama", hidden=256, heads=4, kv_heads=2, intermediate=512, tie=True)
    runs_as_stored(write_gguf(folder, tmp_path / f"m-{dtype}.gguf", dtype), BlockType.named(FILE_TYPES[dtype][1]))


def test_a_fused_matrix_of_mixed_formats_runs_each_part_as_stored(tmp_path: Path) -> None:
    """q, k as Q4_K beside v as Q5_1 (as a Q4_K_M file's v is Q6_K in some layers): no format holds them all, so
    the fused q/k/v keeps a run of rows per format, and the decoding step follows the parts in order."""
    import gguf

    folder = make_tiny_model(tmp_path / "hf", "llama", hidden=256, heads=4, kv_heads=2, intermediate=512, tie=True)
    q4k = export_gguf(folder, tmp_path / "m-q4_k.gguf", "q4_k", quantizer=random_blocks)
    path = with_tensor_as(q4k, tmp_path / "mixed.gguf", "blk.1.attn_v.weight", gguf.GGMLQuantizationType.Q5_1)
    b = runs_as_stored(path, None)
    qkv = b.model.get_submodule("model.layers.1.self_attn.qkv_proj")
    assert isinstance(qkv, NativeBlockLinear)
    assert [(p.qtype, p.out_features) for p in qkv.parts] == [(BlockType.Q4_K, 256 + 128), (BlockType.Q5_1, 128)]
    assert not len(b.model.get_submodule("model.layers.0.self_attn.qkv_proj").parts)  # one format: one matrix


def runs_as_stored(path: Path, qtype: BlockType | None) -> TorchBackend:
    """The file's matrices hold its bytes (of `qtype` throughout, unless None), the native logits match the same
    blocks dequantized with fp32 activations, and the native decoding step agrees with the PyTorch step."""
    stored = gguf_model(path).stored_tensors()
    b = TorchBackend(path, "cpu", quantize="auto", stored=stored)
    assert b.native_isa is not None and b.kernels_note.startswith("native")
    layers = {name: m for name, m in b.model.named_modules() if isinstance(m, NativeBlockLinear)}
    if qtype is not None:
        assert {m.qtype for m in layers.values()} == {qtype}
    down = layers["model.layers.0.mlp.down_proj"]
    t = stored["model.layers.0.mlp.down_proj.weight"]
    assert np.array_equal(down.blocks.numpy(), np.asarray(t.data, dtype=np.uint8).reshape(t.shape[0], -1))

    native = logits_of(b, IDS)
    dequantized = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, kernels="torch"), IDS)
    stepwise = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, native_steps=False), IDS)
    assert torch.isfinite(native).all() and float(native.std()) > 0

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:  # the worst token's relative error
        return float(((x - y).norm(dim=-1) / y.norm(dim=-1)).max())

    # Activations per block of 32 against fp32 ones, same weights: on AVX-512 VNNI int8 for the Q4_K and Q6_K
    # matrices (a matrix of parts takes one format, int8 only where every part is one of them), else int16.
    formats = {m.desc.act_parts for m in layers.values()}
    for name, m in layers.items():
        if ".parts." in name:  # a part of a fused matrix, which quantizes its input once for all parts (below)
            continue
        parts = [p.qtype for p in m.parts] or [m.qtype]
        want = 1 if b.native_isa == "avx512-vnni" and set(parts) <= {BlockType.Q4_K, BlockType.Q6_K} else 2
        assert [p.desc.act_parts for p in m.parts] in ([], [want] * len(parts)), name
        assert m.desc.act_parts == want, (name, parts)
    label = "a8" if formats == {1} else "a16i" if formats == {2} else "a16ik8"  # prefix-cache entries differ
    assert f"native-{label}-" in b.numerics, b.numerics
    # The blocks themselves, read exactly: int16 activations everywhere against fp32 ones, same weights.
    int16 = (
        native
        if formats == {2}
        else logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, act_parts=2), IDS)
    )
    assert rel(int16, dequantized) < 1e-3
    # int8 activations cost more on this random model (its layers amplify every rounding), never a different model.
    assert rel(native, dequantized) < 0.15
    assert rel(stepwise, native) < 1e-3  # the PyTorch step over the same layers
    return b
