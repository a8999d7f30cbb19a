"""Shared converted bundles (loaded by the root conftest, `pytest_plugins`): conversion is the slow part, so each
variant is converted once per session and every test reads the same bundle. Tiny checkpoints only (tests/helpers/tiny.py); the real-model tests are in
test_real_model.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.network import Transformer
from tests.helpers.real_model import real_gguf
from tests.helpers.tiny import make_tiny_model

# Slot table of the shared bundles: full-attention parity (75-token prompt + 64 decode steps) fits, and so does
# the cascade geometry used by the paging test (4 sinks + 3x16 retrieval + 96 window = 148 -> 160).
SLOTS = 160
# Forces the fp16 bundle of the 2-layer tiny model into two layer chunks (one layer is ~295 KB of fp16 weights).
TWO_CHUNKS = 300_000
# variant -> (quantize, compute units, tied embeddings, max chunk bytes)
VARIANTS: dict[str, tuple[str, str, bool, int | None]] = {
    "none": ("none", "CPU_AND_NE", False, TWO_CHUNKS),
    "int8": ("int8", "CPU_AND_NE", True, None),
    "int4": ("int4", "CPU_AND_GPU", True, None),
    "lut4": ("lut4", "CPU_AND_NE", True, None),
    "lut6": ("lut6", "CPU_AND_NE", True, None),
}


def model_dir_of(variant: str, tiny_dir: Path, tied_dir: Path) -> Path:
    return tied_dir if VARIANTS[variant][2] else tiny_dir


def _tiny(root: Path, tie: bool) -> Path:
    # head_dim = 128 / 4 = 32 (the ANE state rule), 4 query heads over 2 KV heads (GQA groups of 2).
    return make_tiny_model(root, hidden=128, heads=4, kv_heads=2, intermediate=256, max_positions=512, tie=tie)


@pytest.fixture(scope="session")
def coreml_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("coreml") / "tiny", tie=False)


@pytest.fixture(scope="session")
def coreml_tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("coreml") / "tied", tie=True)


@pytest.fixture(scope="session")
def coreml_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("coreml-cache")


@pytest.fixture(scope="session")
def default_bundle(coreml_tied_dir: Path, coreml_cache: Path) -> Path:
    """The tied tiny model converted with every default (auto compression, CPU_AND_NE) into the session cache."""
    from coreml.convert import cached_bundle

    return cached_bundle(coreml_tied_dir, slots=SLOTS, cache_dir=coreml_cache)


@pytest.fixture(scope="session")
def coreml_bundle(
    tmp_path_factory: pytest.TempPathFactory, coreml_tiny_dir: Path, coreml_tied_dir: Path
) -> Callable[[str], Path]:
    """package(variant) -> a converted bundle of a tiny model (converted on first request); see VARIANTS."""
    from coreml.convert import convert
    from engine.backends.coreml.programs import MAX_CHUNK_BYTES

    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("bundles")

    def get(variant: str) -> Path:
        if variant not in made:
            quantize, units, tied, max_bytes = VARIANTS[variant]
            made[variant] = convert(
                coreml_tied_dir if tied else coreml_tiny_dir,
                root / f"tiny-{variant}",
                quantize=quantize,
                units=units,
                slots=SLOTS,
                max_chunk_bytes=max_bytes or MAX_CHUNK_BYTES,
            )
        return made[variant]

    return get


@pytest.fixture(scope="session")
def coreml_big_vocab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Transformer, Path]:
    """A 1-layer fp16 tied model with 17000 > 16384 classes and its decode-only bundle (the LM head is split)."""
    from coreml.convert import build_bundle
    from engine.backends.coreml.cache import Geometry

    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 17000,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 256,
            "tie_word_embeddings": True,
        }
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    for name, p in model.named_parameters():
        torch.nn.init.normal_(p, 1.0 if "norm" in name else 0.0, 0.08)
    model = model.half().eval().requires_grad_(False)
    model.setup_rope()
    out = tmp_path_factory.mktemp("big") / "big"
    return model, build_bundle(model, "big-vocab", out, quantize="none", geometry=Geometry(64, (("decode", 1),)))


@pytest.fixture(scope="session")
def real_gguf_model() -> Path:
    """The real default model (the shipped SmolLM2-135M-Instruct GGUF)"""
    return real_gguf()
