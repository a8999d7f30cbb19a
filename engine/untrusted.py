"""Text and JSON from outside (a Hub reply, a file name, a manifest), made safe to parse and to print.

- `loads_bounded`: JSON whose nesting is measured before the parser recurses into it, so a deep document is one
  `JsonTooDeep` instead of a RecursionError (or a stack overflow in the C parser), and whose size is bounded first.
- `shown`: a name as it may be printed on one line: control, bidi and zero-width characters escaped (a newline does
  not split an error, ESC[2J does not clear the terminal, U+202E does not reorder the line), and its length bounded.
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

MAX_SHOWN_CHARS = 120
# Possessive: a run of plain characters is taken whole and never backtracked into (fast on long strings, and
# linear on an unclosed one).
_STRING_RE = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_BRACKET_RE = re.compile(r"[\[\]{}]")


class JsonTooDeep(ValueError):
    """The document nests deeper than the reader allows (it may well be valid JSON)."""


class JsonTooLarge(ValueError):
    """The document is longer than the reader allows."""


def json_depth(text: str) -> int:
    """How deep `text` nests its arrays and objects (brackets inside strings not counted), without parsing it."""
    depth = deepest = 0
    for m in _BRACKET_RE.finditer(_STRING_RE.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def loads_bounded(raw: bytes | str, *, max_bytes: int, max_depth: int) -> Any:
    """`json.loads`, refusing a document over `max_bytes` (JsonTooLarge) or nested past `max_depth` (JsonTooDeep)
    before parsing; bad syntax or bad UTF-8 is a ValueError as with `json.loads`."""
    if len(raw) > max_bytes:
        raise JsonTooLarge(f"longer than {max_bytes} bytes")
    text = raw.decode("utf-8") if isinstance(raw, bytes) else raw  # UnicodeDecodeError is a ValueError
    if json_depth(text) > max_depth:
        raise JsonTooDeep(f"nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:  # only past the pre-count's bound, kept as a guard
        raise JsonTooDeep(f"nested deeper than {max_depth} levels") from None


def is_unsafe_char(ch: str) -> bool:
    """A character that changes how a line reads: controls (C0, DEL, C1), format characters (bidi overrides and
    isolates, zero-width joiners and spaces, the BOM), line and paragraph separators, and unpaired surrogates."""
    return unicodedata.category(ch) in {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


def shown(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """`text` safe to print on one line: unsafe characters as `\\xNN`/`\\uNNNN` escapes, at most `limit`
    characters kept (then "…" and how many more)."""
    head = text[:limit]
    out = "".join(_escape(ch) if is_unsafe_char(ch) else ch for ch in head)
    if len(text) > limit:
        out += f"…(+{len(text) - limit} characters)"
    return out


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"
