"""The curated catalog: every figure it states is the one the formulas give (so it cannot drift), every model
carries its recommended sampling, and a malformed catalog is one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.library.catalog import (
    CatalogError,
    approximate_file_size,
    estimate_parameters,
    load_catalog,
    memory_needed,
)
from engine.loading.model_files import DEFAULT_MODEL_FILE, default_model_path

CATALOG = Path(__file__).resolve().parents[3] / "resources" / "models" / "catalog.json"


def test_figures_are_the_formulas() -> None:
    catalog = load_catalog(CATALOG)
    assert {m.family for m in catalog.models} >= {"qwen3", "gemma3", "llama", "phi3"}
    for model in catalog.models:
        assert model.parameters == estimate_parameters(model.architecture), model.id
        for f in model.files:
            if f.size_approximate:
                assert f.size_bytes == approximate_file_size(model.parameters, f.quantization), f.file
            assert f.memory_4k_bytes == memory_needed(f.size_bytes, model.architecture, 4096), f.file
            assert f.memory_32k_bytes == memory_needed(f.size_bytes, model.architecture, 32768), f.file
            assert f.memory_4k_bytes <= f.memory_32k_bytes


def test_published_parameter_counts() -> None:
    """The architecture fields reproduce the model cards' parameter counts (to 3%)."""
    published = {
        "qwen3-0.6b": 0.6e9,
        "qwen3-4b": 4.0e9,
        "qwen3-8b": 8.2e9,
        "llama3.2-1b": 1.24e9,
        "llama3.2-3b": 3.21e9,
        "phi4-mini": 3.8e9,
        "smollm2-1.7b": 1.7e9,
        "smollm2-135m": 135e6,
    }
    catalog = load_catalog(CATALOG)
    for model_id, count in published.items():
        model = catalog.by_id(model_id)
        assert model is not None and abs(model.parameters / count - 1) < 0.03, model_id


def test_sliding_window_layers_hold_their_window_only() -> None:
    gemma = load_catalog(CATALOG).by_id("gemma3-1b")
    assert gemma is not None
    arch = gemma.architecture
    per_token = 2 * arch.kv_heads * arch.head_dim * 2
    assert arch.global_layers() == 4
    assert arch.kv_bytes(32768) == per_token * (4 * 32768 + 22 * 512)


def test_the_bundled_default_model_is_the_real_file() -> None:
    entry = load_catalog(CATALOG).by_file(DEFAULT_MODEL_FILE)
    assert entry is not None and entry.bundled
    f = entry.file()
    assert not f.size_approximate and f.size_bytes == default_model_path().stat().st_size
    assert (entry.sampling.temperature, entry.sampling.top_p) == (0.2, 0.9)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format=99),
        lambda d: d["models"][0].pop("repo"),
        lambda d: d["models"][0]["sampling"].update(top_p=0.0),
        lambda d: d["models"][0]["files"][0].update(file="../escape.gguf"),
        lambda d: d["models"][0]["files"][0].update(size_bytes=-1),
        lambda d: d["models"][0].update(default_quantization="Q2_K"),
        lambda d: d["models"][0]["architecture"].update(layers="many"),
    ],
)
def test_a_malformed_catalog_is_one_sentence(tmp_path: Path, mutate: object) -> None:
    data = json.loads(CATALOG.read_text())
    mutate(data)  # type: ignore[operator]
    bad = tmp_path / "catalog.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(CatalogError) as info:
        load_catalog(bad)
    assert "\n" not in str(info.value)
