"""The model library's pieces wired together for one models folder and one Hub (what the CLI and the app use)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.library.catalog import Catalog, load_catalog
from engine.library.download import Downloader, FreeSpace, disk_free
from engine.library.hub import HubClient
from engine.library.store import ModelStore
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
