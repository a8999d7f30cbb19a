"""A vision-language folder whose parts do not fit together, or whose settings are damaged, is one sentence at
load: never a shape error mid-answer."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.errors import ModelLoadError
from engine.loading.tokenizer import Tokenizer
from engine.vision.model import is_vision_folder, load_vision
from tests.helpers.tiny_idefics3 import make_tiny_idefics3
from tests.helpers.tiny_vision import edited_copy


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


def seq_len(d: dict[str, Any]) -> None:
    d["image_seq_len"] = 9


def frame(d: dict[str, Any]) -> None:
    d["image_processor"]["max_image_size"]["longest_edge"] = 32


def too_many_tiles(d: dict[str, Any]) -> None:
    d["image_processor"]["size"]["longest_edge"] = 4096
    d["image_processor"]["max_image_size"]["longest_edge"] = 16


def std_zero(d: dict[str, Any]) -> None:
    d["image_processor"]["image_std"] = [0, 0, 0]


def patch(d: dict[str, Any]) -> None:
    d["vision_config"]["patch_size"] = 5


def width(d: dict[str, Any]) -> None:
    d["vision_config"]["hidden_size"] = 48


def act(d: dict[str, Any]) -> None:
    d["vision_config"]["hidden_act"] = "relu"


CASES = [
    ("processor_config.json", seq_len, "image tokens a frame"),
    ("processor_config.json", frame, "pixel frames"),
    ("processor_config.json", too_many_tiles, "more tiles than its tokenizer names"),
    ("processor_config.json", std_zero, "out of range"),
    ("config.json", patch, "do not divide"),
    ("config.json", width, "has shape"),
    ("config.json", act, "activation 'relu'"),
]


@pytest.mark.parametrize(("name", "change", "words"), CASES, ids=[c[1].__name__ for c in CASES])
def test_damaged_folders_are_one_sentence(
    pristine: Path, tmp_path: Path, name: str, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    folder = edited_copy(pristine, tmp_path / "m", name, change)
    assert is_vision_folder(folder)
    with pytest.raises(ModelLoadError, match=words):
        load_vision(folder, Tokenizer.load(folder), 64, 360)


def test_processor_settings_that_are_not_json(pristine: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(pristine, folder)
    (folder / "processor_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_vision(folder, Tokenizer.load(folder), 64, 360)
