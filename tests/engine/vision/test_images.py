"""engine.vision.images: pictures decoded as RGB, hostile ones refused in one sentence."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageCms

from engine.vision import images
from engine.vision.images import ImageError, decode_base64, decode_bytes, decode_file


def encode(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def gradient(w: int = 24, h: int = 16) -> Image.Image:
    a = np.zeros((h, w, 3), np.uint8)
    a[..., 0] = np.arange(w)[None, :] * 10
    a[..., 1] = np.arange(h)[:, None] * 15
    a[..., 2] = 128
    return Image.fromarray(a, "RGB")


@pytest.mark.parametrize("fmt", ["PNG", "WEBP", "GIF"])
def test_lossless_formats_round_trip(fmt: str) -> None:
    src = gradient() if fmt != "GIF" else gradient().quantize(256).convert("RGB")
    out = decode_bytes(encode(src, fmt, **({"lossless": True} if fmt == "WEBP" else {})))
    assert out.image.mode == "RGB" and out.size == (24, 16)
    assert np.array_equal(np.asarray(out.image), np.asarray(src))


def test_jpeg_decodes_and_hash_is_of_the_bytes() -> None:
    data = encode(gradient(), "JPEG", quality=95)
    a, b = decode_bytes(data), decode_bytes(data)
    assert a.size == (24, 16) and a.sha256 == b.sha256 and len(a.sha256) == 64
    assert decode_bytes(encode(gradient(25, 16), "JPEG")).sha256 != a.sha256


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_truncated_files_are_one_sentence(fmt: str) -> None:
    data = encode(gradient(64, 64), fmt)
    with pytest.raises(ImageError, match=r"truncated or damaged|not a PNG"):
        decode_bytes(data[: len(data) // 2])


def test_garbage_and_other_formats_refused() -> None:
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        decode_bytes(b"\x00" * 100)
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        decode_bytes(encode(gradient(), "BMP"))
    with pytest.raises(ImageError, match="empty"):
        decode_bytes(b"")


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims w x h and whose data is a few compressed zero rows: a decompression bomb's shape."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 1000))
        + chunk(b"IEND", b"")
    )


def test_absurd_dimensions_refused_before_decoding() -> None:
    with pytest.raises(ImageError, match="at most 16384 a side"):
        decode_bytes(png_header_only(100_000, 10))
    with pytest.raises(ImageError, match="megapixels"):
        decode_bytes(png_header_only(9_000, 9_000))  # under Pillow's limit, over ours


def test_pillow_bomb_check_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Our own caps raised out of the way, Pillow's limit lowered: its warning must become the refusal.
    monkeypatch.setattr(images, "MAX_PIXELS", 10**12)
    monkeypatch.setattr(images, "MAX_SIDE", 10**6)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="decompression bomb"):
        decode_bytes(encode(gradient(20, 20), "PNG"))


def test_animated_gif_gives_its_first_frame() -> None:
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=100, loop=0)
    out = decode_bytes(data)
    assert out.frames == 2
    assert np.asarray(out.image)[0, 0].tolist() == [255, 0, 0]


def test_exif_orientation_is_honoured() -> None:
    img = gradient(24, 16)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    out = decode_bytes(encode(img, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (16, 24)


def test_sixteen_bit_greyscale_is_scaled_not_clipped() -> None:
    a = np.array([[0, 32768, 65535]], dtype=np.uint16)
    out = decode_bytes(encode(Image.fromarray(a), "PNG"))
    assert np.asarray(out.image)[0, :, 0].tolist() == [0, 127, 255]


def test_palette_with_transparency_goes_onto_white() -> None:
    p = Image.new("P", (4, 4), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    p.putpixel((0, 0), 1)
    data = encode(p, "PNG", transparency=0)
    out = np.asarray(decode_bytes(data).image)
    assert out[0, 0].tolist() == [255, 0, 0] and out[1, 1].tolist() == [255, 255, 255]


def test_colour_profile_converted_and_damaged_profile_ignored() -> None:
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
    # A picture tagged sRGB stays as it is; one with a damaged profile decodes as stored.
    data = encode(gradient(), "PNG", icc_profile=srgb.tobytes())
    assert np.array_equal(np.asarray(decode_bytes(data).image), np.asarray(gradient()))
    data = encode(gradient(), "PNG", icc_profile=b"not a profile")
    assert np.array_equal(np.asarray(decode_bytes(data).image), np.asarray(gradient()))


def test_base64_limits_and_data_urls() -> None:
    data = encode(gradient(), "PNG")
    text = base64.b64encode(data).decode()
    assert decode_base64(text).size == (24, 16)
    assert decode_base64("data:image/png;base64," + text).sha256 == decode_bytes(data).sha256
    with pytest.raises(ImageError, match="MB of base64"):
        decode_base64("A" * 50_000_000)
    with pytest.raises(ImageError, match="not valid base64"):
        decode_base64("!!!!")
    with pytest.raises(ImageError, match="not a base64 image"):
        decode_base64("data:text/plain,hello")


def test_files_checked_for_size_and_existence(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "a.png").write_bytes(encode(gradient(), "PNG"))
    assert decode_file(folder / "a.png").size == (24, 16)
    with pytest.raises(ImageError, match="cannot be read"):
        decode_file(folder / "missing.png")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(ImageError, match="the limit for an image"):
        decode_file(folder / "a.png")
