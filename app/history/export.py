"""A conversation exported for people and other programs: Markdown or JSON, its pictures included.

Markdown comes in two forms, as the save panel's format menu offers them. The default writes each picture once, as
its own file in a folder beside the text (`<name> pictures/<sha256[:12]>.<ext>`), linked where it sat in the message:
what Finder, a Markdown editor and a git repository all show. "Pictures inside" writes one file with each picture as
a data URL: larger, but nothing to keep together. JSON lists each picture once by its SHA-256 with its media type and
base64 bytes; a message that shows pictures has OpenAI-style content parts that name them.

A picture's file name comes from its hash and its type from its bytes' signature (never from a name the user's
picture came with); every picture was checked by the session file it was read from (its count and bytes capped
there). Pictures are written before the text that links them, each atomically; a file of the same name already in the
folder is left as it is when it holds the same bytes, and the export stops in one sentence, before writing anything,
when it holds others.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any
from urllib.parse import quote

from engine import IMAGE_TOKEN, DecodedImage, SparkError, atomic_write, media_type

PICTURES_SUFFIX = " pictures"  # the folder beside `<name>.md`: `<name> pictures`
NAME_CHARS = 12  # of the SHA-256 in a picture's file name (the whole hash where two pictures share them)
EXTENSIONS = {"image/png": "png", "image/jpeg": "jpg", "image/webp": "webp", "image/gif": "gif"}
LABELS = {"user": "You", "assistant": "Spark", "system": "System"}


class ExportForm(Enum):
    MARKDOWN = "md"  # pictures as files in a folder beside the text
    MARKDOWN_INLINE = "md-inline"  # one file, pictures inside it as data URLs
    JSON = "json"

    @property
    def suffix(self) -> str:
        return ".json" if self is ExportForm.JSON else ".md"


class ExportError(SparkError):
    """The export cannot be written where the user asked (one sentence; nothing of theirs was changed)."""


@dataclass(frozen=True)
class ExportMessage:
    role: str
    content: str  # with an IMAGE_TOKEN where each of `pictures` sits
    pictures: tuple[DecodedImage, ...] = ()


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the text file, and the pictures' folder with the files in it (none for a one-file
    form or a conversation without pictures)."""

    path: Path
    folder: Path | None = None
    pictures: tuple[Path, ...] = ()


def pictures_folder(path: Path) -> Path:
    """The folder beside an exported `<name>.md` that holds its pictures."""
    return path.with_name(path.stem + PICTURES_SUFFIX)


def export_conversation(
    path: Path, form: ExportForm, title: str, model: str, messages: Sequence[ExportMessage]
) -> Exported:
    """Write the conversation to `path` in `form`; ExportError (or OSError) with nothing written when it cannot."""
    if form is ExportForm.JSON:
        atomic_write(path, [export_json(title, model, messages).encode("utf-8")])
        return Exported(path)
    if form is ExportForm.MARKDOWN_INLINE:
        atomic_write(path, [export_markdown(title, messages, _data_url).encode("utf-8")])
        return Exported(path)
    folder = pictures_folder(path)
    pictures = _distinct(messages)
    names = file_names(pictures)
    if not names:
        atomic_write(path, [export_markdown(title, messages, lambda _: "").encode("utf-8")])
        return Exported(path)
    pending = _pictures_to_write(folder, pictures, names)  # every refusal comes before the first write
    folder.mkdir(exist_ok=True)
    for picture in pending:
        atomic_write(folder / names[picture.sha256], [picture.data])
    link_base = quote(folder.name) + "/"
    text = export_markdown(title, messages, lambda p: link_base + quote(names[p.sha256]))
    atomic_write(path, [text.encode("utf-8")])
    return Exported(path, folder, tuple(folder / names[sha] for sha in names))


