"""OpenAI's Files API over documents: uploads a chat can attach as memory (engine.documents).

An upload is checked as a document (extract: type, size, hostile PDFs) before it is kept, so a bad file is refused
at once in one sentence. The bytes live under a folder the store makes for itself, one file per upload named by its
generated id (`file-` + 24 hex digits); nothing a client sends becomes a path, and an id is only looked up after it
matched that shape. The store is bounded by file count and total bytes: an upload past either is refused (413)
rather than evicting an older file a client may still be about to use; DELETE frees room.
"""

from __future__ import annotations

import re
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.documents.extract import MAX_FILE_BYTES, Document, DocumentError, extract
from engine.openai.errors import ApiError, bad_request, too_large

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
MAX_NAME_CHARS = 255
PURPOSES = ("assistants", "user_data", "batch", "fine-tune", "vision", "evals")


@dataclass(frozen=True)
class FileLimits:
    max_file_bytes: int = MAX_FILE_BYTES  # one upload (extract refuses more anyway)
    max_files: int = 64  # files held at once
    max_total_bytes: int = 256 * 1024**2  # bytes held at once


@dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str  # as the client named it: a label for citations, never a path
    purpose: str
    bytes: int
    created_at: int

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
        }


def unknown_file(file_id: str) -> ApiError:
    return ApiError(404, f"No such file: {file_id!r}; upload it with POST /v1/files.", param="file_id")


def check_id(file_id: str) -> str:
    """`file_id` when it has the shape this server gives ids; else 404 (it cannot name one of ours)."""
    if not isinstance(file_id, str) or FILE_ID.fullmatch(file_id) is None:
        raise unknown_file(file_id if isinstance(file_id, str) else str(type(file_id).__name__))
    return file_id


def clean_name(name: str | None) -> str:
    """The client's file name as a label: its last path part, printable, bounded."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(c for c in base if c.isprintable())[:MAX_NAME_CHARS].strip()
    return base or "upload.txt"


class FileStore:
    """Uploaded files, on disk under a folder of its own (removed by close)."""

    def __init__(self, limits: FileLimits | None = None, parent: Path | None = None) -> None:
        self.limits = limits or FileLimits()
        # Removed by close, or when the process exits (TemporaryDirectory's finalizer).
        self._dir = tempfile.TemporaryDirectory(prefix="spark-files-", dir=parent)
        self.root = Path(self._dir.name)
        self.files: dict[str, StoredFile] = {}
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def add(self, filename: str | None, purpose: str, data: bytes) -> StoredFile:
        """Keep an upload once it reads as a document; ApiError (one sentence) otherwise. Blocking: extracting a
        PDF takes time, so call it off the event loop."""
        name = clean_name(filename)
        if len(data) > self.limits.max_file_bytes:
            raise too_large(
                f"{name} is {len(data):,} bytes, more than the {self.limits.max_file_bytes:,} an upload may be.", "file"
            )
        try:
            extract(name, data)
        except DocumentError as exc:
            raise bad_request(str(exc), "file") from None
        with self._lock:
            if len(self.files) >= self.limits.max_files:
                raise too_large(f"This server holds {self.limits.max_files} files already; delete one first.", "file")
            if self.total_bytes + len(data) > self.limits.max_total_bytes:
                raise too_large(
                    f"This server holds at most {self.limits.max_total_bytes:,} bytes of files and {name} does not "
                    "fit; delete one first.",
                    "file",
                )
            file_id = "file-" + secrets.token_hex(12)
            (self.root / file_id).write_bytes(data)
            stored = StoredFile(file_id, name, purpose, len(data), int(time.time()))
            self.files[file_id] = stored
            return stored

    def get(self, file_id: str) -> StoredFile:
        stored = self.files.get(check_id(file_id))
        if stored is None:
            raise unknown_file(file_id)
        return stored

    def document(self, file_id: str) -> Document:
        """The upload as a Document (read again from its bytes: what was checked at upload reads the same)."""
        stored = self.get(file_id)
        try:
            return extract(stored.filename, (self.root / stored.id).read_bytes())
        except FileNotFoundError:
            raise unknown_file(file_id) from None
        except DocumentError as exc:
            raise bad_request(str(exc), "file") from None

    def delete(self, file_id: str) -> StoredFile:
        with self._lock:
            stored = self.get(file_id)
            del self.files[stored.id]
            (self.root / stored.id).unlink(missing_ok=True)
            return stored

    def listing(self) -> list[StoredFile]:
        return sorted(self.files.values(), key=lambda f: (f.created_at, f.id))

    def close(self) -> None:
        self._dir.cleanup()
        self.files.clear()
