"""A vision model from the loopback Hub: the catalog's SmolVLM entry downloads its GGUF and its llama.cpp projector
into one model folder, one progress over both files, and the model loads with its pictures; a projector that does
not fit the model or arrives damaged adds neither file; cancelling deletes both partial files; removing the model
removes its projector."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from engine.bench.mmproj_export import export_vision
from engine.library.download import DownloadControl, DownloadProgress, DownloadStopped, Phase, StopReason
from engine.library.hub import LibraryError, Problem
from engine.library.library import Library
from engine.session.engine import load
from tests.helpers.fake_hub import FakeHub
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

pytest.importorskip("transformers")
REPO = "ggml-org/SmolVLM-256M-Instruct-GGUF"  # the catalog's entry: its file and projector names
MODEL = "SmolVLM-256M-Instruct-Q8_0.gguf"
MMPROJ = "mmproj-SmolVLM-256M-Instruct-Q8_0.gguf"


@pytest.fixture(scope="module")
def vision_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    root = tmp_path_factory.mktemp("vision")
    text, mmproj = export_vision(make_tiny_idefics3(root / "SmolTiny"), root / "gguf", "f32", "f32")
    return text.read_bytes(), mmproj.read_bytes()


def test_vision_model_downloads_with_its_projector(
    library: Library, hub: FakeHub, vision_files: tuple[bytes, bytes], tmp_path: Path
) -> None:
    text, mmproj = vision_files
    hub.add(REPO, {MODEL: text, MMPROJ: mmproj, "SmolVLM-256M-Instruct-f16.gguf": text})
    seen: list[DownloadProgress] = []
    model = library.downloader().download(REPO, progress=seen.append)
    assert model.path.name == MODEL and model.mmproj is not None and model.mmproj.name == MMPROJ
    assert model.path.parent == model.mmproj.parent and model.mmproj.read_bytes() == mmproj
    assert library.store.partials() == [] and library.store.models() == [model]
    assert model.as_json()["mmproj"] == str(model.mmproj)
    moving = [p for p in seen if p.phase is Phase.DOWNLOADING]
    assert {p.total_bytes for p in moving} == {len(text) + len(mmproj)}  # one progress over both files
    assert moving[-1].done_bytes == len(text) + len(mmproj)
    assert all(a.done_bytes <= b.done_bytes for a, b in itertools.pairwise(moving))
    assert {p.file for p in moving} == {MODEL, MMPROJ}

    engine = load(model.path.parent, "cpu", cache_dir=tmp_path / "cache")  # the folder, as `--model NAME` opens it
    assert engine.vision is not None and engine.mmproj == model.mmproj

    again = library.downloader().download(REPO)
    assert again == model and len(hub.downloads_of(MMPROJ)) == 1
    library.store.remove(model.name)
    assert library.store.models() == [] and not model.mmproj.exists()


def test_projector_for_another_width_adds_neither(
    library: Library, hub: FakeHub, vision_files: tuple[bytes, bytes], tiny_gguf: bytes
) -> None:
    hub.add(REPO, {MODEL: tiny_gguf, MMPROJ: vision_files[1]})  # a 256-wide text model, a 64-wide projector
    with pytest.raises(LibraryError) as err:
        library.downloader().download(REPO)
    assert err.value.problem is Problem.BAD_FILE and "does not fit this model" in str(err.value)
    assert library.store.models() == []


def test_damaged_projector_adds_neither(library: Library, hub: FakeHub, vision_files: tuple[bytes, bytes]) -> None:
    text, mmproj = vision_files
    hub.add(REPO, {MODEL: text, MMPROJ: mmproj})
    hub.repos[REPO].files[MMPROJ].flip_byte_at = len(mmproj) // 2
    with pytest.raises(LibraryError) as err:
        library.downloader().download(REPO)
    assert err.value.problem is Problem.BAD_HASH and MMPROJ in str(err.value)
    assert library.store.models() == []


def test_cancel_deletes_both_partial_files(library: Library, hub: FakeHub, vision_files: tuple[bytes, bytes]) -> None:
    text, mmproj = vision_files
    hub.add(REPO, {MODEL: text, MMPROJ: mmproj})
    control = DownloadControl()

    def cancel_in_projector(p: DownloadProgress) -> None:
        if p.file == MMPROJ and p.phase is Phase.DOWNLOADING:
            control.cancel()

    with pytest.raises(DownloadStopped) as stopped:
        library.downloader().download(REPO, progress=cancel_in_projector, control=control)
    assert stopped.value.reason is StopReason.CANCELLED
    assert library.store.partials() == [] and library.store.models() == []
