"""Random pictures for the image tests: PNG bytes, and the same decoded as the engine decodes them; and the prompts
the vision parity tests ask, with the sizes of their pictures."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from engine.vision.images import DecodedImage, decode_bytes


def png(w: int, h: int, seed: int) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a, "RGB").save(buf, "PNG")
    return buf.getvalue()


def picture(w: int, h: int, seed: int) -> DecodedImage:
    return decode_bytes(png(w, h, seed))


def pictures_of(sizes: list[tuple[int, int]]) -> list[DecodedImage]:
    """One picture per (width, height), seeded by its place."""
    return [picture(w, h, seed) for seed, (w, h) in enumerate(sizes)]


# A prompt with one picture and one with two (one wide, one small), the engine's <image> marking each.
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "one": ("<|user|>\n<image>What is in the picture?<|end|>\n<|assistant|>\n", [(40, 24)]),
    "two": ("<|user|>\n<image>and<image> which is wider?<|end|>\n<|assistant|>\n", [(60, 14), (10, 12)]),
}
