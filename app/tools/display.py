"""Names and text from a tool server or the model, made safe to show on one line: control, bidi and zero-width
characters escaped (a newline cannot push "(really: delete_all_files)" out of view, U+202E cannot reverse a name,
ESC cannot drive a terminal or a log), and the length bounded with the cut said."""

from __future__ import annotations

import unicodedata

MAX_SHOWN = 80
_UNSAFE = {"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"}


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` with unsafe characters as `\\xNN`/`\\uNNNN` escapes, at most `limit` characters of it kept."""
    head = "".join(_escape(ch) if unicodedata.category(ch) in _UNSAFE else ch for ch in text[:limit])
    return head + (f"…(+{len(text) - limit} characters)" if len(text) > limit else "")


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
