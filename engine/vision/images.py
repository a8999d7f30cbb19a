"""Images in: bytes, a file or a base64 string -> one RGB picture, every input treated as hostile.

Pillow decodes (no codec of ours); this module bounds what it may cost. Before a pixel is decoded the encoded size,
the format (PNG, JPEG, WebP, GIF only) and the header's dimensions are checked against our caps, and Pillow's own
decompression-bomb check is made an error rather than a warning. Then: an animated file gives its first frame,
EXIF orientation is applied, an embedded colour profile is converted to sRGB (a damaged profile is ignored: the
pixels as stored), 16-bit greyscale is scaled to 8 bits, palette and transparent pictures are composited on white
as transformers' processors do. Every refusal is one `ImageError` sentence.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from engine.errors import SparkError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # an encoded picture; a phone photo is a few MB
MAX_BASE64_CHARS = (MAX_IMAGE_BYTES + 2) // 3 * 4
MAX_SIDE = 16384  # pixels, either side
MAX_PIXELS = 50_000_000  # width x height, decoded: 150 MB as RGB at most


class ImageError(SparkError):
    """A picture that cannot be read, or that is larger than the engine accepts."""


@dataclass(frozen=True)
class DecodedImage:
    """One picture as RGB, with the SHA-256 of the bytes it came from (the prefix cache and session files key on
    it), how many frames the file held (only the first is used) and the bytes themselves (what a session file
    stores)."""

    image: Image.Image
    sha256: str
    frames: int = 1
    data: bytes = field(default=b"", repr=False)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        w, h = self.image.size
        return w, h


def decode_base64(text: str, name: str = "The image") -> DecodedImage:
    """A base64 string (optionally a `data:image/...;base64,` URL) -> the picture; the length is checked first."""
    if len(text) > MAX_BASE64_CHARS + 256:  # a data URL's header is short
        raise ImageError(
            f"{name} is {len(text) // 1_000_000} MB of base64; the limit is {MAX_IMAGE_BYTES // 2**20} MB."
        )
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
            raise ImageError(f"{name} is a data URL that is not a base64 image.")
    try:
        data = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{name} is not valid base64.") from None
    return decode_bytes(data, name)


def decode_file(path: str | Path) -> DecodedImage:
    """A picture file -> the picture; its size is checked before it is read."""
    p = Path(path).expanduser()
    try:
        size = p.stat().st_size
        if size > MAX_IMAGE_BYTES:
            raise ImageError(
                f"{p.name} is {size // 2**20} MB; the limit for an image is {MAX_IMAGE_BYTES // 2**20} MB."
            )
        with p.open("rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ImageError(f"{p} cannot be read: {exc.strerror or exc}.") from None
    return decode_bytes(data, p.name)


def decode_bytes(data: bytes, name: str = "The image") -> DecodedImage:
    """Encoded bytes -> the picture as RGB. Bounded: the bytes, the header's dimensions and the decoded pixels."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"{name} is {len(data) // 2**20} MB; the limit for an image is {MAX_IMAGE_BYTES // 2**20} MB.")
    if not data:
        raise ImageError(f"{name} is empty.")
    digest = hashlib.sha256(data).hexdigest()
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            _check_dimensions(img.size, name)
            frames = int(getattr(img, "n_frames", 1))
            img.seek(0)  # an animation: its first frame
            img.load()
            _check_dimensions(img.size, name)
            rgb = _to_srgb(_to_rgb(ImageOps.exif_transpose(img)))
        except ImageError:
            raise
        except UnidentifiedImageError:
            raise ImageError(f"{name} is not a PNG, JPEG, WebP or GIF picture.") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise ImageError(f"{name} decodes to more pixels than the engine accepts (a decompression bomb).") from None
        except (OSError, ValueError, SyntaxError, EOFError, IndexError, struct.error):
            raise ImageError(f"{name} is truncated or damaged and cannot be decoded.") from None
    return DecodedImage(rgb, digest, frames, data)


def _check_dimensions(size: tuple[int, int], name: str) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ImageError(f"{name} has no pixels ({w}x{h}).")
    if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
        raise ImageError(
            f"{name} is {w}x{h} pixels; the engine accepts at most {MAX_SIDE} a side and "
            f"{MAX_PIXELS // 1_000_000} megapixels."
        )


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any mode -> RGB. 16- and 32-bit greyscale are scaled, not clipped; transparency goes onto white, as
    transformers' convert_to_rgb does (a model's processor sees the same pixels)."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(img, dtype=np.int64)
        top = 65535 if img.mode.startswith("I;16") or int(a.max(initial=0)) > 255 else 255
        grey = Image.fromarray((np.clip(a, 0, top) * 255 // top).astype(np.uint8), "L")
        return grey.convert("RGB")
    if img.mode == "F":
        a = np.nan_to_num(np.asarray(img, dtype=np.float32), nan=0.0, posinf=1.0, neginf=0.0)
        return Image.fromarray((np.clip(a, 0.0, 1.0) * 255).round().astype(np.uint8), "L").convert("RGB")
    if img.mode == "RGB":
        return img
    icc = img.info.get("icc_profile")
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    out = Image.alpha_composite(background, rgba).convert("RGB")
    if icc:
        out.info["icc_profile"] = icc
    return out


def _to_srgb(img: Image.Image) -> Image.Image:
    """An embedded ICC profile (Display P3 photos, Adobe RGB) converted to sRGB, the space the models were trained
    on; a profile Little CMS cannot read leaves the pixels as stored."""
    icc = img.info.get("icc_profile")
    if not icc or not isinstance(icc, bytes):
        return img
    try:
        source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        out = ImageCms.profileToProfile(img, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        return img
    assert out is not None  # inPlace=False returns the converted picture
    return out


# The four formats' signatures: a picture's bytes name their own type (what a data URL or an exported file says).
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def media_type(data: bytes) -> str:
    """The media type of a picture's encoded bytes (`image/png`, `image/jpeg`, `image/webp`, `image/gif`), read
    from its signature, never from a name; ImageError for bytes that are none of the four."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, kind in _SIGNATURES:
        if data.startswith(signature):
            return kind
    raise ImageError("The picture is not a PNG, JPEG, WebP or GIF picture.")
