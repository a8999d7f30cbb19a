"""Downloading one GGUF file from the Hub into the store: resumable, with progress, checked before it is listed.

Steps: the repo's file list (size and LFS sha256, at one commit) → refuse an architecture the loader does not run
→ enough free disk for what is left → a Range request from the end of the partial file → bytes appended in chunks,
progress reported and pause/cancel checked between chunks → the sha256 of the whole file against the Hub's → the
GGUF's header and tensor table read (`validate_gguf`) → moved into the store with its manifest.

A vision model's projector (llama.cpp's `mmproj*.gguf`: the catalog's, else the repo's only one, else its f16 one)
comes the same way right after the model, one progress over both files, checked as loading checks it (every tensor,
and its width against the model's) and installed beside the model in the same folder, or neither is.

huggingface_hub's own `hf_hub_download` keeps no partial file across processes (since 1.x each attempt downloads to
a file unique to it) and reads in 10 MB chunks, so a pause would wait for a whole chunk: this module reads the
stream itself, in 1 MiB chunks, through huggingface_hub's session, headers and error mapping (engine.library.hub).
"""

from __future__ import annotations

import enum
import errno
import hashlib
import shutil
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.hw.memory import format_bytes
from engine.library.catalog import Catalog
from engine.library.hub import (
    HubClient,
    HubFile,
    LibraryError,
    Problem,
    RepoFiles,
    Stalled,
    check_file_name,
    check_repo_id,
)
from engine.library.store import LocalModel, ModelSource, ModelStore
from engine.loading.gguf import ARCHITECTURES, GGUFModel
from engine.loading.validate import validate_gguf as check_gguf
from engine.untrusted import shown
from engine.vision.mmproj import read_mmproj

CHUNK_BYTES = 1 << 20
DISK_MARGIN_BYTES = 256 << 20  # left free after the download, so the disk is not filled to the last byte
PROGRESS_EVERY_S = 0.1
# Slow but moving is fine; less than this many bytes in this long is a stalled transfer (a drip of a byte a second
# would otherwise hold the download open for ever).
STALL_WINDOW_S = 60.0
STALL_MIN_BYTES = 64 * 1024


class Phase(enum.Enum):
    CONNECTING = "connecting"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    DONE = "done"


@dataclass(frozen=True)
class DownloadProgress:
    repo: str
    file: str
    phase: Phase
    done_bytes: int
    total_bytes: int
    bytes_per_s: float  # over this session's transfer (0 until bytes arrive)
    eta_s: float | None  # None until a speed is known


class StopReason(enum.Enum):
    PAUSED = "paused"  # the partial file stays: downloading again resumes
    CANCELLED = "cancelled"  # the partial file is deleted


