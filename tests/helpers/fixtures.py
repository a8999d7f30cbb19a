"""Fixtures shared across the suite, loaded by the root conftest (`pytest_plugins`)."""

from __future__ import annotations

import shutil

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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[TorchBackend, Tokenizer]:
    """A 2-layer random Llama on the CPU backend, with its tokenizer."""
    d = make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=2)
    return TorchBackend(d), Tokenizer.from_dir(d)
