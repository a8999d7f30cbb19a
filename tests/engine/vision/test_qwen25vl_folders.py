"""Qwen2.5-VL folders read as transformers 4 and 5 write them, and damaged ones refused in one sentence each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.loading.tokenizer import Tokenizer
from engine.model.config import ModelConfig
from engine.vision.model import load_vision
from engine.vision.qwen25vl import PictureShapeError
from tests.helpers.tiny_qwen25vl import make_tiny_qwen25vl
from tests.helpers.tiny_vision import edited_copy

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl"))


def load(path: Path) -> None:
    cfg = ModelConfig.from_file(path / "config.json")
    load_vision(path, Tokenizer.load(path), cfg.hidden_size, cfg.vocab_size)


def test_the_text_model_is_qwen2_with_its_mrope_sections(folder: Path) -> None:
    cfg = ModelConfig.from_file(folder / "config.json")
    assert (cfg.architecture, cfg.mrope_section, cfg.image_ids, cfg.qkv_bias) == (
        "Qwen2ForCausalLM",
        (2, 3, 3),
        True,
        True,
    )


def test_a_flat_transformers_4_config_reads_the_same(folder: Path) -> None:
    d = json.loads((folder / "config.json").read_text())
    text = d.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **d, "rope_theta": rope["rope_theta"]}
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    nested, old = (
        ModelConfig.from_dict(d | {"text_config": text | {"rope_parameters": rope}}),
        ModelConfig.from_dict(flat),
    )
    assert (old.architecture, old.mrope_section, old.rope_theta, old.rope_scaling) == (
        nested.architecture,
        nested.mrope_section,
        nested.rope_theta,
        nested.rope_scaling,
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [([2, 3, 4], "does not cover"), ([2, 3], "three whole numbers"), (None, "no mrope_section")],
)
def test_a_damaged_mrope_section_is_refused(
    folder: Path, tmp_path: Path, section: list[int] | None, message: str
) -> None:
    def change(d: dict[str, Any]) -> None:
        if section is None:
            del d["text_config"]["rope_parameters"]["mrope_section"]
        else:
            d["text_config"]["rope_parameters"]["mrope_section"] = section

    path = edited_copy(folder, tmp_path / "edited", "config.json", change)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_file(path / "config.json")


def test_a_processor_allowing_huge_pictures_is_refused(folder: Path, tmp_path: Path) -> None:
    path = edited_copy(
        folder,
        tmp_path / "edited",
        "processor_config.json",
        lambda d: d["image_processor"]["size"].update(longest_edge=10**12),
    )
    with pytest.raises(ModelLoadError, match="at most"):
        load(path)


def test_a_processor_whose_patches_do_not_fit_the_encoder_is_refused(folder: Path, tmp_path: Path) -> None:
    path = edited_copy(
        folder, tmp_path / "edited", "processor_config.json", lambda d: d["image_processor"].update(patch_size=4)
    )
    with pytest.raises(ModelLoadError, match="does not fit together"):
        load(path)


def test_an_encoder_narrower_than_the_text_model_is_refused(folder: Path, tmp_path: Path) -> None:
    path = edited_copy(
        folder, tmp_path / "edited", "config.json", lambda d: d["vision_config"].update(out_hidden_size=32)
    )
    with pytest.raises(ModelLoadError, match="does not fit together"):
        load(path)


def test_a_picture_too_elongated_for_the_processor_is_refused(folder: Path) -> None:
    cfg = ModelConfig.from_file(folder / "config.json")
    vision = load_vision(folder, Tokenizer.load(folder), cfg.hidden_size, cfg.vocab_size)
    with pytest.raises(PictureShapeError, match="elongated"):
        vision.preprocessing.frames(Image.new("RGB", (1000, 4)))


def test_weights_that_do_not_match_the_encoder_are_refused(folder: Path, tmp_path: Path) -> None:
    path = tmp_path / "edited"
    shutil.copytree(folder, path)
    state = load_file(path / "model.safetensors")
    del state["visual.merger.ln_q.weight"]
    state["visual.blocks.0.attn.qkv.weight"] = state["visual.blocks.0.attn.qkv.weight"][:-1]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"Vision tensor visual\.blocks\.0\.attn\.qkv\.weight has shape"):
        load(path)
    del state["visual.blocks.0.attn.qkv.weight"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lack visual\.blocks\.0\.attn\.qkv\.weight"):
        load(path)
