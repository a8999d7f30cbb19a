"""Fixtures shared across the suite, loaded by the root conftest (`pytest_plugins`)."""

from __future__ import annotations

import shutil
from functools import cached_property
from pathlib import Path

import pytest

from engine.backends.native import NativeKernels, load_kernels
from engine.backends.torch_backend import TorchBackend
from engine.loading.tokenizer import Tokenizer
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="session")
def kernels() -> NativeKernels:
    """The native kernels, built for this machine. CI and every developer machine has a C compiler: the kernels
    must build there, not silently fall back."""
    status = load_kernels()
    assert shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    assert status.kernels is not None, status.reason
    return status.kernels


class TinyModel:
    """A tiny random checkpoint: its folder, and the CPU backend and tokenizer over it, each made on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def backend(self) -> TorchBackend:
        return TorchBackend(self.path)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dir(self.path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """A 2-layer random Llama (tests/helpers/tiny.py), one per test module."""
    return TinyModel(make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2))
