"""The Core ML conversion of the families beyond Llama, each equal to the torch engine through the reference
interpreter (fp16): Phi-3 (its fused projections split on loading), Qwen3 (per-head q/k norms) and Gemma 3
(sliding-window layers with their own rope base and mask, q/k norms, sandwich norms, tanh-GELU gating, scaled
embeddings, its attention scale). Gemma's window (8) is far shorter than the 75-token prompt, so a sliding layer
that saw past its window, or rotated at the global base, would change the logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coreml.check import run_checks
from coreml.convert import convert
from coreml.interpreter import OPS
from coreml.reference import InterpreterBackend
from engine.backends.coreml.bundle import Bundle
from engine.backends.coreml.programs import has_local_inputs
from engine.backends.torch_backend import TorchBackend
from tests.helpers.coreml_bundles import assert_parity, op_types, prompt_ids
from tests.helpers.coreml_fixtures import SLOTS
from tests.helpers.tiny_families import make_tiny_family

# head_dim 32: the ANE state rule
ANE_SHAPES = {"hidden_size": 128, "intermediate_size": 256}


def test_phi3_converts_and_matches_the_torch_engine(tmp_path: Path) -> None:
    d = make_tiny_family(tmp_path / "phi3", "phi3", **ANE_SHAPES)
    interp = InterpreterBackend(convert(d, tmp_path / "phi3-bundle", quantize="none", slots=SLOTS))
    reference = TorchBackend(d, device="cpu", dtype=torch.float16)
    reference.allocate(1, interp.num_slots)
    ref_tokens, got_tokens = assert_parity(reference, interp, prompt_ids(75, interp.config.vocab_size), steps=16)
    assert got_tokens == ref_tokens


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_convert_and_match_the_torch_engine(family: str, tmp_path: Path) -> None:
    d = make_tiny_family(tmp_path / family, family, **ANE_SHAPES, head_dim=32)
    bundle = convert(d, tmp_path / "bundle", quantize="none", slots=SLOTS)
    assert all(line.ok for line in run_checks(bundle, smoke=False))
    interp = InterpreterBackend(bundle)
    assert (family == "gemma3") == has_local_inputs(interp.config)
    used = set(op_types(Bundle.open(bundle))) - {"const"}
    assert used <= set(OPS) and ("gelu" in used) == (family == "gemma3")  # every op runs in the interpreter
    reference = TorchBackend(d, device="cpu", dtype=torch.float16)
    reference.allocate(1, interp.num_slots)
    ref_tokens, got_tokens = assert_parity(reference, interp, prompt_ids(75, interp.config.vocab_size), steps=16)
    assert got_tokens == ref_tokens
    summary = interp.query_summary()
    assert summary is not None
    # the cascade's retrieval signal: the pre-RoPE queries after the q/k norms (and Gemma's query factor)
    torch.testing.assert_close(summary, reference.query_summary().float(), atol=2e-2, rtol=2e-2)
