"""Gemma 3 from a GGUF (llama.cpp's `gemma3` text model of a Gemma3ForConditionalGeneration folder) and its llama.cpp
mmproj, exported from the tiny checkpoint transformers wrote: the frame equals the processor's pixel values, the ids
its input ids, and greedy tokens its `generate` over 24 tokens for a prompt with one picture and with two (an f32
export exactly; a Q8_0 text model with an f16 mmproj against transformers running the very weights the files
store); the loaded text model's pictures attend both ways, as the folder's do; through the engine's front door the
GGUF answers as the folder does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import load_model
from engine.session.engine import load
from engine.vision.gemma3 import Gemma3Preprocessing
from engine.vision.gguf_vision import attach_mmproj
from engine.vision.model import VisionModel
from tests.helpers.hf_greedy import hf_vision_model, hf_vision_tokens
from tests.helpers.mmproj_refs import EXPORTS, causal_greedy, exported, on_stored_weights, our_prompt
from tests.helpers.pictures import CASES, picture, pictures_of
from tests.helpers.tiny_gemma3 import BOI, IMAGE_SIZE, TOKENS_PER_IMAGE, make_tiny_gemma3

transformers = pytest.importorskip("transformers")
STEPS = 24


class _Backend:
    """What attach_mmproj reads of a backend: its model and config."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A Gemma 3 GGUF scales queries by head_dim**-0.5 (llama.cpp's constant): the checkpoint's scalar is the head width.
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "GemmaTiny", query_pre_attn_scalar=16)


@pytest.fixture(scope="module")
def exports(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return exported(folder, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    return hf_vision_model(transformers.Gemma3ForConditionalGeneration, folder)


def ours(text: Path, mmproj: Path) -> tuple[Any, VisionModel]:
    loaded = load_model(text)
    assert not loaded.config.images_bidirectional  # a GGUF's text config alone: the projector brings it
    backend = _Backend(loaded.model)
    vision = attach_mmproj(mmproj, Tokenizer.load(text), backend)
    assert backend.config.images_bidirectional and loaded.model.config.images_bidirectional
    assert backend.config.image_ids
    return loaded.model, vision


def test_preprocessing_from_the_clip_keys(exports: dict[str, tuple[Path, Path]]) -> None:
    _, vision = ours(*exports["f32"])
    pre = vision.preprocessing
    assert isinstance(pre, Gemma3Preprocessing)
    assert (pre.height, pre.width, pre.image_seq_len) == (IMAGE_SIZE, IMAGE_SIZE, TOKENS_PER_IMAGE)
    assert vision.tower.tokens_per_frame == TOKENS_PER_IMAGE


@pytest.mark.parametrize("kind", sorted(EXPORTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(
    kind: str, case: str, exports: dict[str, tuple[Path, Path]], theirs: tuple[Any, Any]
) -> None:
    text_file, mmproj = exports[kind]
    prompt, sizes = CASES[case]
    pictures = pictures_of(sizes)
    model, vision = ours(text_file, mmproj)
    hf_model, processor = theirs
    if kind != "f32":
        hf_model = on_stored_weights(hf_model, text_file, mmproj, "model.language_model.", "model.")
    inputs = processor(text=prompt.replace("<image>", BOI), images=[p.image for p in pictures], return_tensors="pt")

    ids, plain, frames = our_prompt(vision, prompt, pictures)
    assert np.array_equal(np.concatenate([f.pixels for f in frames]), inputs["pixel_values"].numpy())
    assert plain == inputs["input_ids"][0].tolist()  # the GGUF's vocabulary tokenizes as the folder's

    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(hf_model, inputs, STEPS)


def test_front_door_answers_as_the_folder(folder: Path, exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """The mmproj found beside the GGUF; the prompt fed by the generation loop, each picture's run in one forward."""
    settings = GenerationSettings(max_tokens=STEPS, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    pictures = [picture(40, 24, 0), picture(10, 12, 1)]
    replies = []
    for model in (folder, exports["f32"][0]):
        engine = load(model, "cpu", cache_dir=tmp_path / model.name)
        assert engine.vision is not None and engine.choice.backend.config.images_bidirectional
        session = engine.new_session()
        replies.append([e.token for e in session.chat("Which one?", settings, images=pictures) if e.token is not None])
    assert engine.mmproj == exports["f32"][1]
    assert replies[0] == replies[1] and len(replies[0]) == STEPS
