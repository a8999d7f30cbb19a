"""Shared converted packages: conversion is the slow part, so each (model, quantization) is converted once per
session and every test reads the same package."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model import Transformer
from tests.tiny import make_tiny_model

# Slot table of the shared packages: full-attention parity (75-token prompt + 64 decode steps) fits, and so does
# the cascade geometry used by the paging test (4 sinks + 3x16 retrieval + 96 window = 148 -> 160).
SLOTS = 160


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


@pytest.fixture(scope="session")
def big_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, Path]:
    """A 1-layer fp16 model with 17000 > 16384 classes and its decode-only package (the LM head is split)."""
    from coreml.convert import Geometry, build_package

    cfg = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 17000, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256}
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.08)
    model = model.half().eval().requires_grad_(False)
    model.setup_rope()
    out = tmp_path_factory.mktemp("big") / "big.mlpackage"
    return model, build_package(model, "big-vocab", out, geometry=Geometry(64, (("decode", 1),)))
