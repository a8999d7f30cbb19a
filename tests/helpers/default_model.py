"""Where the cascade's tests find the real default model (SmolLM2-135M-Instruct): the shipped GGUF, or a skip where
its wheel is not installed (tests.helpers.real_model is the one place that knows)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.real_model import real_gguf


def default_model_dir() -> Path:
    """The real default model's path, or skip the calling test when this machine does not have it."""
    return real_gguf()
