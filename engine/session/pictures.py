"""A conversation's pictures in a `.spark` file, full or compact: each stored once, as its encoded bytes in a uint8
tensor named `image.<sha256>`, and `extra.images` listing the transcript's pictures by hash in the order of its
<image> markers (a picture shown twice is listed twice, stored once).

Read back, the pictures are hostile input like the rest: the list and the tensors must name each other exactly, each
picture's bytes must hash to its name, the count and the bytes are capped before anything is decoded, and decoding
is engine.vision.images' (its caps on dimensions and pixels). Every refusal is a `SchemaError` clause.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.errors import SessionFileError
from engine.memory.values import SchemaError
from engine.vision.images import MAX_IMAGE_BYTES, DecodedImage, ImageError, decode_bytes

IMAGE_PREFIX = "image."
MAX_SESSION_IMAGES = 256  # markers in one transcript
MAX_SESSION_IMAGE_BYTES = 256 * 2**20  # every distinct picture's bytes together
_SHA256 = re.compile(r"[0-9a-f]{64}")


def image_tensors(images: Sequence[DecodedImage]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The transcript's pictures -> (their hashes in order, one byte tensor per distinct picture); SessionFileError
    for a picture without its bytes."""
    order = [img.sha256 for img in images]
    if len(order) > MAX_SESSION_IMAGES:
        raise SessionFileError(
            f"The conversation shows {len(order)} pictures, more than the {MAX_SESSION_IMAGES} a file holds, "
            "so it cannot be saved."
        )
    tensors: dict[str, torch.Tensor] = {}
    for img in images:
        if not img.data or hashlib.sha256(img.data).hexdigest() != img.sha256:
            raise SessionFileError("A picture of this conversation lost its bytes, so it cannot be saved.")
        if IMAGE_PREFIX + img.sha256 not in tensors:
            tensors[IMAGE_PREFIX + img.sha256] = torch.frombuffer(bytearray(img.data), dtype=torch.uint8)
    total = sum(t.numel() for t in tensors.values())
    if total > MAX_SESSION_IMAGE_BYTES:
        raise SessionFileError(
            f"The conversation's pictures are {total // 2**20} MB, more than the {MAX_SESSION_IMAGE_BYTES // 2**20} MB "
            "a file holds, so it cannot be saved."
        )
    return order, tensors


def split_images(
    extra: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]
) -> tuple[list[DecodedImage], dict[str, torch.Tensor]]:
    """A file's pictures (checked and decoded, in marker order) and the rest of its tensors (the memory's)."""
    stored = {n[len(IMAGE_PREFIX) :]: t for n, t in tensors.items() if n.startswith(IMAGE_PREFIX)}
    rest = {n: t for n, t in tensors.items() if not n.startswith(IMAGE_PREFIX)}
    order = extra.get("images", [])
    if not isinstance(order, list) or not all(isinstance(h, str) and _SHA256.fullmatch(h) for h in order):
        raise SchemaError("has a malformed list of pictures")
    if len(order) > MAX_SESSION_IMAGES:
        raise SchemaError(f"lists {len(order)} pictures, more than the {MAX_SESSION_IMAGES} a conversation holds")
    if set(order) != set(stored):
        raise SchemaError("lists pictures it does not hold, or holds pictures it does not list")
    total = 0
    for t in stored.values():
        if t.dtype != torch.uint8 or t.ndim != 1:
            raise SchemaError("holds a picture that is not a run of bytes")
        if t.numel() > MAX_IMAGE_BYTES:
            raise SchemaError(
                f"holds a picture of {t.numel() // 2**20} MB; the limit for an image is {MAX_IMAGE_BYTES // 2**20} MB"
            )
        total += t.numel()
    if total > MAX_SESSION_IMAGE_BYTES:
        raise SchemaError(f"holds {total // 2**20} MB of pictures, more than {MAX_SESSION_IMAGE_BYTES // 2**20} MB")
    decoded: dict[str, DecodedImage] = {}
    for sha, t in stored.items():
        data = t.numpy().tobytes()
        if hashlib.sha256(data).hexdigest() != sha:
            raise SchemaError("holds a picture whose bytes do not match its hash")
        try:
            decoded[sha] = decode_bytes(data, f"picture {sha[:12]}")
        except ImageError as exc:
            raise SchemaError(f"holds a picture that cannot be used ({str(exc).rstrip('.')})") from None
    return [decoded[sha] for sha in order], rest
