"""Text out of a file the user attaches: plain text, Markdown, source code, HTML and PDF (pypdf; no OCR).

Every file is hostile until read: its size is checked before reading, its kind comes from its name or a sniff of
its bytes (never from what it claims inside), and a PDF is read under bounds of pages, characters and seconds, so
a bomb, an encrypted file, a malformed one or one nested past Python's recursion is refused in one sentence
(DocumentError) instead of hanging or filling memory. What comes out is a list of segments, each one line of text
with the page and line it came from: the token map (engine.documents.provenance) leads every token back to them.
"""

from __future__ import annotations

import io
import logging
import os
import stat
import time
from dataclasses import dataclass
from enum import StrEnum
from html.parser import HTMLParser
from pathlib import Path

from engine.errors import SparkError

MAX_FILE_BYTES = 32 * 1024**2  # what any attached file may weigh on disk
MAX_CHARS = 2_000_000  # extracted text (~500k tokens): beyond it, a document is a library, not an attachment
MAX_PDF_PAGES = 2_000
PDF_SECONDS = 60.0  # checked between pages: one hostile page is bounded by pypdf's own decompression limits
SNIFF_BYTES = 8192

TEXT_SUFFIXES = frozenset({".txt", ".text", ".log", ".csv", ".tsv", ".rst", ".org", ".tex"})
MARKDOWN_SUFFIXES = frozenset({".md", ".markdown", ".mdown"})
CODE_SUFFIXES = frozenset(
    {".py", ".pyi", ".js", ".ts", ".tsx", ".jsx", ".c", ".h", ".cc", ".cpp", ".hpp", ".rs", ".go", ".java", ".kt",
     ".swift", ".rb", ".php", ".cs", ".m", ".sh", ".bash", ".zsh", ".sql", ".json", ".yaml", ".yml", ".toml", ".ini",
     ".cfg", ".xml", ".css", ".scss", ".lua", ".r", ".jl", ".scala", ".hs", ".ml", ".ex", ".zig", ".dart"}
)  # fmt: skip
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})


class DocumentError(SparkError):
    """A file that cannot be attached: one sentence naming the file and the problem."""


class Kind(StrEnum):
    TEXT = "text"
    MARKDOWN = "markdown"
    CODE = "code"
    HTML = "html"
    PDF = "pdf"


@dataclass(frozen=True)
class Segment:
    """One line of extracted text and where it came from (page: 1-based, PDF only; line: 1-based, in the page)."""

    text: str
    line: int
    page: int | None = None


@dataclass(frozen=True)
class Document:
    name: str  # the file's name, as citations show it
    kind: Kind
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(s.text + "\n" for s in self.segments)


def kind_of(name: str, head: bytes) -> Kind:
    """The kind from the file name, else from its first bytes; DocumentError for anything else (binary)."""
    suffix = Path(name).suffix.lower()
    if head.startswith(b"%PDF-") or suffix == ".pdf":
        return Kind.PDF
    for kind, suffixes in (
        (Kind.MARKDOWN, MARKDOWN_SUFFIXES),
        (Kind.HTML, HTML_SUFFIXES),
        (Kind.CODE, CODE_SUFFIXES),
        (Kind.TEXT, TEXT_SUFFIXES),
    ):
        if suffix in suffixes:
            return kind
    if b"\0" in head:
        raise DocumentError(
            f"{name} is not a document this app reads; attach text, Markdown, source code, HTML or PDF."
        )
    sniff = head.lstrip()[:64].lower()
    return Kind.HTML if sniff.startswith((b"<!doctype html", b"<html")) else Kind.TEXT


def read_file(path: Path) -> Document:
    """Read and extract an attached file from disk (size checked before reading; only a regular file)."""
    path = path.expanduser()
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise DocumentError(f"{path} is not a regular file; attach a document file.")
        if st.st_size > MAX_FILE_BYTES:
            raise DocumentError(
                f"{path.name} is {st.st_size:,} bytes, more than the {MAX_FILE_BYTES:,} an attachment may be."
            )
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise DocumentError(f"The file {path} to attach does not exist.") from None
    except OSError as exc:
        raise DocumentError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    return extract(path.name, data)


