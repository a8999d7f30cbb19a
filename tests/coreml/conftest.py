"""Shared converted packages: conversion is the slow part, so each (model, quantization) is converted once per
session and every test reads the same package."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.tiny import make_tiny_model

# Slot table of the shared packages: full-attention parity (75-token prompt + 64 decode steps) fits, and so does
# the cascade geometry used by the paging test (4 sinks + 3x16 retrieval + 96 window = 148 -> 160).
SLOTS = 160


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models on a shared 2-core box: one torch thread avoids spin-wait contention.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim = 128 / 4 = 32 (the ANE state rule), 4 query heads over 2 KV heads (GQA groups of 2).
    return make_tiny_model(tmp_path_factory.mktemp("coreml") / "tiny", hidden=128, heads=4, kv_heads=2, intermediate=256, max_positions=512)


@pytest.fixture(scope="session")
def package(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Callable[[str], Path]:
    """package(quantize) -> a converted package of the tiny model (converted on first request)."""
    from coreml.convert import convert

    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("packages")

    def get(quantize: str) -> Path:
        if quantize not in made:
            made[quantize] = convert(tiny_dir, root / f"tiny-{quantize}.mlpackage", quantize=quantize, slots=SLOTS)
        return made[quantize]

    return get