def export_markdown(title: str, messages: Sequence[ExportMessage], link: Callable[[DecodedImage], str]) -> str:
    """The conversation as Markdown; `link(picture)` is where each picture's `![picture](…)` points."""
    parts = [f"# {title}", ""]
    for m in messages:
        parts += [f"**{LABELS.get(m.role, m.role.title())}:**", ""]
        for piece in _pieces(m):
            if isinstance(piece, DecodedImage):
                parts += [f"![picture]({link(piece)})", ""]
            elif piece.strip():
                parts += [piece.strip(), ""]
    return "\n".join(parts)


def export_json(title: str, model: str, messages: Sequence[ExportMessage]) -> str:
    """The conversation as JSON: `messages` (`role`, `content`: text, or parts where pictures sit) and `images`,
    each distinct picture once by hash."""
    rows: list[dict[str, Any]] = []
    for m in messages:
        if not m.pictures:
            rows.append({"role": m.role, "content": m.content})
            continue
        content = [
            {"type": "image", "sha256": piece.sha256}
            if isinstance(piece, DecodedImage)
            else {"type": "text", "text": piece}
            for piece in _pieces(m)
            if piece
        ]
        rows.append({"role": m.role, "content": content})
    images = [
        {
            "sha256": p.sha256,
            "media_type": media_type(p.data),
            "bytes": len(p.data),
            "data": base64.b64encode(p.data).decode("ascii"),
        }
        for p in _distinct(messages)
    ]
    data: dict[str, Any] = {"title": title, "model": model, "messages": rows}
    if images:
        data["images"] = images
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def file_names(pictures: Sequence[DecodedImage]) -> dict[str, str]:
    """Each distinct picture's file name by its hash: the hash's first NAME_CHARS characters and the extension its
    bytes call for; two pictures whose hashes begin alike (a made-up collision) both take their whole hash."""
    prefixes: dict[str, int] = {}
    for p in pictures:
        prefixes[p.sha256[:NAME_CHARS]] = prefixes.get(p.sha256[:NAME_CHARS], 0) + 1
    return {
        p.sha256: f"{p.sha256 if prefixes[p.sha256[:NAME_CHARS]] > 1 else p.sha256[:NAME_CHARS]}."
        f"{EXTENSIONS[media_type(p.data)]}"
        for p in pictures
    }


def _pictures_to_write(folder: Path, pictures: Sequence[DecodedImage], names: dict[str, str]) -> list[DecodedImage]:
    """The pictures not yet in `folder`; ExportError when the folder is something else (a file, a link) or holds
    another file under one of the names."""
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ExportError(f"“{folder.name}” beside the export is not a folder; choose another name for the export.")
    out = []
    for p in pictures:
        target = folder / names[p.sha256]
        if target.is_symlink() or target.exists():
            same = target.is_file() and not target.is_symlink() and target.stat().st_size == len(p.data)
            if same and target.read_bytes() == p.data:
                continue  # exported before: the same bytes
            raise ExportError(
                f"“{folder.name}” already holds another {target.name}; choose another name for the export."
            )
        out.append(p)
    return out


def _distinct(messages: Sequence[ExportMessage]) -> list[DecodedImage]:
    """The conversation's pictures, each once, in the order they first appear."""
    seen: dict[str, DecodedImage] = {}
    for m in messages:
        for p in m.pictures:
            seen.setdefault(p.sha256, p)
    return list(seen.values())


def _pieces(m: ExportMessage) -> list[str | DecodedImage]:
    """A message as its text and its pictures in order; a marker without a picture left is the user's own text."""
    out: list[str | DecodedImage] = []
    text = ""
    for k, piece in enumerate(m.content.split(IMAGE_TOKEN) if m.pictures else [m.content]):
        if k and k <= len(m.pictures):
            out += [text, m.pictures[k - 1]]
            text = ""
        elif k:
            text += IMAGE_TOKEN
        text += piece
    out.append(text)
    return out


def _data_url(picture: DecodedImage) -> str:
    return f"data:{media_type(picture.data)};base64,{base64.b64encode(picture.data).decode('ascii')}"
