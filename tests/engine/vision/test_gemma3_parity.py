"""Gemma 3 with vision against transformers on a tiny random checkpoint it wrote itself (model and processor): the
frame equals the processor's pixel values, the prompt ids its input ids, and greedy tokens its `generate`, fp32,
over 24 tokens, for a prompt with one picture and with two; the pictures' tokens attend to each other both ways
(without it the logits differ), and a conversation through the engine's front door, read in chunks smaller than a
picture, answers as transformers does, with a chat template that writes Gemma 3's own image marker too."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.generation.batch import generate_batch
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.engine import load
from engine.vision.model import VisionModel
from tests.helpers.hf_greedy import hf_vision_model, hf_vision_tokens
from tests.helpers.mmproj_refs import causal_greedy, our_prompt, ours_from_folder
from tests.helpers.pictures import CASES, picture, pictures_of
from tests.helpers.tiny_gemma3 import BOI, PARTS_TEMPLATE, TOKENS_PER_IMAGE, make_tiny_gemma3

transformers = pytest.importorskip("transformers")
STEPS = 24


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def ours(folder: Path) -> tuple[Any, VisionModel]:
    return ours_from_folder(folder)


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    return hf_vision_model(transformers.Gemma3ForConditionalGeneration, folder)


def their_inputs(processor: Any, text: str, sizes: list[tuple[int, int]]) -> Any:
    pictures = pictures_of(sizes)
    # Gemma3Processor's marker is <start_of_image>; ours, the engine's, is <image>.
    return processor(text=text.replace("<image>", BOI), images=[p.image for p in pictures], return_tensors="pt")


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(case: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    text, sizes = CASES[case]
    pictures = pictures_of(sizes)
    model, vision = ours
    hf_model, processor = theirs
    inputs = their_inputs(processor, text, sizes)

    ids, plain, frames = our_prompt(vision, text, pictures)
    pixels = np.concatenate([f.pixels for f in frames])
    assert np.array_equal(pixels, inputs["pixel_values"].numpy())
    assert plain == inputs["input_ids"][0].tolist()
    assert len(set(ids) - set(plain)) == len(pictures) * TOKENS_PER_IMAGE

    assert causal_greedy(model, vision, ids, STEPS) == hf_vision_tokens(hf_model, inputs, STEPS)


def test_a_pictures_tokens_attend_both_ways(ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    """Equal to transformers' logits with the pictures' runs open both ways; read causally, the picture's own
    positions (all but its last) and everything after them differ."""
    text, sizes = CASES["two"]
    model, vision = ours
    hf_model, processor = theirs
    inputs = their_inputs(processor, text, sizes)
    ids = vision.encode_prompt(text, pictures_of(sizes))
    with torch.no_grad():
        expected = hf_model(**inputs).logits[0]
        both_ways = model.forward_causal(torch.tensor([ids]))[0]
        model.config = dataclasses.replace(model.config, images_bidirectional=False)
        try:
            causal = model.forward_causal(torch.tensor([ids]))[0]
        finally:
            model.config = dataclasses.replace(model.config, images_bidirectional=True)
    first = next(i for i, t in enumerate(ids) if t >= vision.vocab_size)
    assert torch.allclose(both_ways, expected, atol=1e-4, rtol=0)
    assert torch.allclose(causal[:first], expected[:first], atol=1e-4, rtol=0)  # text before the picture
    assert (causal[first] - expected[first]).abs().max() > 1e-2


@pytest.mark.parametrize("chunk", [3, 256])
def test_chat_read_in_small_chunks_equals_transformers(folder: Path, tmp_path: Path, chunk: int) -> None:
    """Through Session and the memory cascade: a prefill chunk of 3 would cut each 4-token picture; the chunk grows
    to hold it, and the answer is transformers'."""
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    session = engine.new_session()
    sizes = [(40, 24), (60, 14)]
    settings = GenerationSettings(
        max_tokens=STEPS, ignore_eos=True, prefill_chunk=chunk, sampling=SamplingSettings(temperature=0.0)
    )
    pictures = pictures_of(sizes)
    tokens = [e.token for e in session.chat("Which is wider?", settings, images=pictures) if e.token is not None]
    rendered = session._render(add_generation_prompt=False)  # the prompt as fed: the reply's text follows it
    prompt = rendered[: rendered.rindex("<|assistant|>\n") + len("<|assistant|>\n")]

    model, processor = hf_vision_model(transformers.Gemma3ForConditionalGeneration, folder)
    inputs = processor(
        text=prompt.replace("<image>", BOI),
        images=[p.image for p in pictures],
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert tokens == hf_vision_tokens(model, inputs, STEPS)


def test_a_template_writing_gemmas_marker_places_the_pictures_as_transformers(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Gemma 3's template reads content as parts and writes <start_of_image> for a picture: the session takes it as
    the picture's place, and the prompt and answer are what transformers' processor makes of the same messages."""
    folder = make_tiny_gemma3(tmp_path_factory.mktemp("gemma3_parts"), chat_template=PARTS_TEMPLATE)
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    pictures = [picture(40, 24, 0), picture(60, 14, 1)]
    settings = GenerationSettings(max_tokens=STEPS, ignore_eos=True, sampling=SamplingSettings(temperature=0.0))
    session = engine.new_session()
    tokens = [e.token for e in session.chat("Which is wider?", settings, images=pictures) if e.token is not None]

    model, processor = hf_vision_model(transformers.Gemma3ForConditionalGeneration, folder)
    parts = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Which is wider?"}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    assert text.count(BOI) == 2
    inputs = processor(text=text, images=[p.image for p in pictures], return_tensors="pt", add_special_tokens=False)
    assert tokens == hf_vision_tokens(model, inputs, STEPS)


def test_batched_rows_read_in_small_chunks_equal_transformers(
    folder: Path, tmp_path: Path, theirs: tuple[Any, Any]
) -> None:
    """The server's path: rows of one slot table (padded, each with its own chunks) read each picture whole."""
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    assert engine.vision is not None
    hf_model, processor = theirs
    prompts, expected = [], []
    for text, sizes in (CASES["two"], CASES["one"]):
        pictures = pictures_of(sizes)
        prompts.append(engine.vision.encode_prompt(text, pictures))
        inputs = their_inputs(processor, text, sizes)
        expected.append(hf_vision_tokens(hf_model, inputs, STEPS))
    settings = GenerationSettings(
        max_tokens=STEPS, ignore_eos=True, prefill_chunk=3, sampling=SamplingSettings(temperature=0.0)
    )
    got = generate_batch(engine.backend.fork(), engine.tokenizer, prompts, settings)
    assert [c.tokens for c in got] == expected