def extract(name: str, data: bytes) -> Document:
    """A file's bytes (named `name`) -> its Document; DocumentError (one sentence) when it cannot be read."""
    if len(data) > MAX_FILE_BYTES:
        raise DocumentError(f"{name} is {len(data):,} bytes, more than the {MAX_FILE_BYTES:,} an attachment may be.")
    kind = kind_of(name, data[:SNIFF_BYTES])
    if kind is Kind.PDF:
        segments = _pdf_segments(name, data)
    else:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise DocumentError(f"{name} is not UTF-8 text; save it as UTF-8 and attach it again.") from None
        segments = _html_segments(text) if kind is Kind.HTML else _lines(text, None)
    total = sum(len(s.text) + 1 for s in segments)
    if total > MAX_CHARS:
        raise DocumentError(f"{name} holds {total:,} characters of text, more than the {MAX_CHARS:,} attachments may.")
    if not any(s.text.strip() for s in segments):
        why = " (a scanned PDF needs OCR, which this app does not do)" if kind is Kind.PDF else ""
        raise DocumentError(f"{name} holds no text to read{why}.")
    return Document(name, kind, tuple(segments))


def _lines(text: str, page: int | None, first_line: int = 1) -> list[Segment]:
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\0", "")
    return [Segment(line, first_line + i, page) for i, line in enumerate(text.split("\n"))]


class _TextOfHtml(HTMLParser):
    """The visible text of an HTML page with the source line of each piece; script and style dropped."""

    SKIP = frozenset({"script", "style", "head", "template", "noscript"})
    BREAKS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "section", "table"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.skipping = 0
        self.lines: list[Segment] = []
        self.current: list[str] = []
        self.line = 1

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self.SKIP:
            self.skipping += 1
        elif tag in self.BREAKS:
            self._break()

    def handle_endtag(self, tag: str) -> None:
        if tag in self.SKIP:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BREAKS:
            self._break()

    def handle_data(self, data: str) -> None:
        if self.skipping:
            return
        if not self.current:
            self.line = self.getpos()[0]
        for i, piece in enumerate(data.split("\n")):
            if i:
                self._break()
                self.line = self.getpos()[0] + i
            if piece.strip():
                self.current.append(" ".join(piece.split()))

    def _break(self) -> None:
        if self.current:
            self.lines.append(Segment(" ".join(self.current), self.line))
            self.current = []


def _html_segments(text: str) -> list[Segment]:
    parser = _TextOfHtml()
    parser.feed(text)
    parser.close()
    parser._break()
    return parser.lines


def _pdf_segments(name: str, data: bytes) -> list[Segment]:
    """A PDF's text, page by page, under MAX_PDF_PAGES, MAX_CHARS and PDF_SECONDS; any failure is one sentence."""
    import pypdf  # imported here: only attaching a PDF pays for it
    from pypdf.errors import PdfReadError, PyPdfError

    logging.getLogger("pypdf").setLevel(logging.ERROR)  # its warnings about odd files are not the user's business
    deadline = time.monotonic() + PDF_SECONDS
    try:
        reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            raise DocumentError(f"{name} is an encrypted PDF; remove its password and attach it again.")
        pages = len(reader.pages)
        if pages > MAX_PDF_PAGES:
            raise DocumentError(f"{name} has {pages:,} pages, more than the {MAX_PDF_PAGES:,} an attachment may have.")
        segments: list[Segment] = []
        chars = 0
        for number, page in enumerate(reader.pages, start=1):
            if time.monotonic() > deadline:
                raise DocumentError(f"{name} took more than {PDF_SECONDS:.0f} s to read; it is refused.")
            text = page.extract_text() or ""
            chars += len(text)
            if chars > MAX_CHARS:
                raise DocumentError(f"{name} holds more than the {MAX_CHARS:,} characters of text attachments may.")
            segments.extend(_lines(text, number))
        return segments
    except DocumentError:
        raise
    except RecursionError:
        raise DocumentError(f"{name} is a PDF nested too deeply to read; it is refused.") from None
    except MemoryError:
        raise DocumentError(f"{name} is a PDF that expands beyond what may be read; it is refused.") from None
    except (PdfReadError, PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError, OSError,
            AssertionError, ZeroDivisionError, OverflowError, UnicodeError, LookupError):  # fmt: skip
        raise DocumentError(f"{name} is not a PDF that can be read (it is damaged or malformed).") from None
