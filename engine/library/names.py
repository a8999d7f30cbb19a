"""Whether a Hub repo id or a repo's file name may be used: it becomes part of a URL, a file in the models folder
and a line of output, so it is checked before any of these (`engine.library.hub` raises on it; `store` reads its
manifests with it). Light on purpose: the store imports it at the app's start-up, without the network stack.
"""

from __future__ import annotations

import re

from engine.untrusted import is_unsafe_char

_REPO_PART_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_REPO_CHARS = 96  # the Hub's own limit on owner/name
MAX_FILE_CHARS = 1000
MAX_SEGMENT_CHARS = 200  # one folder or file name: leaves room for the store's own prefixes under NAME_MAX


def repo_id_problem(repo: str) -> str | None:
    """Why `repo` is not a Hub repo id (owner/name in letters, digits, `.`, `_` and `-`), or None."""
    if len(repo) > MAX_REPO_CHARS:
        return f"is longer than {MAX_REPO_CHARS} characters"
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART_RE.fullmatch(p) for p in parts):
        return "is not written as owner/name"
    if any(".." in p or p.endswith(".") for p in parts):
        return "is not written as owner/name"
    return None


def file_name_problem(name: str) -> str | None:
    """Why `name` cannot be a repo file MLoT Spark downloads (it becomes a URL path and a file in the models
    folder), or None: bounded length, no NUL, control, bidi or zero-width characters, no backslash, no empty, `.`,
    `..` or hidden segment, no leading or trailing separator."""
    if not name:
        return "is empty"
    if len(name) > MAX_FILE_CHARS:
        return f"is longer than {MAX_FILE_CHARS} characters"
    if any(is_unsafe_char(ch) for ch in name):
        return "holds control, bidi or invisible characters"
    if "\\" in name or ":" in name:
        return "holds a backslash or a colon"
    for segment in name.split("/"):
        if not segment:
            return "has an empty folder part"
        if segment.startswith("."):
            return "has a part that starts with a dot"
        if len(segment) > MAX_SEGMENT_CHARS or len(segment.encode("utf-8")) > MAX_SEGMENT_CHARS:
            return f"has a part longer than {MAX_SEGMENT_CHARS} characters"
        if segment != segment.strip():
            return "has a part that starts or ends with a space"
    return None
