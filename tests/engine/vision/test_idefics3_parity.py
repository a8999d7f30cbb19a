"""SmolVLM / Idefics3 against transformers on a tiny random checkpoint it wrote itself (model and processor): the
frames equal the processor's pixel values, the prompt ids its input ids, and greedy tokens its `generate`, fp32,
over 24 tokens, for a prompt with one picture and with two."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from engine.loading.tokenizer import Tokenizer
from engine.loading.weights import load_model
from engine.vision.images import DecodedImage, decode_bytes
from engine.vision.model import ImageEmbedding, VisionModel, load_vision
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

transformers = pytest.importorskip("transformers")
STEPS = 24


def picture(w: int, h: int, seed: int) -> DecodedImage:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a, "RGB").save(buf, "PNG")
    return decode_bytes(buf.getvalue())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def ours(folder: Path) -> tuple[Any, VisionModel]:
    loaded = load_model(folder)
    tok = Tokenizer.load(folder)
    vision = load_vision(folder, tok, loaded.config.hidden_size, loaded.config.vocab_size)
    vision.attach(loaded.model)
    return loaded.model, vision


@pytest.fixture(scope="module")
def theirs(folder: Path) -> tuple[Any, Any]:
    model = transformers.Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, transformers.AutoProcessor.from_pretrained(folder)


def our_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model.forward_causal(torch.tensor([ids + out]))
            out.append(int(logits[0, -1].argmax()))
    return out


CASES = {
    "one": ("<|user|>\n<image>What is in the picture?<|end|>\n<|assistant|>\n", [(40, 24)]),
    "two": ("<|user|>\n<image>and<image> which is wider?<|end|>\n<|assistant|>\n", [(60, 14), (10, 12)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers(case: str, ours: tuple[Any, VisionModel], theirs: tuple[Any, Any]) -> None:
    text, sizes = CASES[case]
    pictures = [picture(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    model, vision = ours
    hf_model, processor = theirs
    inputs = processor(text=text, images=[p.image for p in pictures], return_tensors="pt")

    expanded, frames = vision.prompt_text(text, pictures)
    pixels = np.concatenate([f.pixels for f in frames])
    assert np.array_equal(pixels, inputs["pixel_values"][0].numpy())
    ids = vision.image_ids(vision.tokenizer.encode(expanded), pictures, frames)
    plain = [vision.image_token_id if i >= vision.vocab_size else i for i in ids]
    assert plain == inputs["input_ids"][0].tolist()
    assert len(set(ids) - set(plain)) == sum(f.pixels.shape[0] for f in frames) * vision.preprocessing.image_seq_len

    with torch.no_grad():
        hf = hf_model.generate(
            **inputs, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    expected = hf[0, len(plain) :].tolist()
    assert our_greedy(model, ids, STEPS) == expected


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