class DownloadStopped(Exception):
    """The user paused or cancelled; not an error."""

    def __init__(self, reason: StopReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class DownloadControl:
    """Pause or cancel a download from another thread; it stops at the next chunk (within ~1 MiB)."""

    def __init__(self) -> None:
        self._stop: StopReason | None = None
        self._lock = threading.Lock()

    def pause(self) -> None:
        self._request(StopReason.PAUSED)

    def cancel(self) -> None:
        self._request(StopReason.CANCELLED)

    def _request(self, reason: StopReason) -> None:
        with self._lock:
            if self._stop is not StopReason.CANCELLED:  # cancel wins over pause
                self._stop = reason

    def check(self) -> None:
        with self._lock:
            reason = self._stop
        if reason is not None:
            raise DownloadStopped(reason)


ProgressCallback = Callable[[DownloadProgress], None]
FreeSpace = Callable[[Path], int]


def disk_free(path: Path) -> int:
    """Free bytes on the disk holding `path` (its nearest existing parent)."""
    for p in (path, *path.parents):
        if p.exists():
            return shutil.disk_usage(p).free
    return shutil.disk_usage(Path.cwd()).free


def validate_gguf(path: Path) -> str:
    """Every check loading makes (engine.loading.validate: header, metadata, tensors against the network, finite
    scales, tokenizer and chat template), then the file's architecture family. Raises one sentence (ModelLoadError,
    TokenizerError) for a file the engine cannot load."""
    check_gguf(path)
    return GGUFModel(path).architecture


def choose_file(files: RepoFiles, wanted: str | None, catalog: Catalog | None) -> HubFile:
    """The file `--file` names, else the catalog's pick for a known repo, else the repo's only GGUF or its Q4_K_M."""
    if wanted:
        found = files.file(wanted)
        if found is None:
            raise LibraryError(Problem.NO_FILE, f"{files.repo} has no GGUF file {shown(wanted)}; {_choices(files)}")
        return found
    if not files.files:
        raise LibraryError(
            Problem.NO_FILE, f"{files.repo} holds no single-file GGUF model; choose a repo with GGUF files."
        )
    known = catalog.by_repo(files.repo) if catalog else None
    if known is not None:
        pick = files.file(known.file().file)
        if pick is not None:
            return pick
    if len(files.files) == 1:
        return files.files[0]
    q4km = [f for f in files.files if "q4_k_m" in f.name.lower()]
    if len(q4km) == 1:
        return q4km[0]
    raise LibraryError(Problem.CHOOSE_FILE, f"{files.repo} holds several GGUF files; {_choices(files)}")


def choose_projector(files: RepoFiles, model: HubFile, catalog: Catalog | None) -> HubFile | None:
    """The vision projector to fetch with `model`: the catalog's for a known vision model, else the repo's only
    one, else its one f16 file; None for a repo without one (a text model)."""
    known = catalog.by_file(model.name) if catalog else None
    if known is not None and known.mmproj is not None:
        pick = files.projector(known.mmproj)
        if pick is None:
            raise LibraryError(
                Problem.NO_FILE,
                f"{files.repo} no longer holds {shown(known.mmproj)}, the projector {known.name} needs.",
            )
        return pick
    if len(files.projectors) == 1:
        return files.projectors[0]
    f16 = [f for f in files.projectors if "f16" in f.name.lower()]
    return f16[0] if len(f16) == 1 else None


def _choices(files: RepoFiles) -> str:
    listed = ", ".join(f"{shown(f.name)} ({format_bytes(f.size_bytes)})" for f in files.files[:12])
    more = f" and {len(files.files) - 12} more" if len(files.files) > 12 else ""
    return f"choose one with --file: {listed}{more}."


def _span(report: ProgressCallback, before: int, total: int) -> ProgressCallback:
    """One file's progress as part of a download of `total` bytes whose first `before` bytes are done."""

    def moved(p: DownloadProgress) -> None:
        done = before + p.done_bytes
        eta = (total - done) / p.bytes_per_s if p.bytes_per_s > 0 else p.eta_s
        report(DownloadProgress(p.repo, p.file, p.phase, done, total, p.bytes_per_s, eta))

    return moved


def _same_projector(model: LocalModel, projector: ModelSource | None) -> bool:
    """Whether the stored model already has the projector a download would bring (by name and size)."""
    if projector is None or model.mmproj is None:
        return projector is None and model.mmproj is None
    try:
        return (
            model.mmproj.name == projector.file.rsplit("/", 1)[-1]
            and model.mmproj.stat().st_size == projector.size_bytes
        )
    except OSError:
        return False


class _StallWatch:
    """Less than `min_bytes` over any `window_s`: the transfer is stalled, and the download stops with one sentence."""

    def __init__(self, clock: Callable[[], float], window_s: float, min_bytes: int) -> None:
        self.window_s, self.min_bytes = window_s, min_bytes
        self.since, self.bytes = clock(), 0

    def moved(self, n: int, now: float) -> None:
        self.bytes += n
        if now - self.since < self.window_s:
            return
        if self.bytes < self.min_bytes:
            raise LibraryError(
                Problem.NO_NETWORK,
                f"The Hub sent less than {format_bytes(self.min_bytes)} in {self.window_s:.0f} s: check the network, "
                "then download again; it resumes where it stopped.",
            )
        self.since, self.bytes = now, 0


class Downloader:
    def __init__(
        self,
        hub: HubClient,
        store: ModelStore,
        *,
        catalog: Catalog | None = None,
        free_space: FreeSpace = disk_free,
        supported: Collection[str] = tuple(ARCHITECTURES),
        clock: Callable[[], float] = time.monotonic,
        stall_window_s: float = STALL_WINDOW_S,
        stall_min_bytes: int = STALL_MIN_BYTES,
    ) -> None:
        self.hub = hub
        self.store = store
        self.catalog = catalog
        self.free_space = free_space
        self.supported = supported
        self.clock = clock
        self.stall_window_s = stall_window_s
        self.stall_min_bytes = stall_min_bytes

    def download(
        self,
        repo: str,
        file: str | None = None,
        *,
        progress: ProgressCallback | None = None,
        control: DownloadControl | None = None,
    ) -> LocalModel:
        check_repo_id(repo)
        if file is not None:
            check_file_name(file)
        files = self.hub.repo_files(repo)
        chosen = choose_file(files, file, self.catalog)
        if chosen.sha256 is None:
            raise LibraryError(
                Problem.BAD_FILE,
                f"The Hub gives no sha256 for {chosen.name} (it is not stored in LFS), so it cannot be verified; "
                "choose another file.",
            )
        if files.architecture and files.architecture not in self.supported:
            raise LibraryError(
                Problem.UNSUPPORTED,
                f"{repo} holds {files.architecture!r} models, which this version of MLoT Spark does not run "
                f"(it runs {', '.join(sorted(self.supported))}); choose another model.",
            )
        source = ModelSource(repo, chosen.name, files.revision, chosen.sha256, chosen.size_bytes)
        extra = choose_projector(files, chosen, self.catalog)
        projector = None
        if extra is not None:
            if extra.sha256 is None:
                raise LibraryError(
                    Problem.BAD_FILE,
                    f"The Hub gives no sha256 for {extra.name}, the model's vision projector, so it cannot be verified.",
                )
            projector = ModelSource(repo, extra.name, files.revision, extra.sha256, extra.size_bytes)
        existing = self.store.find(repo, chosen.name)
        if existing is not None and existing.source.sha256 == source.sha256 and _same_projector(existing, projector):
            return existing
        report = progress or (lambda _p: None)
        control = control or DownloadControl()
        total = source.size_bytes + (projector.size_bytes if projector else 0)
        part = self.store.partial_path(source)
        extra_part = self.store.partial_path(projector) if projector else None
        try:
            later = projector.size_bytes - self.store.partial_size(extra_part) if projector and extra_part else 0
            self._fetch(source, part, _span(report, 0, total), control, later)
            if projector is not None and extra_part is not None:
                self._fetch(projector, extra_part, _span(report, source.size_bytes, total), control)
            report(DownloadProgress(repo, chosen.name, Phase.VERIFYING, total, total, 0.0, 0.0))
            self._verify(source, part, control)
            if projector is not None and extra_part is not None:
                self._verify(projector, extra_part, control)
            family = self._validate(part, source)
            if projector is not None and extra_part is not None:
                self._validate_projector(extra_part, projector, part)
        except DownloadStopped as stop:
            if stop.reason is StopReason.CANCELLED:
                self.store.discard_partial(source)
                if projector is not None:
                    self.store.discard_partial(projector)
            raise
        pair = (extra_part, projector) if projector is not None and extra_part is not None else None
        model = self.store.install(part, source, family, pair)
        report(DownloadProgress(repo, chosen.name, Phase.DONE, total, total, 0.0, 0.0))
        return model

    # -- steps -----------------------------------------------------------------------------------------------------
    def _fetch(
        self, source: ModelSource, part: Path, report: ProgressCallback, control: DownloadControl, later: int = 0
    ) -> None:
        """`later`: bytes of a second file still to come after this one (a projector), whose room is checked too."""
        have = self.store.partial_size(part)
        if have > source.size_bytes:  # not this file's bytes: start again
            have = 0
        self._check_space(source, have - max(later, 0))
        report(DownloadProgress(source.repo, source.file, Phase.CONNECTING, have, source.size_bytes, 0.0, None))
        started, got, last = self.clock(), 0, 0.0
        stall = _StallWatch(self.clock, self.stall_window_s, self.stall_min_bytes)
        while have < source.size_bytes:
            control.check()
            # What lies at `part` now may not be what this loop wrote (replaced, or a link put there): from its start.
            have = before = min(have, self.store.partial_size(part))
            try:
                with self.hub.open_stream(source.repo, source.file, source.revision, have) as stream:
                    if stream.complete:
                        break
                    have = stream.offset  # 0 when the server ignored the Range: the partial file is overwritten
                    # Opened again on every resume: what lies at `part` now is checked, not what lay there before.
                    with self.store.open_partial(part) as out:
                        out.seek(have)
                        out.truncate()
                        for piece in stream.chunks():
                            out.write(piece)
                            have += len(piece)
                            got += len(piece)
                            if have > source.size_bytes:
                                break
                            now = self.clock()
                            stall.moved(len(piece), now)
                            if now - last >= PROGRESS_EVERY_S or have == source.size_bytes:
                                last = now
                                out.flush()
                                speed = got / max(now - started, 1e-6)
                                eta = (source.size_bytes - have) / speed if speed > 0 else None
                                report(
                                    DownloadProgress(
                                        source.repo, source.file, Phase.DOWNLOADING, have, source.size_bytes, speed, eta
                                    )
                                )
                            control.check()
            except Stalled:
                stall.moved(0, self.clock())
                continue  # check for pause/cancel, then ask for the rest again
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._disk_full(source, 0) from None
                raise LibraryError(
                    Problem.DISK_FULL,
                    f"Cannot write {part.parent} ({exc.strerror}); check that the models folder is writable.",
                ) from None
            if have <= before or have > source.size_bytes:
                break  # the server ended a transfer without sending anything new (or sent too much)
        if have != source.size_bytes:
            self.store.discard_partial(source)
            raise LibraryError(
                Problem.BAD_HASH,
                f"The Hub sent {have} bytes of {shown(source.file)} instead of {source.size_bytes}; the partial copy "
                "was deleted: download it again.",
            )

    def _validate_projector(self, part: Path, source: ModelSource, model_part: Path) -> None:
        """The projector read as loading reads it (every tensor checked) and fitting the model's width."""
        try:
            read_mmproj(part).check_width(GGUFModel(model_part).config.hidden_size)
        except ModelLoadError as exc:
            self.store.discard_partial(source)
            raise LibraryError(
                Problem.BAD_FILE,
                f"{shown(source.file)} from {source.repo} is not a vision projector MLoT Spark can open for this model, "
                f"so neither was added: {shown(str(exc), 400)}",
            ) from None

    def _check_space(self, source: ModelSource, have: int) -> None:
        needed = source.size_bytes - have + DISK_MARGIN_BYTES
        if self.free_space(self.store.root) < needed:
            raise self._disk_full(source, needed)

    def _disk_full(self, source: ModelSource, needed: int) -> LibraryError:
        free = self.free_space(self.store.root)
        need = f"needs {format_bytes(needed)} but " if needed else ""
        return LibraryError(
            Problem.DISK_FULL,
            f"{shown(source.file)} {need}only {format_bytes(free)} is free on the disk holding {self.store.root}: free some "
            "space (or remove a model with `python -m engine models remove NAME`), then download again; it resumes "
            "where it stopped.",
        )

    def _verify(self, source: ModelSource, part: Path, control: DownloadControl) -> None:
        h = hashlib.sha256()
        with self.store.read_partial(part) as f:
            while chunk := f.read(8 * CHUNK_BYTES):
                h.update(chunk)
                control.check()
        if h.hexdigest() != source.sha256:
            self.store.discard_partial(source)
            raise LibraryError(
                Problem.BAD_HASH,
                f"The downloaded {shown(source.file)} does not match the Hub's sha256 (the copy was damaged on the way); it "
                "was deleted: download it again.",
            )

    def _validate(self, part: Path, source: ModelSource) -> str:
        try:
            return validate_gguf(part)
        except ModelLoadError as exc:
            self.store.discard_partial(source)
            raise LibraryError(
                Problem.BAD_FILE,
                f"{shown(source.file)} from {source.repo} is not a model MLoT Spark can open, so it was not added: "
                f"{shown(str(exc), 400)}",
            ) from None
