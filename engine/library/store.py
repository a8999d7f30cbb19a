"""The local store of downloaded models: one folder per model under the data folder's `models/` (engine.paths).

    models/
      Qwen3-4B-Q4_K_M/                 a complete model: appears in `models list`, opens with `--model NAME`
        Qwen3-4B-Q4_K_M.gguf
        spark-model.json               where it came from: repo, file, revision, sha256, size, family
      .downloads/                      partial downloads, never listed as models
        <sha256>.part, <sha256>.json   the bytes so far and what they are (a resumed download appends)

A model folder is built beside its final name and renamed into place (engine.fileio.atomic_dir), so a reader sees
no folder or a complete one; a removed model is renamed away before it is deleted. The manifest is hostile input
like every file: a folder whose manifest is unreadable or whose GGUF is not the size it states is not listed.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import SparkError
from engine.fileio import atomic_dir, atomic_write

MANIFEST = "spark-model.json"
DOWNLOADS = ".downloads"
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


class StoreError(SparkError):
    """A model in the store cannot be found, named or removed."""


@dataclass(frozen=True)
class ModelSource:
    """Where a downloaded file came from, as the Hub described it."""

    repo: str
    file: str
    revision: str  # the commit the file was downloaded at
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class LocalModel:
    name: str  # what `--model` accepts
    path: Path  # the GGUF file
    size_bytes: int
    family: str  # the GGUF's general.architecture
    source: ModelSource

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "size_bytes": self.size_bytes,
            "family": self.family,
            "repo": self.source.repo,
            "file": self.source.file,
            "revision": self.source.revision,
            "sha256": self.source.sha256,
        }


@dataclass(frozen=True)
class PartialDownload:
    """A download that stopped before it finished (paused, interrupted); `download` again resumes it."""

    source: ModelSource
    part: Path
    done_bytes: int


def model_name(file: str) -> str:
    """The store name of a GGUF file: its stem, in characters safe in a folder name and on a command line."""
    stem = file.rsplit("/", 1)[-1]
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return _NAME_RE.sub("-", stem).strip(".-") or "model"


class ModelStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    # -- complete models -----------------------------------------------------------------------------------------
    def models(self) -> list[LocalModel]:
        if not self.root.is_dir():
            return []
        models = []
        for folder in sorted(self.root.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            model = self._read(folder)
            if model is not None:
                models.append(model)
        return models

    def get(self, name: str) -> LocalModel | None:
        if not name or name.startswith(".") or _NAME_RE.search(name):
            return None
        folder = self.root / name
        return self._read(folder) if folder.is_dir() else None

    def find(self, repo: str, file: str) -> LocalModel | None:
        return next((m for m in self.models() if m.source.repo == repo and m.source.file == file), None)

    def _read(self, folder: Path) -> LocalModel | None:
        try:
            data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            source = _source(data["source"])
            family = data["family"]
            if not isinstance(family, str):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        gguf = folder / model_file_name(source.file)
        try:
            size = gguf.stat().st_size
        except OSError:
            return None
        if size != source.size_bytes:
            return None
        return LocalModel(folder.name, gguf, size, family, source)

    def free_name(self, file: str, repo: str) -> str:
        """A name for a new model: the file's stem, or with the repo's owner added when another repo's file took it."""
        name = model_name(file)
        taken = self.get(name)
        if taken is None and not (self.root / name).exists():
            return name
        if taken is not None and taken.source.repo == repo:
            return name  # the same repo's newer copy replaces it
        return f"{name}-{model_name(repo.split('/', 1)[0])}"

    def install(self, part: Path, source: ModelSource, family: str) -> LocalModel:
        """Move a verified download into the store under a free name, atomically, with its manifest."""
        name = self.free_name(source.file, source.repo)
        manifest = {"format": 1, "family": family, "source": asdict(source)}
        with atomic_dir(self.root / name) as tmp:
            tmp.mkdir(parents=True)
            part.replace(tmp / model_file_name(source.file))
            atomic_write(tmp / MANIFEST, [json.dumps(manifest, indent=2).encode()])
        self._forget_partial(source.sha256)
        installed = self.get(name)
        if installed is None:  # only a concurrent removal gets here
            raise StoreError(f"The model {name} vanished from {self.root} as it was installed; download it again.")
        return installed

    def remove(self, name: str) -> LocalModel:
        model = self.get(name)
        if model is None:
            known = ", ".join(m.name for m in self.models()) or "none"
            raise StoreError(f"No downloaded model is called {name!r} (downloaded: {known}).")
        trash = self.root / f".removing-{name}-{uuid.uuid4().hex[:8]}"
        try:
            (self.root / name).rename(trash)  # gone from the list at once, even if deleting takes a while
        except OSError as exc:
            raise StoreError(f"The model {name} cannot be removed ({exc.strerror}).") from None
        shutil.rmtree(trash, ignore_errors=True)
        return model

    # -- partial downloads ---------------------------------------------------------------------------------------
    def partial_path(self, source: ModelSource) -> Path:
        """The `.part` file for `source` (its folder created), with a note saying what it is."""
        folder = self.root / DOWNLOADS
        folder.mkdir(parents=True, exist_ok=True)
        note = folder / f"{source.sha256}.json"
        if not note.exists():
            atomic_write(note, [json.dumps(asdict(source)).encode()])
        return folder / f"{source.sha256}.part"

    def partials(self) -> list[PartialDownload]:
        folder = self.root / DOWNLOADS
        if not folder.is_dir():
            return []
        out = []
        for note in sorted(folder.glob("*.json")):
            try:
                source = _source(json.loads(note.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            part = folder / f"{source.sha256}.part"
            with contextlib.suppress(OSError):
                out.append(PartialDownload(source, part, part.stat().st_size))
        return out

    def discard_partial(self, source: ModelSource) -> None:
        self._forget_partial(source.sha256)

    def _forget_partial(self, sha256: str) -> None:
        folder = self.root / DOWNLOADS
        for suffix in (".part", ".json"):
            with contextlib.suppress(OSError):
                (folder / f"{sha256}{suffix}").unlink()


def model_file_name(file: str) -> str:
    """The GGUF's name inside its model folder: the repo file's own name, without any folder part."""
    return file.rsplit("/", 1)[-1]


def _source(data: Any) -> ModelSource:
    if not isinstance(data, dict):
        raise TypeError("source must be an object")
    source = ModelSource(
        repo=data["repo"],
        file=data["file"],
        revision=data["revision"],
        sha256=data["sha256"],
        size_bytes=data["size_bytes"],
    )
    if not all(isinstance(v, str) for v in (source.repo, source.file, source.revision, source.sha256)):
        raise TypeError("source fields must be strings")
    if not isinstance(source.size_bytes, int) or source.size_bytes < 0 or not _SHA256_RE.fullmatch(source.sha256):
        raise ValueError("bad size or sha256")
    name = model_file_name(source.file)
    if not name or name.startswith(".") or "\\" in name or name != Path(name).name:
        raise ValueError("bad file name")
    return source
