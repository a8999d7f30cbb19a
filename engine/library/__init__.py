"""The model library the CLI (`python -m engine models …`) and the app's "Get Models…" share: the curated catalog,
a recommendation for this machine, Hub search, resumable verified downloads, and the local store of models.

It sits above `loading` (it validates downloads with the GGUF reader) and `hw` (memory for recommendations); the
loader finds a stored model by name through `engine.paths.models_dir()` alone, so no arrow runs back up here.

    from engine.library import Library
    lib = Library.from_env()
    lib.downloader().download("unsloth/Qwen3-4B-GGUF", progress=print)
    [m.name for m in lib.store.models()]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.library.catalog import Catalog, CatalogError, CatalogModel, RecommendedSampling, load_catalog
from engine.library.download import (
    DownloadControl,
    Downloader,
    DownloadProgress,
    DownloadStopped,
    FreeSpace,
    Phase,
    StopReason,
    disk_free,
    validate_gguf,
)
from engine.library.hub import HubClient, HubFile, HubRepo, HubSettings, LibraryError, Problem, RepoFiles
from engine.library.recommend import Fit, Machine, Recommendation, recommend, this_machine
from engine.library.store import LocalModel, ModelSource, ModelStore, PartialDownload, StoreError
from engine.paths import models_dir


@dataclass
class Library:
    """The pieces wired together for one models folder and one Hub."""

    store: ModelStore
    hub: HubClient
    catalog: Catalog
    free_space: FreeSpace = field(default=disk_free)

    @classmethod
    def from_env(cls, root: Path | None = None) -> Library:
        return cls(ModelStore(root or models_dir()), HubClient(), load_catalog())

    def downloader(self) -> Downloader:
        return Downloader(self.hub, self.store, catalog=self.catalog, free_space=self.free_space)

    def recommended_sampling(self, model_file: Path) -> RecommendedSampling | None:
        """The catalog's sampling for a GGUF by its file name (a downloaded or the bundled model), if listed."""
        entry = self.catalog.by_file(model_file.name)
        return entry.sampling if entry else None


__all__ = [
    "Catalog",
    "CatalogError",
    "CatalogModel",
    "DownloadControl",
    "DownloadProgress",
    "DownloadStopped",
    "Downloader",
    "Fit",
    "FreeSpace",
    "HubClient",
    "HubFile",
    "HubRepo",
    "HubSettings",
    "Library",
    "LibraryError",
    "LocalModel",
    "Machine",
    "ModelSource",
    "ModelStore",
    "PartialDownload",
    "Phase",
    "Problem",
    "Recommendation",
    "RecommendedSampling",
    "RepoFiles",
    "StopReason",
    "StoreError",
    "disk_free",
    "load_catalog",
    "recommend",
    "this_machine",
    "validate_gguf",
]
