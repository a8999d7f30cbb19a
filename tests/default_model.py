"""Where tests find the real default model (SmolLM2-135M-Instruct). Until the GGUF loader lands this is the HF-folder
stand-in; the integrator repoints DEFAULT_MODEL at the shipped GGUF. Tests that need it skip when it is absent."""

from __future__ import annotations

from pathlib import Path

import pytest

DEFAULT_MODEL = Path("/work/models/smollm2-hf")


def default_model_dir() -> Path:
    """The real default model's path, or skip the calling test when this machine does not have it."""
    if not DEFAULT_MODEL.exists():
        pytest.skip(f"the real default model is not on this machine ({DEFAULT_MODEL})")
    return DEFAULT_MODEL
