"""The app's icons, drawn with QPainter (original artwork, no assets to license).

`python -m app.misc.icons` regenerates the PNGs in resources/icons; the app loads those files. The tray icon is a
macOS *template* image (black on transparent; the name ends in "Template"), which the menu bar tints for light
and dark appearance.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QGuiApplication,
    QIcon,
    QImage,
    QLinearGradient,
    QPainter,
    QPainterPath,
    QPen,
    QRadialGradient,
)

from engine.paths import resources_dir

ICON_DIR_NAME = "icons"
APP_ICON = "spark.png"
TRAY_ICON = "sparkTemplate.png"
TRAY_ICON_2X = "sparkTemplate@2x.png"


def icons_dir() -> Path:
    return resources_dir() / ICON_DIR_NAME


def _sparkle(cx: float, cy: float, r: float, waist: float) -> QPainterPath:
    """A four-pointed star: long points at radius r, pinched to `waist` x r between them."""
    path = QPainterPath(QPointF(cx, cy - r))
    w = r * waist
    for tip, ctrl in (
        ((cx + r, cy), (cx + w, cy - w)),
        ((cx, cy + r), (cx + w, cy + w)),
        ((cx - r, cy), (cx - w, cy + w)),
        ((cx, cy - r), (cx - w, cy - w)),
    ):
        path.quadTo(QPointF(*ctrl), QPointF(*tip))
    return path


def draw_app_icon(size: int = 1024) -> QImage:
    img = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    s = float(size)
    # macOS icon grid: the rounded square fills ~80 % of the canvas, corner radius ~22.5 % of its side.
    inset = s * 0.1
    body = QRectF(inset, inset, s - 2 * inset, s - 2 * inset)
    bg = QLinearGradient(body.topLeft(), body.bottomRight())
    bg.setColorAt(0.0, QColor("#3b2f8f"))
    bg.setColorAt(1.0, QColor("#0f1b3d"))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(bg))
    p.drawRoundedRect(body, body.width() * 0.225, body.width() * 0.225)
    # Three memory tiers as nested arcs under the spark: working, episodic, persistent.
    cx, cy = s / 2, s * 0.47
    for i, color in enumerate(("#ffd166", "#f79d65", "#ef6f6c")):
        radius = s * (0.22 + 0.065 * i)
        pen = QPen(QColor(color), s * 0.028, Qt.PenStyle.SolidLine, Qt.PenCapStyle.RoundCap)
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        p.drawArc(QRectF(cx - radius, cy - radius, 2 * radius, 2 * radius), 200 * 16, 140 * 16)
    glow = QRadialGradient(QPointF(cx, cy), s * 0.22)
    glow.setColorAt(0.0, QColor(255, 236, 170, 150))
    glow.setColorAt(1.0, QColor(255, 236, 170, 0))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(glow))
    p.drawEllipse(QPointF(cx, cy), s * 0.22, s * 0.22)
    p.setBrush(QColor("#fff8e1"))
    p.drawPath(_sparkle(cx, cy, s * 0.17, 0.16))
    p.drawPath(_sparkle(cx + s * 0.17, cy - s * 0.15, s * 0.05, 0.2))
    p.end()
    return img


def draw_tray_template(size: int) -> QImage:
    img = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    img.fill(Qt.GlobalColor.transparent)
    p = QPainter(img)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QColor(0, 0, 0))
    s = float(size)
    p.drawPath(_sparkle(s * 0.44, s * 0.56, s * 0.4, 0.18))
    p.drawPath(_sparkle(s * 0.8, s * 0.2, s * 0.15, 0.22))
    p.end()
    return img


def app_icon() -> QIcon:
    return QIcon(str(icons_dir() / APP_ICON))


def tray_icon() -> QIcon:
    icon = QIcon(str(icons_dir() / TRAY_ICON))
    icon.addFile(str(icons_dir() / TRAY_ICON_2X))
    icon.setIsMask(True)  # macOS: a template image, tinted by the menu bar
    return icon


def main() -> int:
    app = QGuiApplication.instance() or QGuiApplication(sys.argv)
    out = icons_dir()
    out.mkdir(parents=True, exist_ok=True)
    draw_app_icon(1024).save(str(out / APP_ICON))
    draw_tray_template(22).save(str(out / TRAY_ICON))
    draw_tray_template(44).save(str(out / TRAY_ICON_2X))
    del app
    return 0


if __name__ == "__main__":
    sys.exit(main())
