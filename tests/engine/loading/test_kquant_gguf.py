"""K-quant files as llama.cpp's quantizer writes them. A Q4_K_M file (from a tiny fp32 checkpoint shaped like
SmolLM2: a hidden size that is no multiple of 256, so its quantizer falls back to Q5_0 and Q8_0 for those rows)
runs as stored on the
native kernels: each matrix holds the file's bytes (q/k/v of mixed formats widened to Q8_0 without loss), the
logits match the same blocks dequantized with fp32 activations (within int16 activation rounding; int8's for the
Q4_K and Q6_K matrices, which take int8 activations on AVX-512 VNNI), stay within the bound the weights' rounding
implies against fp32, and the native decoding step agrees with the PyTorch step over the same layers."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.native.decoder import NativeBlockLinear
from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import quantize_with_llamacpp
from engine.loading.model_files import gguf_model
from engine.model.quant import BlockType, StoredTensor, dequantize, widen_to_q8_0
from tests.helpers.quant_blocks import IDS, logits_of
from tests.helpers.tiny import make_tiny_model

pytest.importorskip("llama_cpp", reason="llama-cpp-python writes the K-quant file (the bench extra)")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kquant")
    # hidden 288 (no multiple of 256: Q5_0 / Q8_0 fallbacks), MLP 512 (two super-blocks: Q4_K / Q6_K down_proj)
    folder = make_tiny_model(root / "hf", "llama", hidden=288, heads=4, kv_heads=2, intermediate=512, tie=True)
    return folder, quantize_with_llamacpp(folder, root / "m-q4_k_m.gguf", "q4_k_m")


def test_the_file_mixes_the_formats_a_q4_k_m_download_has(q4_k_m: tuple[Path, Path]) -> None:
    stored = gguf_model(q4_k_m[1]).stored_tensors()
    kinds = Counter(t.qtype for t in stored.values())
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= set(kinds), kinds


def test_a_q4_k_m_file_runs_as_stored_on_the_native_kernels(q4_k_m: tuple[Path, Path]) -> None:
    path = q4_k_m[1]
    stored = gguf_model(path).stored_tensors()
    b = TorchBackend(path, "cpu", quantize="auto", stored=stored)
    assert b.native_isa is not None and b.kernels_note.startswith("native")
    layers = {name: m for name, m in b.model.named_modules() if isinstance(m, NativeBlockLinear)}
    assert {m.qtype for m in layers.values()} >= {BlockType.Q4_K, BlockType.Q6_K, BlockType.Q5_0, BlockType.Q8_0}
    for i in range(2):
        down = layers[f"model.layers.{i}.mlp.down_proj"]
        t = stored[f"model.layers.{i}.mlp.down_proj.weight"]
        assert down.qtype.name == t.qtype and np.array_equal(down.blocks.numpy(), _rows(t))
        qkv = layers[f"model.layers.{i}.self_attn.qkv_proj"]
        parts = [stored[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"]
        widened = np.concatenate([widen_to_q8_0(_rows(p), BlockType.named(p.qtype)) for p in parts])
        if qkv.qtype is BlockType.Q8_0:  # mixed formats: the same values as Q8_0 blocks
            assert np.array_equal(qkv.blocks.numpy(), widened)
        assert np.array_equal(
            dequantize(qkv.blocks.numpy(), qkv.qtype, (qkv.out_features, qkv.padded)),
            np.concatenate([dequantize(_rows(p), BlockType.named(p.qtype), p.shape) for p in parts]),
        )


def _rows(t: StoredTensor) -> np.ndarray:
    return np.asarray(t.data, dtype=np.uint8).reshape(t.shape[0], -1)


def test_q4_k_m_logits_match_the_dequantized_blocks_and_stay_near_fp32(q4_k_m: tuple[Path, Path]) -> None:
    folder, path = q4_k_m
    stored = gguf_model(path).stored_tensors()
    auto = TorchBackend(path, "cpu", quantize="auto", stored=stored)
    native = logits_of(auto, IDS)
    int16 = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, act_parts=2), IDS)
    dequantized = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, kernels="torch"), IDS)
    stepwise = logits_of(
        TorchBackend(path, "cpu", quantize="auto", stored=stored, native_steps=False, act_parts=2), IDS
    )
    fp32 = logits_of(TorchBackend(folder, "cpu", quantize="none"), IDS)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:  # the worst token's relative error
        return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).max())

    # int16 activations per block of 32 (~2^-15 relative each) against fp32 ones over the very same weights
    assert rel(int16, dequantized) < 1e-3
    # The PyTorch step over the same layers: its norms, rotations and softmax round differently, which moves an
    # activation across an int16 rounding boundary now and then (2^-15 each), nothing more.
    assert rel(stepwise, int16) < 1e-3
    # The default: int8 activations (~2^-8 relative each) for the Q4_K and Q6_K matrices where the kernels take
    # them (AVX-512 VNNI), int16 for the rest.
    assert rel(native, dequantized) < (1e-3 if auto.act_formats == {2} else 5e-2)
    # Against fp32: the weights' own rounding, as test_quant's bound (9 times the worst matrix's relative error).
    weights = TorchBackend(path, "cpu", quantize="auto", stored=stored, kernels="torch").model  # K-major fp32
    reference = TorchBackend(folder, "cpu", quantize="none").model
    worst = 0.0
    for name, m in weights.named_modules():
        if hasattr(m, "weight_t") and name != "lm_head":  # the tied head is the embedding, checked as such
            w_ref: torch.Tensor = getattr(reference.get_submodule(name), "weight_t")  # noqa: B009 (fp32 (K, N))
            w_q: torch.Tensor = getattr(m, "weight_t")  # noqa: B009
            worst = max(worst, float((w_q - w_ref).norm() / w_ref.norm()))
    assert 0.01 < worst < 0.2  # Q4_K_M's rounding is real and moderate
    assert rel(native, fp32) < 9 * worst + 0.01


@pytest.mark.parametrize("dtype,kind", [("q5_k_m", "Q5_K"), ("q3_k_m", "Q3_K"), ("q2_k", "Q2_K")])
def test_the_other_k_quant_mixes_run_as_stored(tmp_path: Path, dtype: str, kind: str) -> None:
    """Q5_K_M, Q3_K_M and Q2_K files as llama.cpp writes them from a checkpoint whose every row is a multiple of
    256 (so no fallbacks: Q5_K, Q3_K, Q2_K rows beside the Q4_K, Q5_K and Q6_K each mix promotes some tensors to;
    a fused q/k/v then mixes formats): nothing is read in fp32, and the logits are those of the same blocks
    dequantized, within activation rounding (int16, or int8 for the Q4_K and Q6_K matrices on AVX-512 VNNI)."""
    folder = make_tiny_model(tmp_path / "hf", "llama", hidden=256, heads=4, kv_heads=2, intermediate=512, tie=True)
    path = quantize_with_llamacpp(folder, tmp_path / f"m-{dtype}.gguf", dtype)
    stored = gguf_model(path).stored_tensors()
    assert kind in {t.qtype for t in stored.values()}
    auto = TorchBackend(path, "cpu", quantize="auto", stored=stored)
    assert auto.quantize != "none" and auto.kernels_note.startswith("native")
    native = logits_of(auto, IDS)
    int16 = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, act_parts=2), IDS)
    dequantized = logits_of(TorchBackend(path, "cpu", quantize="auto", stored=stored, kernels="torch"), IDS)

    def rel(a: torch.Tensor) -> float:  # the worst token's relative error against the dequantized blocks
        return float(((a - dequantized).norm(dim=-1) / dequantized.norm(dim=-1)).max())

    assert rel(int16) < 1e-3
    assert rel(native) < (1e-3 if auto.act_formats == {2} else 5e-2)  # int8 rows for Q4_K and Q6_K (AVX-512 VNNI)
