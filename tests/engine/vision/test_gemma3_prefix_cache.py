"""A prefix restored from the cache that ends inside a Gemma 3 picture, read in chunks smaller than the picture:
the picture's first tokens were computed seeing all of it (read whole), and its tail is read in one forward seeing
them, so the answer is transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.generation.loop import GenerationSettings, PrefillProgress
from engine.generation.sampling import SamplingSettings
from engine.session.engine import Engine, load
from engine.vision.images import DecodedImage
from tests.helpers.pictures import picture
from tests.helpers.tiny_gemma3 import BOI, make_tiny_gemma3

transformers = pytest.importorskip("transformers")
STEPS = 12
SETTINGS = GenerationSettings(
    max_tokens=STEPS, ignore_eos=True, prefill_chunk=2, sampling=SamplingSettings(temperature=0.0)
)
FIRST = " Describe the picture: the quick brown fox jumps over the lazy dog, twice, in Python." * 2
SECOND = " Which colours are in it? Name them, then say which one covers the most of the picture, and why." * 2


def complete(engine: Engine, prompt: str, pic: DecodedImage) -> tuple[list[tuple[int, float]], int]:
    """(token, logprob) of each generated token, and the prompt tokens the prefix cache restored."""
    session = engine.new_session()
    seen: list[PrefillProgress] = []
    session.on_prefill = seen.append
    out = [(e.token, e.logprob or 0.0) for e in session.complete(prompt, SETTINGS, images=[pic]) if e.token is not None]
    return out, seen[-1].reused


def first_picture_token(engine: Engine, prompt: str, pic: DecodedImage) -> int:
    assert engine.vision is not None
    ids = engine.vision.encode_prompt(prompt, [pic])
    return next(i for i, t in enumerate(ids) if t >= engine.vision.vocab_size)


def test_a_prefix_ending_inside_a_picture_restores_exactly(tmp_path: Path) -> None:
    folder = make_tiny_gemma3(tmp_path / "gemma3")
    engine = load(folder, "cpu", cache_dir=tmp_path / "cache")
    pic = picture(40, 24, 3)
    block = 32  # the cascade's block: the prefix cache keeps whole blocks
    lead = next("a" * k for k in range(64) if first_picture_token(engine, "a" * k + "<image>", pic) == block - 2)
    complete(engine, lead + "<image>" + FIRST, pic)  # stores the blocks; the picture spans [30, 34)
    ours, reused = complete(engine, lead + "<image>" + SECOND, pic)
    assert reused == block  # the first block only: the second holds the picture's tail and another question

    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    inputs = processor(text=lead + BOI + SECOND, images=[pic.image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    n = inputs["input_ids"].shape[1]
    assert [t for t, _ in ours] == out.sequences[0, n:].tolist()
    first = torch.log_softmax(out.logits[0][0].float(), -1)[out.sequences[0, n]]
    assert abs(ours[0][1] - float(first)) < 1e-4  # the slot table holds fp16 keys and values: ~5e-5 here
