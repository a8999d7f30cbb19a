"""Counted nouns as a person writes them: "1 message", "2 messages", "1,024 repositories"."""

from __future__ import annotations


def counted(n: int, singular: str, plural: str = "") -> str:
    """`n` and the noun in the number it takes (`plural` where adding an s is wrong)."""
    return f"{n:,} {singular if n == 1 else plural or singular + 's'}"
