"""`bench quant`'s summary by block type (every type the engine runs as stored, on the file that holds it most) and
its KV-type run's logits through the slot table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import export_gguf
from engine.bench.quant import (
    LLAMACPP_FILES,
    OWN_REFERENCE,
    TYPES,
    by_block_type,
    file_logits,
    our_logits,
    slot_table_logits,
)
from engine.loading.model_files import gguf_model
from engine.model.kv_types import KVType
from engine.model.quant import BlockType
from tests.helpers.tiny import make_tiny_model


def _row(counts: dict[str, int], kld: float) -> dict[str, Any]:
    return {
        "tensor_counts": counts,
        "ours_mean_kld": kld,
        "llamacpp_mean_kld": 2 * kld,
        "ours_same_top": 0.9,
        "llamacpp_same_top": 0.8,
        "kld_ratio_vs_llamacpp": 0.5,
    }


def test_each_type_is_reported_on_the_file_holding_most_of_its_tensors() -> None:
    rows = {"q2_k": _row({"Q3_K": 30, "Q4_0": 180}, 0.3), "q3_k_m": _row({"Q3_K": 2, "Q4_K": 29}, 0.1)}
    summary, missing = by_block_type(rows)
    assert summary["Q3_K"] == {"file": "q2_k", "tensors": 30} | {
        k: v for k, v in rows["q2_k"].items() if k != "tensor_counts"
    }
    assert summary["Q4_K"]["file"] == "q3_k_m"
    assert set(summary) == {"Q3_K", "Q4_0", "Q4_K"}
    assert set(missing) == {t.gguf_name for t in BlockType} - set(summary)


def test_the_files_cover_every_block_type_the_engine_runs() -> None:
    # Written by the export (its own types) or by llama.cpp's quantizer (the rest): no type is left unmeasured.
    direct = {name.upper() for name in TYPES}
    from_llamacpp = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0"}
    assert {t.gguf_name for t in BlockType} <= direct | from_llamacpp
    assert {"q2_k", "iq4_xs", "tq1_0", "tq2_0", "q5_k_m"} <= set(LLAMACPP_FILES)


def test_a_ternary_file_is_measured_against_its_own_weights(tmp_path: Path) -> None:
    # BitNet's ternary weights are the model: the reference is what the file's blocks say at fp32, which is what
    # our block kernels compute from the same bytes (fp32 activations: equal to float rounding), not the folder's
    # fp32 weights, from which a Q4_0 file is visibly far.
    assert set(OWN_REFERENCE) == {"tq1_0", "tq2_0"} and set(OWN_REFERENCE) <= set(LLAMACPP_FILES)
    model = make_tiny_model(tmp_path / "m")
    path = export_gguf(model, tmp_path / "m.gguf", "q4_0")
    ids = list(range(3, 30))
    own = file_logits(path, ids)
    folder = our_logits(TorchBackend(model, "cpu", quantize="none"), ids)
    blocks = TorchBackend(model, "cpu", quantize="auto", stored=gguf_model(path).stored_tensors(), kernels="torch")
    torch.testing.assert_close(own, our_logits(blocks, ids), atol=1e-4, rtol=1e-4)
    assert (own - folder).abs().max() > 1e-2


def test_slot_table_logits_hold_every_token_and_feel_the_kv_type(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", heads=2, kv_heads=1)  # head dim 32: q8_0 fits
    ids = list(range(3, 40))
    f16 = slot_table_logits(TorchBackend(model), ids)
    reference = TorchBackend(model).model.forward_causal(torch.tensor([ids]))[0].detach()  # (T, V) fp32 KV
    assert f16.shape == reference.shape
    torch.testing.assert_close(f16, reference, atol=2e-2, rtol=0)  # fp16 keys and values only
    q8 = slot_table_logits(TorchBackend(model, kv_type=KVType.Q8_0), ids)
    assert not torch.equal(q8, f16)
    torch.testing.assert_close(q8, f16, atol=5e-2, rtol=0)
