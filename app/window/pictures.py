"""Pictures in the window: which files are pictures, a thumbnail chip for one waiting in the composer (✕ removes
it), clipboard image data as PNG bytes, and the small window a thumbnail in the transcript opens. Decoding and its
limits are the engine's (engine.vision.images): what is shown here was accepted there first."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QSize, Qt, Signal
from PySide6.QtGui import QGuiApplication, QImage, QKeySequence, QPixmap, QShortcut
from PySide6.QtWidgets import QDialog, QFrame, QHBoxLayout, QLabel, QToolButton, QVBoxLayout, QWidget

from engine import DecodedImage

PICTURE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif"})  # what the engine decodes
CHIP_SIDE = 44  # a chip's thumbnail, pixels (its longer side)
BUBBLE_SIDE = 160  # a thumbnail in a user's bubble
SCREEN_SHARE = 0.8  # an enlarged picture fits in this share of the screen


def is_picture(path: Path) -> bool:
    return path.suffix.lower() in PICTURE_SUFFIXES


def picture_pixmap(data: bytes) -> QPixmap:
    """The encoded bytes as a pixmap (Qt decodes again only what the engine accepted; empty when Qt cannot)."""
    pixmap = QPixmap()
    pixmap.loadFromData(data)
    return pixmap


def thumbnail(data: bytes, side: int) -> QImage:
    """The picture at most `side` pixels on its longer side, its proportions kept."""
    image = QImage.fromData(data)
    if image.isNull():
        return image
    return image.scaled(
        QSize(side, side), Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation
    )


def image_png(image: QImage) -> bytes:
    """Clipboard image data (a screenshot copied) as PNG bytes, which the engine then decodes as any picture."""
    buffer = QBuffer()
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")  # type: ignore[call-overload]  # PySide takes the str its stubs omit
    return bytes(QByteArray(buffer.data()).data())


class PictureChip(QFrame):
    """A picture waiting in the composer: its thumbnail and ✕."""

    remove_clicked = Signal(object)  # the chip

    def __init__(self, picture: DecodedImage, name: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("attachmentChip")
        self.picture = picture
        self.name = name
        w, h = picture.size
        self.thumb = QLabel()
        self.thumb.setPixmap(QPixmap.fromImage(thumbnail(picture.data, CHIP_SIDE)))
        self.thumb.setAccessibleName(f"Picture {name}")
        self.setToolTip(f"{name}, {w}×{h} pixels: goes with your next message")
        self.remove = QToolButton()
        self.remove.setObjectName("attachmentChipRemove")
        self.remove.setText("✕")
        self.remove.setAutoRaise(True)
        self.remove.setCursor(Qt.CursorShape.PointingHandCursor)
        self.remove.setToolTip(f"Remove {name}")
        self.remove.setAccessibleName(f"Remove picture {name}")
        self.remove.clicked.connect(lambda: self.remove_clicked.emit(self))
        row = QHBoxLayout(self)
        row.setContentsMargins(4, 2, 4, 2)
        row.setSpacing(2)
        row.addWidget(self.thumb)
        row.addWidget(self.remove, 0, Qt.AlignmentFlag.AlignTop)


class PictureWindow(QDialog):
    """A picture from the transcript, enlarged: as large as it is, or as fits the screen; Escape or ⌘W closes it."""

    def __init__(self, data: bytes, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Picture")
        self.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        pixmap = picture_pixmap(data)
        screen = QGuiApplication.primaryScreen()
        room = screen.availableSize() * SCREEN_SHARE if screen is not None else QSize(1024, 768)
        if pixmap.width() > room.width() or pixmap.height() > room.height():
            pixmap = pixmap.scaled(room, Qt.AspectRatioMode.KeepAspectRatio, Qt.TransformationMode.SmoothTransformation)
        self.label = QLabel()
        self.label.setPixmap(pixmap)
        self.label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.label)
        QShortcut(QKeySequence.StandardKey.Close, self, self.close)


def show_picture(parent: QWidget, data: bytes) -> PictureWindow:
    window = PictureWindow(data, parent)
    window.show()
    return window
