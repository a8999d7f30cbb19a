"""Qwen2.5-VL from a GGUF (llama.cpp's `qwen2vl` text model: Qwen2 with its multimodal rotary sections) and its
llama.cpp mmproj (`qwen2.5vl_merger`), exported from the tiny checkpoint transformers wrote: the patches and grids
equal the processor's at clip.cpp's picture sizes (8 to 4096 merged tokens), the ids its input ids, and greedy tokens
its `generate` over 24 tokens with one picture and with two (an f32 export exactly; a Q8_0 text model with an f16
mmproj against transformers running the very weights the files store); the rotary sections survive the file; a
damaged section key is one sentence; through the engine's front door the GGUF answers as the folder does, and a
conversation saved to a session file continues in another engine exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import ModelLoadError
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.gguf import GGUFModel
from engine.loading.weights import load_model
from engine.session.engine import load
from engine.vision.gguf_vision import QWEN_MAX_TOKENS, QWEN_MIN_TOKENS
from engine.vision.qwen25vl import Qwen25VLPreprocessing
from tests.helpers.gguf_files import rewritten
from tests.helpers.hf_greedy import hf_vision_tokens
from tests.helpers.mmproj_refs import EXPORTS, causal_greedy, exported, on_stored_weights, our_prompt, ours_from_gguf
from tests.helpers.pictures import CASES, picture, pictures_of
from tests.helpers.tiny_qwen25vl import MERGE, PATCH, image_only_processor, make_tiny_qwen25vl

transformers = pytest.importorskip("transformers")
STEPS = 24
MARKED = "<|vision_start|><|image_pad|><|vision_end|>"
SECTIONS_KEY = "qwen2vl.rope.dimension_sections"
# CASES: the second picture of "two" is under clip.cpp's 8 merged tokens: enlarged, as the processor does at that
# minimum.


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen25vl(tmp_path_factory.mktemp("qwen25vl") / "QwenTiny")


@pytest.fixture(scope="module")
def exports(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    return exported(folder, tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = image_only_processor().from_pretrained(folder)
    area = (PATCH * MERGE) ** 2  # clip.cpp's limits, not the folder's own
    image = processor.image_processor
    image.min_pixels = image.max_pixels = None  # the size below rules (transformers' deprecated pair unset)
    image.size = {"shortest_edge": QWEN_MIN_TOKENS * area, "longest_edge": QWEN_MAX_TOKENS * area}
    return model, processor


def with_sections(path: Path, out: Path, sections: list[int]) -> Path:
    """A copy of the GGUF at `path` whose rotary sections are `sections`."""
    return rewritten(path, out, values={SECTIONS_KEY: sections})


def test_text_model_keeps_the_rotary_sections(folder: Path, exports: dict[str, tuple[Path, Path]]) -> None:
    gguf = GGUFModel(exports["f32"][0])
    assert gguf.architecture == "qwen2vl"
    assert list(gguf.metadata[SECTIONS_KEY]) == [2, 3, 3, 0]  # llama.cpp's four: (t, h, w) and an empty one
    assert gguf.config.mrope_section == load_model(folder).config.mrope_section == (2, 3, 3)


@pytest.mark.parametrize(
    ("sections", "match"),
    [([2, 3, 3], "as four whole numbers"), ([2, 3, 2, 1], "do not split"), ([2, 3, 4, 0], "do not split")],
)
def test_damaged_sections_are_one_sentence(
    sections: list[int], match: str, exports: dict[str, tuple[Path, Path]], tmp_path: Path
) -> None:
    damaged = with_sections(exports["f32"][0], tmp_path / "damaged.gguf", sections)
    with pytest.raises(ModelLoadError, match=match):
        _ = GGUFModel(damaged).config


def test_preprocessing_from_the_clip_keys(exports: dict[str, tuple[Path, Path]]) -> None:
    _, vision = ours_from_gguf(*exports["f32"])
    pre = vision.preprocessing
    assert isinstance(pre, Qwen25VLPreprocessing)
    area = (PATCH * MERGE) ** 2
    assert (pre.patch, pre.merge, pre.temporal) == (PATCH, MERGE, 2)
    assert (pre.min_pixels, pre.max_pixels) == (QWEN_MIN_TOKENS * area, QWEN_MAX_TOKENS * area)


@pytest.mark.parametrize("kind", sorted(EXPORTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(
    kind: str, case: str, exports: dict[str, tuple[Path, Path]], theirs: tuple[Any, Any]
) -> None:
    text_file, mmproj = exports[kind]
    prompt, sizes = CASES[case]
    pictures = pictures_of(sizes)
    model, vision = ours_from_gguf(text_file, mmproj)
    hf_model, processor = theirs
    if kind != "f32":
        hf_model = on_stored_weights(hf_model, text_file, mmproj, "model.language_model.", "model.")
    inputs = processor(text=prompt.replace("<image>", MARKED), images=[p.image for p in pictures], return_tensors="pt")

    ids, plain, frames = our_prompt(vision, prompt, pictures)
    pixels = np.concatenate([f.pixels.reshape(-1, f.pixels.shape[-1]) for f in frames])
    assert np.array_equal(pixels, inputs["pixel_values"].numpy())
    assert [[1, f.rows * MERGE, f.cols * MERGE] for f in frames] == inputs["image_grid_thw"].tolist()
    assert plain == inputs["input_ids"][0].tolist()  # the GGUF's vocabulary tokenizes as the folder's

    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(hf_model, inputs, STEPS)


def test_front_door_answers_as_the_folder(folder: Path, exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """The mmproj found beside the GGUF; the slot table turning each token by its multimodal offsets."""
    settings = GenerationSettings(max_tokens=STEPS, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    pictures = [picture(40, 24, 0), picture(60, 14, 1)]  # inside both the folder's and clip.cpp's sizes
    replies = []
    for model in (folder, exports["f32"][0]):
        engine = load(model, "cpu", cache_dir=tmp_path / model.name)
        assert engine.vision is not None and engine.choice.backend.config.mrope_section == (2, 3, 3)
        session = engine.new_session()
        replies.append([e.token for e in session.chat("Which one?", settings, images=pictures) if e.token is not None])
    assert engine.mmproj == exports["f32"][1]
    assert replies[0] == replies[1] and len(replies[0]) == STEPS


def test_session_file_restores_and_continues(exports: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    """Another engine holds no picture: the restored conversation's offsets come from its ids and pictures alone."""
    settings = GenerationSettings(max_tokens=6, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    text_file = exports["q8_0"][0]
    session = load(text_file, "cpu", prefix_cache=False).new_session()
    list(session.chat("What is it?", settings, images=[picture(40, 24, 3)]))
    path = tmp_path / "pictures.spark"
    session.save(path)
    expected = [e.token for e in session.chat("And now?", settings) if e.token is not None]

    restored = load(text_file, "cpu", prefix_cache=False).new_session()
    assert restored.load(path).applied
    assert [e.token for e in restored.chat("And now?", settings) if e.token is not None] == expected
