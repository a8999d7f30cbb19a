"""The local store of downloaded models: one folder per model under the data folder's `models/` (engine.paths).

    models/
      Qwen3-4B-Q4_K_M/                 a complete model: appears in `models list`, opens with `--model NAME`
        Qwen3-4B-Q4_K_M.gguf
        mmproj-Qwen3-4B-f16.gguf       a vision model's projector (llama.cpp's mmproj), when it has one
        spark-model.json               where they came from: repo, file, revision, sha256, size, family
      .downloads/                      partial downloads, never listed as models
        <sha256>.part, <sha256>.json   the bytes so far and what they are (a resumed download appends)

A model folder is built beside its final name and renamed into place (engine.fileio.atomic_dir), so a reader sees
no folder or a complete one; a removed model is renamed away before it is deleted. The manifest is hostile input
like every file: a folder whose manifest is unreadable or whose GGUF is not the size it states is not listed.

Nothing under the models folder is followed through a link: a downloaded byte is written only into a `.part` file
this store created (opened with O_NOFOLLOW, and re-checked to be a plain file with one link every time a download
resumes), and listing reads only plain files of bounded size and JSON nesting (a FIFO, a link or a deep manifest is
passed over, never waited on).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from engine.errors import SparkError
from engine.fileio import atomic_dir, atomic_write
from engine.library.names import file_name_problem, repo_id_problem
from engine.untrusted import loads_bounded, shown

MANIFEST = "spark-model.json"
DOWNLOADS = ".downloads"
_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 64 * 1024  # a manifest is ~300 bytes
MAX_MANIFEST_DEPTH = 8  # and nests 2 deep
_NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


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
    mmproj: Path | None = None  # its vision projector beside it (found there by loading, engine.vision.gguf_vision)

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
            "mmproj": str(self.mmproj) if self.mmproj is not None else None,
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
            if folder.name.startswith(".") or not _is_real_dir(folder):
                continue
            model = self._read(folder)
            if model is not None:
                models.append(model)
        return models

    def get(self, name: str) -> LocalModel | None:
        if not name or name.startswith(".") or _NAME_RE.search(name):
            return None
        folder = self.root / name
        return self._read(folder) if _is_real_dir(folder) else None

    def find(self, repo: str, file: str) -> LocalModel | None:
        return next((m for m in self.models() if m.source.repo == repo and m.source.file == file), None)

    def _read(self, folder: Path) -> LocalModel | None:
        try:
            data = read_small_json(folder / MANIFEST)
            source = _source(data["source"])
            family = data["family"]
            projector = _source(data["mmproj"]) if data.get("mmproj") is not None else None
            if not isinstance(family, str):
                return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        gguf = folder / model_file_name(source.file)
        if not _stated_size(gguf, source):
            return None
        mmproj = None
        if projector is not None:  # recorded: the model is whole only with it
            mmproj = folder / model_file_name(projector.file)
            if mmproj == gguf or not _stated_size(mmproj, projector):
                return None
        return LocalModel(folder.name, gguf, source.size_bytes, family, source, mmproj)

    def free_name(self, file: str, repo: str) -> str:
        """A name for a new model: the file's stem, or with the repo's owner added when another repo's file took it."""
        name = model_name(file)
        taken = self.get(name)
        if taken is None and not os.path.lexists(self.root / name):
            return name
        if taken is not None and taken.source.repo == repo:
            return name  # the same repo's newer copy replaces it
        return f"{name}-{model_name(repo.split('/', 1)[0])}"

    def install(
        self, part: Path, source: ModelSource, family: str, projector: tuple[Path, ModelSource] | None = None
    ) -> LocalModel:
        """Move a verified download (and its verified projector) into the store under a free name, atomically,
        with its manifest."""
        name = self.free_name(source.file, source.repo)
        _plain_file(part)
        manifest: dict[str, Any] = {"format": 1, "family": family, "source": asdict(source)}
        if projector is not None:
            _plain_file(projector[0])
            if model_file_name(projector[1].file) == model_file_name(source.file):
                raise StoreError(
                    f"The projector {shown(projector[1].file)} has the model's own name; it was not added."
                )
            manifest["mmproj"] = asdict(projector[1])
        with atomic_dir(self.root / name) as tmp:
            tmp.mkdir(parents=True)
            part.replace(tmp / model_file_name(source.file))
            if projector is not None:
                projector[0].replace(tmp / model_file_name(projector[1].file))
            atomic_write(tmp / MANIFEST, [json.dumps(manifest, indent=2).encode()])
        self._forget_partial(source.sha256)
        if projector is not None:
            self._forget_partial(projector[1].sha256)
        installed = self.get(name)
        if installed is None:  # only a concurrent removal gets here
            raise StoreError(f"The model {name} vanished from {self.root} as it was installed; download it again.")
        return installed

    def remove(self, name: str) -> LocalModel:
        model = self.get(name)
        if model is None:
            known = ", ".join(m.name for m in self.models()) or "none"
            raise StoreError(f"No downloaded model is called {shown(name)!r} (downloaded: {known}).")
        trash = self.root / f".removing-{name}-{uuid.uuid4().hex[:8]}"
        try:
            (self.root / name).rename(trash)  # gone from the list at once, even if deleting takes a while
        except OSError as exc:
            raise StoreError(f"The model {name} cannot be removed ({exc.strerror}).") from None
        shutil.rmtree(trash, ignore_errors=True)
        return model

    # -- partial downloads ---------------------------------------------------------------------------------------
    def partial_path(self, source: ModelSource) -> Path:
        """The `.part` file for `source` (its folder created, a real folder), with a note saying what it is."""
        if not _SHA256_RE.fullmatch(source.sha256):
            raise StoreError("A download's sha256 is not 64 hex digits; download it again.")
        folder = self._downloads()
        note = folder / f"{source.sha256}.json"
        if not os.path.lexists(note):
            atomic_write(note, [json.dumps(asdict(source)).encode()])
        return folder / f"{source.sha256}.part"

    def partial_size(self, part: Path) -> int:
        """The bytes a resumable `.part` holds: 0 for none, or for anything there that is not a plain file with one
        link (it is not this store's, so it is replaced, never written through)."""
        try:
            info = part.lstat()
        except FileNotFoundError:
            return 0
        return info.st_size if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 else 0

    @contextlib.contextmanager
    def open_partial(self, part: Path) -> Iterator[Any]:
        """`part` open for writing, and certainly a file this store made: opened without following a link; a link,
        a FIFO, a folder's entry of another kind or a second hard link found there is unlinked (the thing it points
        at is never touched) and a new file created exclusively."""
        self._downloads()
        fd = -1
        try:
            fd = os.open(part, os.O_RDWR | os.O_NONBLOCK | _NO_FOLLOW)
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                os.close(fd)
                fd = -1
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK):
                raise
        if fd < 0:
            with contextlib.suppress(FileNotFoundError):
                _remove_entry(part)
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644)
        os.set_blocking(fd, True)
        with os.fdopen(fd, "r+b") as out:
            yield out

    @contextlib.contextmanager
    def read_partial(self, part: Path) -> Iterator[Any]:
        """`part` open for reading, refusing anything but the plain file `open_partial` made."""
        _plain_file(part)
        fd = os.open(part, os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(f"{part.name} in {part.parent} is not a plain file; download it again.")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        with os.fdopen(fd, "rb") as f:
            yield f

    def _downloads(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        folder = self.root / DOWNLOADS
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
        if not _is_real_dir(folder):
            raise StoreError(
                f"{folder} is a link or not a folder; MLoT Spark writes downloads only into a folder of its own: "
                "remove it, then download again."
            )
        return folder

    def partials(self) -> list[PartialDownload]:
        folder = self.root / DOWNLOADS
        if not _is_real_dir(folder):
            return []
        out = []
        for note in sorted(folder.glob("*.json")):
            try:
                source = _source(read_small_json(note))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            part = folder / f"{source.sha256}.part"
            with contextlib.suppress(OSError):
                info = part.lstat()
                if stat.S_ISREG(info.st_mode):
                    out.append(PartialDownload(source, part, info.st_size))
        return out

    def discard_partial(self, source: ModelSource) -> None:
        self._forget_partial(source.sha256)

    def _forget_partial(self, sha256: str) -> None:
        folder = self.root / DOWNLOADS
        for suffix in (".part", ".json"):
            with contextlib.suppress(OSError):
                (folder / f"{sha256}{suffix}").unlink()


def read_small_json(path: Path) -> Any:
    """A manifest or note: a plain file (not a link, not a FIFO: opened without blocking) of at most
    MAX_MANIFEST_BYTES, nested at most MAX_MANIFEST_DEPTH deep. Raises OSError or ValueError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
            raise ValueError("not a plain file of manifest size")
        raw = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    return loads_bounded(raw, max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_MANIFEST_DEPTH)


def _stated_size(path: Path, source: ModelSource) -> bool:
    """A plain file (not a link) of the size its manifest states."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_size == source.size_bytes


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(path.lstat().st_mode)
    except OSError:
        return False


def _plain_file(path: Path) -> None:
    try:
        info = path.lstat()
    except OSError as exc:
        raise StoreError(f"{path.name} in {path.parent} cannot be read ({exc.strerror}); download it again.") from None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        raise StoreError(f"{path.name} in {path.parent} is not a plain file of its own; download it again.")


def _remove_entry(path: Path) -> None:
    """Remove what sits at `path` itself (a link's target is never touched; a folder found there is removed)."""
    if _is_real_dir(path):
        shutil.rmtree(path)
    else:
        path.unlink()


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
    if repo_id_problem(source.repo) is not None or file_name_problem(source.file) is not None:
        raise ValueError("bad repo or file name")
    return source
