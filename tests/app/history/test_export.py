"""Exporting a conversation with pictures: Markdown writes each picture once in a folder beside the text (or inside
it as data URLs), JSON lists each once by hash with its media type and bytes; names come from the hash and the bytes'
own type, and a folder that already holds something else stops the export before anything is written."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from PIL import Image

from app.history.export import (
    ExportError,
    ExportForm,
    ExportMessage,
    export_conversation,
    file_names,
    pictures_folder,
)
from engine import IMAGE_TOKEN, DecodedImage, ImageError, decode_bytes, media_type
from tests.helpers.pictures import png

LINK = re.compile(r"!\[picture\]\(([^)]+)\)")


def encoded(fmt: str, seed: int) -> DecodedImage:
    """A random 12x10 picture encoded as `fmt` by Pillow."""
    buf = io.BytesIO()
    Image.open(io.BytesIO(png(12, 10, seed))).save(buf, fmt)
    return decode_bytes(buf.getvalue())


@pytest.fixture
def talk() -> tuple[list[ExportMessage], DecodedImage, DecodedImage]:
    a, b = decode_bytes(png(20, 16, 1)), encoded("JPEG", 2)
    messages = [
        ExportMessage("user", f"{IMAGE_TOKEN}{IMAGE_TOKEN}Which is brighter?", (a, b)),
        ExportMessage("assistant", "The first."),
        ExportMessage("user", f"{IMAGE_TOKEN}And this one again?", (a,)),
        ExportMessage("assistant", "Same as before."),
    ]
    return messages, a, b


def test_markdown_writes_each_picture_once_beside_it_and_links_it_where_it_sat(
    tmp_path: Path, talk: tuple[list[ExportMessage], DecodedImage, DecodedImage]
) -> None:
    messages, a, b = talk
    path = tmp_path / "Bright things.md"
    done = export_conversation(path, ExportForm.MARKDOWN, "Bright things", "SmolVLM", messages)
    folder = tmp_path / "Bright things pictures"
    assert done.folder == folder == pictures_folder(path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted([f"{a.sha256[:12]}.png", f"{b.sha256[:12]}.jpg"])  # a shown twice, stored once
    assert sorted(p.name for p in done.pictures) == names
    text = path.read_text()
    links = LINK.findall(text)
    assert len(links) == 3 and IMAGE_TOKEN not in text
    resolved = [(tmp_path / unquote(link)).read_bytes() for link in links]  # relative, percent-encoded links
    assert resolved == [a.data, b.data, a.data]
    last = text.rindex(links[2])  # the first picture again, in the second question
    assert text.index(links[1]) < text.index("Which is brighter?") < text.index("The first.") < last


def test_markdown_with_pictures_inside_is_one_file_of_data_urls(
    tmp_path: Path, talk: tuple[list[ExportMessage], DecodedImage, DecodedImage]
) -> None:
    messages, a, b = talk
    path = tmp_path / "one.md"
    done = export_conversation(path, ExportForm.MARKDOWN_INLINE, "One", "m", messages)
    assert done.folder is None and sorted(tmp_path.iterdir()) == [path]
    urls = LINK.findall(path.read_text())
    assert [u.split(",")[0] for u in urls] == [
        "data:image/png;base64",
        "data:image/jpeg;base64",
        "data:image/png;base64",
    ]
    assert [base64.b64decode(u.split(",")[1]) for u in urls] == [a.data, b.data, a.data]


def test_json_lists_each_picture_once_by_hash_and_the_messages_name_them_in_place(
    tmp_path: Path, talk: tuple[list[ExportMessage], DecodedImage, DecodedImage]
) -> None:
    messages, a, b = talk
    path = tmp_path / "talk.json"
    export_conversation(path, ExportForm.JSON, "Bright things", "SmolVLM", messages)
    data = json.loads(path.read_text())
    assert [(i["sha256"], i["media_type"], i["bytes"]) for i in data["images"]] == [
        (a.sha256, "image/png", len(a.data)),
        (b.sha256, "image/jpeg", len(b.data)),
    ]
    assert [base64.b64decode(i["data"]) for i in data["images"]] == [a.data, b.data]
    assert data["messages"][0]["content"] == [
        {"type": "image", "sha256": a.sha256},
        {"type": "image", "sha256": b.sha256},
        {"type": "text", "text": "Which is brighter?"},
    ]
    assert data["messages"][1] == {"role": "assistant", "content": "The first."}  # text alone stays a string
    assert sorted(tmp_path.iterdir()) == [path]


def test_a_conversation_without_pictures_exports_as_text_alone(tmp_path: Path) -> None:
    path = tmp_path / "plain.md"
    done = export_conversation(path, ExportForm.MARKDOWN, "Plain", "m", [ExportMessage("user", "Hello")])
    assert done.folder is None and sorted(tmp_path.iterdir()) == [path]
    assert path.read_text().startswith("# Plain") and "**You:**" in path.read_text()
    data = json.loads(export_json_text(tmp_path, [ExportMessage("user", "Hello")]))
    assert "images" not in data and data["messages"] == [{"role": "user", "content": "Hello"}]


def export_json_text(folder: Path, messages: list[ExportMessage]) -> str:
    path = folder / "x.json"
    export_conversation(path, ExportForm.JSON, "X", "m", messages)
    return path.read_text()


@pytest.mark.parametrize(("fmt", "ext", "kind"), [("GIF", "gif", "image/gif"), ("WEBP", "webp", "image/webp")])
def test_a_pictures_name_and_type_come_from_its_hash_and_its_bytes(
    tmp_path: Path, fmt: str, ext: str, kind: str
) -> None:
    pic = encoded(fmt, 3)
    assert file_names([pic]) == {pic.sha256: f"{pic.sha256[:12]}.{ext}"}
    path = tmp_path / "x.json"
    export_conversation(path, ExportForm.JSON, "X", "m", [ExportMessage("user", IMAGE_TOKEN, (pic,))])
    assert json.loads(path.read_text())["images"][0]["media_type"] == kind


def test_bytes_of_no_picture_type_have_no_media_type() -> None:
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF"):
        media_type(b"RIFF\0\0\0\0WAVE and not a picture")


def test_two_pictures_whose_hashes_begin_alike_take_their_whole_hashes() -> None:
    a, b = decode_bytes(png(8, 8, 4)), decode_bytes(png(8, 8, 5))
    clash = "0" * 12
    a = DecodedImage(a.image, clash + "a" * 52, 1, a.data)
    b = DecodedImage(b.image, clash + "b" * 52, 1, b.data)
    assert file_names([a, b]) == {a.sha256: f"{a.sha256}.png", b.sha256: f"{b.sha256}.png"}


def test_a_marker_with_no_picture_left_is_the_users_own_text(tmp_path: Path) -> None:
    pic = decode_bytes(png(8, 8, 6))
    path = tmp_path / "m.md"
    export_conversation(
        path, ExportForm.MARKDOWN, "M", "m", [ExportMessage("user", f"{IMAGE_TOKEN}I typed {IMAGE_TOKEN} here", (pic,))]
    )
    text = path.read_text()
    assert len(LINK.findall(text)) == 1 and f"I typed {IMAGE_TOKEN} here" in text


def test_exporting_again_keeps_the_same_pictures_and_another_file_of_that_name_stops_it_before_any_write(
    tmp_path: Path, talk: tuple[list[ExportMessage], DecodedImage, DecodedImage]
) -> None:
    messages, a, _b = talk
    path = tmp_path / "t.md"
    export_conversation(path, ExportForm.MARKDOWN, "T", "m", messages)
    export_conversation(path, ExportForm.MARKDOWN, "T", "m", messages)  # the same bytes: nothing refused
    theirs = pictures_folder(path) / f"{a.sha256[:12]}.png"
    theirs.write_bytes(b"the user's own edit")
    path.unlink()
    with pytest.raises(ExportError, match=r"already holds another .*\.png; choose another name"):
        export_conversation(path, ExportForm.MARKDOWN, "T", "m", messages)
    assert theirs.read_bytes() == b"the user's own edit" and not path.exists()


def test_a_file_where_the_pictures_folder_goes_stops_the_export(
    tmp_path: Path, talk: tuple[list[ExportMessage], DecodedImage, DecodedImage]
) -> None:
    messages, _a, _b = talk
    path = tmp_path / "t.md"
    pictures_folder(path).write_text("mine")
    with pytest.raises(ExportError, match="is not a folder"):
        export_conversation(path, ExportForm.MARKDOWN, "T", "m", messages)
    assert pictures_folder(path).read_text() == "mine" and not path.exists()
