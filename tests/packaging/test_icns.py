"""The pure-Python ICNS writer (the path every non-Mac build takes)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from tests.packaging.loader import REPO, load

make_icns = load("make_icns")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def parse_icns(data: bytes) -> list[tuple[bytes, bytes]]:
    """An independent reader: (type, payload) entries, checking every length on the way."""
    magic, total = struct.unpack_from(">4sI", data, 0)
    assert magic == b"icns"
    assert total == len(data)
    entries, pos = [], 8
    while pos < total:
        ostype, length = struct.unpack_from(">4sI", data, pos)
        assert length >= 8 and pos + length <= total, f"entry {ostype!r} overruns the file"
        entries.append((ostype, data[pos + 8 : pos + length]))
        pos += length
    assert pos == total
    return entries


def png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(PNG_SIGNATURE)
    assert png[12:16] == b"IHDR"  # the first chunk, right after the signature and its length
    return struct.unpack(">II", png[16:24])


def test_pack_icns_layout() -> None:
    data = make_icns.pack_icns([(b"ic07", b"abc"), (b"ic10", b"")])
    assert data == b"icns" + struct.pack(">I", 8 + 11 + 8) + b"ic07" + struct.pack(
        ">I", 11
    ) + b"abc" + b"ic10" + struct.pack(">I", 8)
    assert parse_icns(data) == [(b"ic07", b"abc"), (b"ic10", b"")]


def test_pack_icns_rejects_bad_type() -> None:
    with pytest.raises(ValueError, match="4 bytes"):
        make_icns.pack_icns([(b"ic7", b"x")])


def test_app_icon_has_every_size_as_png(tmp_path: Path) -> None:
    out = make_icns.build_icns(REPO / "resources" / "icons" / "spark.png", tmp_path / "spark.icns", use_iconutil=False)
    entries = parse_icns(out.read_bytes())
    assert [t for t, _ in entries] == [s.ostype for s in make_icns.SLOTS]
    for slot, (_, payload) in zip(make_icns.SLOTS, entries, strict=True):
        assert png_size(payload) == (slot.pixels, slot.pixels), slot
        assert not QImage.fromData(payload).isNull()
    # The ones Finder and the Dock need most: 128, 256, 512 and 1024 px (ic07-ic10).
    assert {b"ic07", b"ic08", b"ic09", b"ic10"} <= {t for t, _ in entries}


def test_iconset_names_follow_iconutil() -> None:
    for slot in make_icns.SLOTS:
        points = slot.pixels // 2 if "@2x" in slot.iconset_name else slot.pixels
        assert slot.iconset_name == f"icon_{points}x{points}{'@2x' if '@2x' in slot.iconset_name else ''}.png"


@pytest.mark.parametrize("size", [(512, 512), (1024, 512)])
def test_rejects_small_or_non_square_source(tmp_path: Path, size: tuple[int, int]) -> None:
    src = tmp_path / "src.png"
    img = QImage(*size, QImage.Format.Format_ARGB32)
    img.fill(0)
    assert img.save(str(src))
    with pytest.raises(ValueError, match="square"):
        make_icns.build_icns(src, tmp_path / "x.icns", use_iconutil=False)
