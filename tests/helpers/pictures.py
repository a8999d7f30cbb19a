"""Random pictures for the image tests: PNG bytes, and the same decoded as the engine decodes them."""

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
