"""The look: one designed palette for light and one for dark mode, following the system's choice (and its
changes) or View ▸ Appearance, and the style sheet that reads its colours from them. The rules (spacing, type,
colours, radii, icons) are written down in docs/DESIGN.md ("The look"); the figures live here and in the sheet.

The style sheet (resources/style/spark.qss) names colours as `@name@`; each scheme fills them in, and the same
colours become the application palette, so widgets the sheet does not touch (menus, dialogs) match. On macOS the
native style draws the controls; the palette and sheet only colour the app's own surfaces. CONTRAST_PAIRS lists
every text-on-surface pair the sheet and the chat draw; a test holds each to WCAG's 4.5:1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication, QWidget

from engine.paths import resources_dir

STYLE_SHEET = "style/spark.qss"

# The spacing scale (px): every margin and gap is one of these.
SPACE = (4, 8, 12, 16, 24, 32)
# The type scale (px): the chat's body and the composer 15, secondary text 13, captions 12, headings 17, the empty
# chat's greeting 24.
BODY_PX, SECONDARY_PX, CAPTION_PX, HEADING_PX, GREETING_PX = 15, 13, 12, 17, 24
# Radii (px): controls 8, fields and code 10, message bubbles and cards 16, the composer 20.
RADIUS_CONTROL, RADIUS_FIELD, RADIUS_BUBBLE, RADIUS_COMPOSER = 8, 10, 16, 20
READING_COLUMN_PX = 720  # the chat's text column; wider windows centre it


class Scheme(Enum):
    LIGHT = "light"
    DARK = "dark"


@dataclass(frozen=True)
class Colours:
    window: str  # sidebar, inspector, toolbar
    base: str  # the chat, fields
    text: str
    dim: str  # secondary text: dates, notes, labels
    accent: str  # links, focus, the send button
    accent_text: str  # text on the accent
    selection: str  # the sidebar's selected row
    bubble: str  # the user's messages: base with 16 % of the accent (the chat mixes it from the palette)
    bubble_text: str
    code: str  # code blocks, inline code
    border: str
    info: str  # the notice bar
    info_text: str
    error: str
    error_text: str


LIGHT = Colours(
    window="#f3f3f5",
    base="#ffffff",
    text="#1d1d1f",
    dim="#636368",
    accent="#0a66d9",
    accent_text="#ffffff",
    selection="#dce6f7",
    bubble="#d8e6f9",
    bubble_text="#1d1d1f",
    code="#f4f4f6",
    border="#d9d9de",
    info="#e8f1fd",
    info_text="#0b4a8b",
    error="#fdecea",
    error_text="#8a1c14",
)
DARK = Colours(
    window="#232326",
    base="#1b1b1d",
    text="#ececf0",
    dim="#98989f",
    accent="#4c9bff",
    accent_text="#0b1a2e",
    selection="#2f3f58",
    bubble="#233041",
    bubble_text="#ececf0",
    code="#2a2a2e",
    border="#3a3a3f",
    info="#1d3350",
    info_text="#cfe3ff",
    error="#4a1f1c",
    error_text="#ffd7d2",
)


# (foreground, background) colour names of every text the app draws on a surface of its own.
CONTRAST_PAIRS = (
    ("text", "base"),
    ("text", "window"),
    ("dim", "base"),
    ("dim", "window"),
    ("dim", "code"),
    ("text", "code"),
    ("text", "selection"),
    ("accent", "base"),
    ("accent_text", "accent"),
    ("bubble_text", "bubble"),
    ("info_text", "info"),
    ("error_text", "error"),
    ("error_text", "base"),
)


def luminance(colour: str) -> float:
    """WCAG 2's relative luminance of a #rrggbb colour."""

    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    q = QColor(colour)
    return 0.2126 * channel(q.redF()) + 0.7152 * channel(q.greenF()) + 0.0722 * channel(q.blueF())


def contrast(a: str, b: str) -> float:
    """WCAG 2's contrast ratio of two colours (1 to 21)."""
    la, lb = sorted((luminance(a), luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def points(widget: QWidget, px: float) -> float:
    """`px` pixels as the point size a widget's font takes on its screen (15 px is 15 pt on a Mac, 11.25 elsewhere)."""
    return px * 72.0 / max(1, widget.logicalDpiY())


def system_scheme() -> Scheme:
    hints = QGuiApplication.styleHints()
    return Scheme.DARK if hints.colorScheme() == Qt.ColorScheme.Dark else Scheme.LIGHT


def palette_for(c: Colours) -> QPalette:
    p = QPalette()
    role = QPalette.ColorRole
    for r, value in (
        (role.Window, c.window),
        (role.Base, c.base),
        (role.AlternateBase, c.code),
        (role.Text, c.text),
        (role.WindowText, c.text),
        (role.ButtonText, c.text),
        (role.Button, c.base),
        (role.PlaceholderText, c.dim),
        (role.Highlight, c.accent),
        (role.HighlightedText, c.accent_text),
        (role.Link, c.accent),
        (role.LinkVisited, c.accent),
        (role.ToolTipBase, c.base),
        (role.ToolTipText, c.text),
        (role.Mid, c.border),
        (role.Midlight, c.border),
    ):
        p.setColor(r, QColor(value))
    for r in (role.Text, role.WindowText, role.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, r, QColor(c.dim))
    return p


def style_sheet(c: Colours) -> str:
    sheet = (resources_dir() / STYLE_SHEET).read_text(encoding="utf-8")
    for name, value in asdict(c).items():
        sheet = sheet.replace(f"@{name}@", value)
    return sheet


def apply(app: QApplication, scheme: Scheme | None = None) -> Scheme:
    """Colour the app for `scheme` (None: the system's); returns the scheme applied."""
    scheme = scheme or system_scheme()
    colours = DARK if scheme is Scheme.DARK else LIGHT
    app.setPalette(palette_for(colours))
    app.setStyleSheet(style_sheet(colours))
    return scheme
