"""The model library tests' fake repository and a library wired to a loopback Hub (a temp models folder, no token)."""

from __future__ import annotations

from pathlib import Path

from engine.library.catalog import load_catalog
from engine.library.hub import HubClient, HubLimits, HubSettings
from engine.library.library import Library
from engine.library.store import ModelStore
from tests.helpers.fake_hub import FakeHub

REPO = "spark-tests/tiny-GGUF"
FILE = "tiny-f32.gguf"


def make_library(
    hub: FakeHub, root: Path, token: str | None = None, free: int = 1 << 40, limits: HubLimits | None = None
) -> Library:
    settings = HubSettings(endpoint=hub.endpoint, token=token, offline=False)
    return Library(ModelStore(root), HubClient(settings, limits), load_catalog(), free_space=lambda _path: free)
