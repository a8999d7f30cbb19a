"""Token ids of a document and the map from token ranges back to where they came from (file, page, line).

Each segment (one line of the extracted text) is tokenized on its own and the ids concatenated, so every token
belongs to exactly one line: a block of the capsule (a range of tokens) cites the lines it holds, exactly.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from engine.documents.extract import Document, Segment
from engine.loading.tokenizer import Tokenizer


@dataclass(frozen=True)
class Citation:
    """What a range of a capsule's tokens holds: the file, its page (PDF) and its first and last line."""

    source: str
    page: int | None
    start: int  # first line (1-based)
    end: int  # last line
    text: str  # the passage, as the model read it

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "start": self.start, "end": self.end, "page": self.page, "text": self.text}

    def label(self) -> str:
        """Where it is, as a reader says it: "notes.md, l. 12-20", "paper.pdf, p. 3, l. 4"."""
        lines = f"l. {self.start}" if self.end == self.start else f"l. {self.start}-{self.end}"
        return f"{self.source}, p. {self.page}, {lines}" if self.page else f"{self.source}, {lines}"


@dataclass(frozen=True)
class TokenMap:
    """starts[i]: index of the first token of segment i; where[i]: its (page or 0, line)."""

    source: str
    starts: tuple[int, ...]
    where: tuple[tuple[int, int], ...]

    def cite(self, start: int, end: int, text: str) -> Citation:
        """The lines tokens [start, end) came from (the range clipped to the document)."""
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        last = max(first, bisect.bisect_right(self.starts, max(start, end - 1)) - 1)
        page, line = self.where[first]
        end_page, end_line = self.where[last]
        return Citation(self.source, page or None, line, end_line if end_page == page else line, text)

    def to_json(self) -> list[list[int]]:
        return [[s, p, li] for s, (p, li) in zip(self.starts, self.where, strict=True)]

    @classmethod
    def from_json(cls, source: str, rows: object) -> TokenMap:
        """Inverse of to_json; ValueError for anything else (a damaged capsule)."""
        if not isinstance(rows, list) or not rows:
            raise ValueError("no token map")
        starts: list[int] = []
        where: list[tuple[int, int]] = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3 and all(type(x) is int and x >= 0 for x in row)):
                raise ValueError("a bad token map row")
            if starts and row[0] < starts[-1]:
                raise ValueError("a token map out of order")
            starts.append(row[0])
            where.append((row[1], row[2]))
        return cls(source, tuple(starts), tuple(where))


def tokenize(tok: Tokenizer, doc: Document, header: str) -> tuple[list[int], TokenMap]:
    """The document's token ids, `header` (what the model is told the text is) first, and their map. Empty lines
    join the next line's tokens (a newline alone costs a token the model reads anyway)."""
    ids = tok.encode(header, add_bos=False)
    starts: list[int] = []
    where: list[tuple[int, int]] = []
    pending = ""
    for seg in doc.segments:
        text = pending + seg.text + "\n"
        if not seg.text.strip():
            pending = text
            continue
        pending = ""
        starts.append(len(ids))
        where.append(_where(seg))
        ids.extend(tok.encode(text, add_bos=False))
    if not starts:
        raise ValueError("a document without text")  # extract() refuses these before
    return ids, TokenMap(doc.name, tuple(starts), tuple(where))


def _where(seg: Segment) -> tuple[int, int]:
    return (seg.page or 0, seg.line)
