"""The catalog's Gemma 3 and Qwen2.5-VL vision entries from the loopback Hub: the GGUF (Qwen2.5-VL's a `qwen2vl`
text model) and its llama.cpp projector download into one model folder, the projector checked against the model, and
the model opens seeing pictures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.bench.mmproj_export import export_vision
from engine.library.library import Library
from engine.session.engine import load
from tests.helpers.fake_hub import FakeHub
from tests.helpers.tiny_gemma3 import make_tiny_gemma3
from tests.helpers.tiny_qwen25vl import make_tiny_qwen25vl

pytest.importorskip("transformers")
# the catalog's entries: repo, the default file's name, the projector's name, and a tiny checkpoint of the family
ENTRIES: dict[str, tuple[str, str, str, Callable[[Path], Path]]] = {
    "gemma3": (
        "ggml-org/gemma-3-4b-it-GGUF",
        "gemma-3-4b-it-Q4_K_M.gguf",
        "mmproj-model-f16.gguf",
        lambda out: make_tiny_gemma3(out, query_pre_attn_scalar=16),
    ),
    "qwen2.5-vl": (
        "ggml-org/Qwen2.5-VL-3B-Instruct-GGUF",
        "Qwen2.5-VL-3B-Instruct-Q4_K_M.gguf",
        "mmproj-Qwen2.5-VL-3B-Instruct-Q8_0.gguf",
        make_tiny_qwen25vl,
    ),
}


@pytest.mark.parametrize("family", sorted(ENTRIES))
def test_vision_entry_downloads_and_sees_pictures(family: str, library: Library, hub: FakeHub, tmp_path: Path) -> None:
    repo, name, projector, make = ENTRIES[family]
    text, mmproj = export_vision(make(tmp_path / "hf"), tmp_path / "gguf", "f32", "f32")
    hub.add(repo, {name: text.read_bytes(), projector: mmproj.read_bytes()})
    model = library.downloader().download(repo)
    assert model.path.name == name and model.mmproj is not None and model.mmproj.name == projector
    engine = load(model.path.parent, "cpu", cache_dir=tmp_path / "cache")
    assert engine.vision is not None and engine.mmproj == model.mmproj
