"""Each model's own sampling defaults: the GGUF's general.sampling keys, then generation_config.json, then the
catalog, then the generic ones; a loop guard for small models; hostile values left out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.backends import BackendChoice
from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import export_gguf
from engine.generation.sampling import SamplingSettings
from engine.loading.sampling_defaults import GENERIC, LOOP_GUARD, gguf_sampling, model_sampling
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.session.engine import Engine
from tests.helpers.fixtures import TinyModel


def catalog(path: Path, file: str, sampling: object, repo: str = "someone/model-GGUF") -> Path:
    entry = {"id": "m", "repo": repo, "files": [{"quantization": "F32", "file": file}], "sampling": sampling}
    path.write_text(json.dumps({"format": 1, "models": [entry]}))
    return path


def test_gguf_keys_come_first_then_the_catalog(tiny: TinyModel, tmp_path: Path) -> None:
    g = export_gguf(tiny.path, tmp_path / "m.gguf", "f32", sampling={"temp": 0.6, "top_k": 20, "penalty_last_n": 32})
    cat = catalog(tmp_path / "catalog.json", "m.gguf", {"temperature": 1.5, "top_p": 0.95, "repeat_penalty": 1.05})
    m = model_sampling(g, cat)
    assert (m.temperature, m.top_k, m.repetition_window) == (pytest.approx(0.6), 20, 32)  # the file's own
    assert (m.top_p, m.repetition_penalty) == (pytest.approx(0.95), pytest.approx(1.05))  # the catalog's
    assert m.sources == ("gguf", "catalog") and "GGUF" in m.described and "catalog" in m.described


def test_generation_config_then_catalog_by_repo(tiny: TinyModel, tmp_path: Path) -> None:
    d = tmp_path / "folder"
    d.mkdir()
    for f in tiny.path.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "org/model"}))
    (d / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.3, "top_p": 0.8}))
    cat = catalog(tmp_path / "catalog.json", "other.gguf", {"temperature": 1.0, "min_p": 0.05}, repo="org/model")
    m = model_sampling(d, cat)
    assert (m.temperature, m.top_p, m.min_p, m.greedy) == (0.3, 0.8, 0.05, False)
    assert m.sources[:2] == ("generation_config", "catalog")


def test_a_small_model_without_a_penalty_gets_the_loop_guard(tiny: TinyModel, tmp_path: Path) -> None:
    m = model_sampling(tiny.path, tmp_path / "no-catalog.json")  # the tiny model's generation_config: greedy only
    assert m.greedy and m.repetition_penalty == LOOP_GUARD["repetition_penalty"]
    assert m.sources == ("generation_config", "loop_guard")
    neutral = export_gguf(tiny.path, tmp_path / "n.gguf", "f32", sampling={"penalty_repeat": 1.0})
    assert model_sampling(neutral, tmp_path / "no-catalog.json").repetition_penalty == 1.1  # 1.0 is no finding
    g = export_gguf(tiny.path, tmp_path / "p.gguf", "f32", sampling={"penalty_repeat": 1.3})
    given = model_sampling(g, tmp_path / "no-catalog.json")  # the model names its own penalty: kept
    assert given.repetition_penalty == pytest.approx(1.3) and "loop_guard" not in given.sources


@pytest.mark.parametrize(
    "bad",
    [{"temp": math.nan}, {"temp": -1.0}, {"top_p": 0.0}, {"top_p": 2.0}, {"top_k": -3}, {"top_k": 2.5}, {"min_p": 7}],
)
def test_hostile_values_are_left_out(bad: dict[str, float]) -> None:
    assert gguf_sampling({f"general.sampling.{k}": v for k, v in bad.items()}) == {}
    assert gguf_sampling({"general.sampling.temp": "hot", "general.sampling.top_k": True}) == {}


@pytest.mark.parametrize("text", ["not json", "[]", '{"models": 3}', '{"models": [1, {"files": 2}]}'])
def test_a_broken_catalog_is_no_catalog(tiny: TinyModel, tmp_path: Path, text: str) -> None:
    (tmp_path / "catalog.json").write_text(text)
    m = model_sampling(tiny.path, tmp_path / "catalog.json")
    assert m.temperature == GENERIC["temperature"] and "catalog" not in m.sources


def test_the_engine_answers_with_the_models_defaults(tiny: TinyModel, tmp_path: Path) -> None:
    g = export_gguf(tiny.path, tmp_path / "e.gguf", "f32", sampling={"temp": 0.25, "top_p": 0.9, "penalty_repeat": 1.2})
    b = TorchBackend(g, "cpu")
    b.allocate(1, 64)
    engine = Engine(BackendChoice(b, ()), Tokenizer.load(g), g, FullAttentionMemory)
    assert engine.sampling_defaults.sources[0] == "gguf"
    settings = engine.default_settings(seed=3)
    assert settings.sampling == SamplingSettings(
        temperature=pytest.approx(0.25), top_p=pytest.approx(0.9), repetition_penalty=pytest.approx(1.2), seed=3
    )
