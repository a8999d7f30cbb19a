"""Extraction of each kind of attachment, with the page and line each piece came from; hostile files refused in one
sentence (engine.documents.extract)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.documents import extract as ex
from engine.documents.extract import DocumentError, Kind, extract, read_file
from tests.engine.documents.pdfs import bomb_pdf, encrypted_pdf, nested_pdf, text_pdf


def lines_of(doc: ex.Document) -> list[tuple[int | None, int, str]]:
    return [(s.page, s.line, s.text) for s in doc.segments if s.text.strip()]


@pytest.mark.parametrize(
    ("name", "kind"), [("a.txt", Kind.TEXT), ("b.md", Kind.MARKDOWN), ("c.py", Kind.CODE), ("d", Kind.TEXT)]
)
def test_text_kinds_keep_their_lines(name: str, kind: Kind) -> None:
    doc = extract(name, b"first line\r\n\nthird line\n")
    assert doc.kind is kind and doc.name == name
    assert lines_of(doc) == [(None, 1, "first line"), (None, 3, "third line")]


def test_html_drops_tags_scripts_and_styles_and_keeps_source_lines() -> None:
    html = b"<html><head><style>p{}</style></head><body>\n<p>Hello &amp; welcome</p>\n<script>x()</script>\n<p>Bye</p></body></html>"
    doc = extract("page.html", html)
    assert doc.kind is Kind.HTML
    assert lines_of(doc) == [(None, 2, "Hello & welcome"), (None, 4, "Bye")]


def test_pdf_text_with_pages_and_lines() -> None:
    doc = extract("paper.pdf", text_pdf([["Alpha one", "Alpha two"], ["Beta one"]]))
    assert doc.kind is Kind.PDF
    got = lines_of(doc)
    assert [(p, t) for p, _, t in got] == [(1, "Alpha one"), (1, "Alpha two"), (2, "Beta one")]
    assert [li for _, li, _ in got] == [1, 2, 1]


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (encrypted_pdf(), "encrypted"),
        (b"%PDF-1.4\n\x00\xff garbage that is no PDF at all", "damaged or malformed"),
        (nested_pdf(), "PDF"),
        (bomb_pdf(), "PDF"),
    ],
    ids=["encrypted", "malformed", "nested", "bomb"],
)
def test_hostile_pdfs_are_refused_in_one_sentence(data: bytes, words: str) -> None:
    with pytest.raises(DocumentError) as err:
        extract("evil.pdf", data)
    msg = str(err.value)
    assert words in msg and msg.startswith("evil.pdf") and msg.endswith(".") and "\n" not in msg


def test_binary_undecodable_and_empty_files_are_refused() -> None:
    with pytest.raises(DocumentError, match="not a document this app reads"):
        extract("blob.bin", b"\x00\x01\x02")
    with pytest.raises(DocumentError, match="not UTF-8"):
        extract("notes.txt", b"\xff\xfe\xfa")
    with pytest.raises(DocumentError, match="no text"):
        extract("empty.md", b"\n\n  \n")


def test_size_limits_hold_before_reading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ex, "MAX_FILE_BYTES", 10)
    big = tmp_path / "big.txt"
    big.write_text("x" * 11)
    with pytest.raises(DocumentError, match="more than the 10"):
        read_file(big)
    with pytest.raises(DocumentError, match="is not a regular file"):
        read_file(tmp_path)
    with pytest.raises(DocumentError, match="does not exist"):
        read_file(tmp_path / "missing.txt")
    monkeypatch.setattr(ex, "MAX_FILE_BYTES", 1000)
    monkeypatch.setattr(ex, "MAX_CHARS", 5)
    with pytest.raises(DocumentError, match="characters of text"):
        extract("long.txt", b"abcdefgh")
