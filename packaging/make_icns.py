"""Build the app's `.icns` from the 1024 px source PNG: `python packaging/make_icns.py SRC.png OUT.icns`.

On macOS `iconutil` packs an `.iconset` folder; elsewhere (and where iconutil is missing) a small writer packs
the same PNGs itself. An ICNS file is a big-endian container: b"icns" + total length, then entries of
4-byte type + length (header included) + data; since OS X 10.7 every entry may hold a plain PNG, so no
legacy RLE/mask encoding is needed. Resampling uses Qt (a dependency anyway), so both paths ship the same pixels.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
from PySide6.QtGui import QImage


class Slot(NamedTuple):
    ostype: bytes  # the ICNS entry type
    iconset_name: str  # the file name iconutil expects in an .iconset folder
    pixels: int


# Apple's iconset: 16..512 pt at 1x and 2x. The ICNS types are those iconutil itself writes for PNG data.
SLOTS: tuple[Slot, ...] = (
    Slot(b"icp4", "icon_16x16.png", 16),
    Slot(b"ic11", "icon_16x16@2x.png", 32),
    Slot(b"icp5", "icon_32x32.png", 32),
    Slot(b"ic12", "icon_32x32@2x.png", 64),
    Slot(b"ic07", "icon_128x128.png", 128),
    Slot(b"ic13", "icon_128x128@2x.png", 256),
    Slot(b"ic08", "icon_256x256.png", 256),
    Slot(b"ic14", "icon_256x256@2x.png", 512),
    Slot(b"ic09", "icon_512x512.png", 512),
    Slot(b"ic10", "icon_512x512@2x.png", 1024),
)
HEADER = struct.Struct(">4sI")


def _png_bytes(image: QImage) -> bytes:
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise RuntimeError("Qt could not encode a PNG")
    return bytes(data.data())


def _downscale(image: QImage, pixels: int) -> QImage:
    # Halve first, then one last smooth step: a single bilinear jump from 1024 to 16 px would alias badly.
    while image.width() >= 2 * pixels:
        image = image.scaled(
            image.width() // 2,
            image.height() // 2,
            Qt.AspectRatioMode.IgnoreAspectRatio,
            Qt.TransformationMode.SmoothTransformation,
        )
    if image.width() != pixels:
        image = image.scaled(
            pixels, pixels, Qt.AspectRatioMode.IgnoreAspectRatio, Qt.TransformationMode.SmoothTransformation
        )
    return image


def render_pngs(src: Path) -> dict[Slot, bytes]:
    """Every slot's PNG, downscaled from `src` (square, at least 1024 px)."""
    image = QImage(str(src))
    if image.isNull():
        raise ValueError(f"{src} is not a readable image")
    if image.width() != image.height() or image.width() < SLOTS[-1].pixels:
        raise ValueError(
            f"{src} is {image.width()}x{image.height()}; the icon source must be square, at least {SLOTS[-1].pixels} px"
        )
    return {slot: _png_bytes(_downscale(image, slot.pixels)) for slot in SLOTS}


def pack_icns(entries: Iterable[tuple[bytes, bytes]]) -> bytes:
    """An ICNS container of (4-byte type, payload) entries, in the given order."""
    body = bytearray()
    for ostype, payload in entries:
        if len(ostype) != 4:
            raise ValueError(f"ICNS types are 4 bytes, got {ostype!r}")
        body += HEADER.pack(ostype, HEADER.size + len(payload)) + payload
    return HEADER.pack(b"icns", HEADER.size + len(body)) + bytes(body)


def _iconutil(pngs: dict[Slot, bytes], out: Path, iconutil: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        iconset = Path(tmp) / "spark.iconset"
        iconset.mkdir()
        for slot, data in pngs.items():
            (iconset / slot.iconset_name).write_bytes(data)
        subprocess.run([iconutil, "--convert", "icns", "--output", str(out), str(iconset)], check=True)


def build_icns(src: Path, out: Path, *, use_iconutil: bool = True) -> Path:
    """Write `out` from `src` (iconutil when asked and present, else the built-in writer) and return it."""
    pngs = render_pngs(src)
    out.parent.mkdir(parents=True, exist_ok=True)
    iconutil = shutil.which("iconutil") if use_iconutil else None
    if iconutil:
        _iconutil(pngs, out, iconutil)
    else:
        out.write_bytes(pack_icns((slot.ostype, data) for slot, data in pngs.items()))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python packaging/make_icns.py SRC.png OUT.icns", file=sys.stderr)
        return 2
    out = build_icns(Path(argv[0]), Path(argv[1]))
    print(f"{out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
