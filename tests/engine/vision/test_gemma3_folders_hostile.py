"""A Gemma 3 folder whose vision parts do not fit together, or whose settings are damaged, is one sentence at load."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.loading.tokenizer import Tokenizer
from engine.vision.model import is_vision_folder, load_vision
from tests.helpers.tiny_gemma3 import make_tiny_gemma3
from tests.helpers.tiny_vision import edited_copy

HIDDEN, VOCAB = 64, 323


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


def seq_len(d: dict[str, Any]) -> None:
    d["image_seq_length"] = 9


def size(d: dict[str, Any]) -> None:
    d["image_processor"]["size"] = {"height": 64, "width": 64}


def not_square(d: dict[str, Any]) -> None:
    d["image_processor"]["size"] = {"height": 32, "width": 16}


def pan_and_scan(d: dict[str, Any]) -> None:
    d["image_processor"]["do_pan_and_scan"] = True


def std_nan(d: dict[str, Any]) -> None:
    d["image_processor"]["image_std"] = [0.5, float("nan"), 0.5]


def tokens_not_square(d: dict[str, Any]) -> None:
    d["mm_tokens_per_image"] = 8


def tokens_not_dividing(d: dict[str, Any]) -> None:
    d["mm_tokens_per_image"] = 9  # 3 x 3 over 8 x 8 patches


def width(d: dict[str, Any]) -> None:
    d["vision_config"]["hidden_size"] = 48


CASES = [
    ("processor_config.json", seq_len, "image tokens a frame"),
    ("processor_config.json", size, "pixel frames"),
    ("processor_config.json", not_square, "non-square"),
    ("processor_config.json", pan_and_scan, "pan-and-scan"),
    ("processor_config.json", std_nan, "out of range"),
    ("config.json", tokens_not_square, "not a square"),
    ("config.json", tokens_not_dividing, "not a square that divides"),
    ("config.json", width, "has shape"),
]


@pytest.mark.parametrize(("name", "change", "words"), CASES, ids=[c[1].__name__ for c in CASES])
def test_damaged_folders_are_one_sentence(
    pristine: Path, tmp_path: Path, name: str, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    folder = edited_copy(pristine, tmp_path / "m", name, change)
    assert is_vision_folder(folder)
    with pytest.raises(ModelLoadError, match=words):
        load_vision(folder, Tokenizer.load(folder), HIDDEN, VOCAB)


def test_a_projector_missing_or_not_finite(pristine: Path, tmp_path: Path) -> None:
    for change, words in (("drop", "lack multi_modal_projector"), ("nan", "NaN or infinite")):
        folder = tmp_path / change
        shutil.copytree(pristine, folder)
        state = load_file(folder / "model.safetensors")
        if change == "drop":
            del state["multi_modal_projector.mm_input_projection_weight"]
        else:
            state["multi_modal_projector.mm_soft_emb_norm.weight"][0] = float("nan")
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=words):
            load_vision(folder, Tokenizer.load(folder), HIDDEN, VOCAB)
