"""The Core ML conversion of the families beyond Llama: Phi-3 (its fused projections split on loading) converts
and equals the torch engine through the reference interpreter; Qwen3 and Gemma 3, whose layers the ANE graph does
not implement yet, are refused in one sentence that names what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coreml.convert import convert
from coreml.errors import ConversionError
from coreml.reference import InterpreterBackend
from engine.backends.torch_backend import TorchBackend
from tests.coreml.helpers import SLOTS, prompt_ids
from tests.coreml.test_parity import assert_parity
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


@pytest.mark.parametrize(("family", "missing"), [("qwen3", "per-head q/k norms"), ("gemma3", "sliding-window layers")])
def test_families_beyond_the_ane_graph_are_refused_in_one_sentence(family: str, missing: str, tmp_path: Path) -> None:
    d = make_tiny_family(tmp_path / family, family, **ANE_SHAPES, head_dim=32)
    with pytest.raises(ConversionError, match=missing) as err:
        convert(d, tmp_path / "bundle", quantize="none", slots=SLOTS)
    assert "\n" not in str(err.value) and not (tmp_path / "bundle").exists()
