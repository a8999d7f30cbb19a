"""SmolVLM / Idefics3 against transformers on a tiny random checkpoint it wrote itself (model and processor): the
frames equal the processor's pixel values, the prompt ids its input ids, and greedy tokens its `generate`, fp32,
over 24 tokens, for a prompt with one picture and with two."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.vision.model import ImageEmbedding, VisionModel
from tests.helpers.hf_greedy import hf_vision_model, hf_vision_tokens
from tests.helpers.mmproj_refs import causal_greedy, our_prompt, ours_from_folder
from tests.helpers.pictures import CASES, picture, pictures_of
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

transformers = pytest.importorskip("transformers")
STEPS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def ours(folder: Path) -> tuple[Any, VisionModel]:
    return ours_from_folder(folder)


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    return hf_vision_model(transformers.Idefics3ForConditionalGeneration, folder)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(case: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    text, sizes = CASES[case]
    pictures = pictures_of(sizes)
    model, vision = ours
    hf_model, processor = theirs
    inputs = processor(text=text, images=[p.image for p in pictures], return_tensors="pt")

    ids, plain, frames = our_prompt(vision, text, pictures)
    pixels = np.concatenate([f.pixels for f in frames])
    assert np.array_equal(pixels, inputs["pixel_values"][0].numpy())
    assert plain == inputs["input_ids"][0].tolist()
    assert len(set(ids) - set(plain)) == sum(f.pixels.shape[0] for f in frames) * vision.preprocessing.image_seq_len

    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(hf_model, inputs, STEPS)


def test_same_picture_same_ids_other_picture_other_ids(ours: tuple[Any, VisionModel]) -> None:
    _, vision = ours
    text = "<image>hi"
    a = vision.encode_prompt(text, [picture(40, 24, 0)])
    b = vision.encode_prompt(text, [picture(40, 24, 0)])
    c = vision.encode_prompt(text, [picture(40, 24, 1)])
    assert a == b and a != c and len(a) == len(c)


def test_other_preprocessing_other_ids(ours: tuple[Any, VisionModel]) -> None:
    _, vision = ours
    pic = picture(40, 24, 0)
    frames = vision.preprocessing.frames(pic.image)
    a = ImageEmbedding(torch.nn.Embedding(4, 4), 360, vision.tower, "settings a").register(pic, frames, 4)
    b = ImageEmbedding(torch.nn.Embedding(4, 4), 360, vision.tower, "settings b").register(pic, frames, 4)
    assert len(set(a)) == 4 and not set(a) & set(b) and min(a + b) >= 360
