"""Downloads through the loopback Hub: verified and listed; interrupted, paused and killed transfers resume with a
Range request; a damaged byte, a file that is not a GGUF, a full disk and every access failure are one sentence and
leave no model behind."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.library.download import DownloadControl, DownloadProgress, DownloadStopped, Phase, StopReason
from engine.library.hub import HubClient, HubSettings, LibraryError, Problem
from engine.library.library import Library
from tests.engine.library.helpers import FILE, REPO, make_library
from tests.helpers.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[3]


def _fails(problem: Problem, call: object) -> LibraryError:
    with pytest.raises(LibraryError) as info:
        call()  # type: ignore[operator]
    assert info.value.problem is problem, str(info.value)
    message = str(info.value)
    assert "\n" not in message and message.endswith("."), message
    return info.value


def test_download_verifies_and_lists(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    seen: list[DownloadProgress] = []
    model = library.downloader().download(REPO, progress=seen.append)
    assert model.name == "tiny-f32"
    assert model.path.read_bytes() == tiny_gguf
    assert model.family == "llama"
    assert model.source.sha256 == hashlib.sha256(tiny_gguf).hexdigest()
    assert [m.name for m in library.store.models()] == ["tiny-f32"]
    assert library.store.partials() == []
    phases = [p.phase for p in seen]
    assert phases[0] is Phase.CONNECTING and phases[-1] is Phase.DONE and Phase.VERIFYING in phases
    moving = [p for p in seen if p.phase is Phase.DOWNLOADING]
    assert moving[-1].done_bytes == len(tiny_gguf) == moving[-1].total_bytes
    assert all(a.done_bytes <= b.done_bytes for a, b in itertools.pairwise(moving))
    assert moving[-1].bytes_per_s > 0 and moving[-1].eta_s == 0
    # downloading it again is a no-op: the stored copy has the Hub's sha256
    again = library.downloader().download(REPO)
    assert again == model and len(hub.downloads_of(FILE)) == 1


def test_interrupted_transfer_resumes_with_range(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    hub.repos[REPO].files[FILE].cut_after = 2 << 20
    _fails(Problem.NO_NETWORK, lambda: library.downloader().download(REPO))
    assert library.store.models() == []  # a partial download is never a model
    (partial,) = library.store.partials()
    assert 0 < partial.done_bytes <= 2 << 20
    hub.repos[REPO].files[FILE].cut_after = None
    model = library.downloader().download(REPO)
    assert model.path.read_bytes() == tiny_gguf
    assert hub.downloads_of(FILE)[-1].range == f"bytes={partial.done_bytes}-"


def test_pause_keeps_the_partial_file_and_cancel_deletes_it(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    control = DownloadControl()

    def pause_at_first_bytes(p: DownloadProgress) -> None:
        if p.phase is Phase.DOWNLOADING:
            control.pause()

    with pytest.raises(DownloadStopped) as stopped:
        library.downloader().download(REPO, progress=pause_at_first_bytes, control=control)
    assert stopped.value.reason is StopReason.PAUSED
    (partial,) = library.store.partials()
    assert 0 < partial.done_bytes < len(tiny_gguf)
    assert library.store.models() == []

    cancel = DownloadControl()
    cancel.cancel()
    with pytest.raises(DownloadStopped):
        library.downloader().download(REPO, control=cancel)
    assert library.store.partials() == [] and library.store.models() == []
    assert library.downloader().download(REPO).path.read_bytes() == tiny_gguf


def test_pause_is_prompt_while_the_network_stalls(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    """The Hub sends 3 MiB, then nothing: a pause still stops the download, and the resumed one completes."""
    hub.repos[REPO].files[FILE].hold_after = 3 << 20
    control = DownloadControl()
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            library.downloader().download(REPO, control=control)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 120
    while not any(p.done_bytes >= 1 << 20 for p in library.store.partials()):
        assert time.monotonic() < deadline, "no bytes arrived"
        time.sleep(0.05)
    control.pause()
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert not hub._released.is_set()  # it stopped while the Hub still held the rest back
    assert isinstance(outcome[0], DownloadStopped) and outcome[0].reason is StopReason.PAUSED
    hub.release()
    assert library.downloader().download(REPO).path.read_bytes() == tiny_gguf


def test_killed_download_resumes(hub: FakeHub, tmp_path: Path, tiny_gguf: bytes) -> None:
    """`models download` killed (SIGKILL) mid-transfer: nothing listed, and the next download asks for the rest."""
    hub.repos[REPO].files[FILE].hold_after = 3 << 20
    root = tmp_path / "models"
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "MLOT_SPARK_MODELS_DIR": str(root), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "models", "download", REPO, "--json"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    library = make_library(hub, root)
    try:
        deadline = time.monotonic() + 120
        while not any(p.done_bytes >= 1 << 20 for p in library.store.partials()):
            assert proc.poll() is None, "the download ended before it could be killed"
            assert time.monotonic() < deadline, "no bytes arrived"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    hub.release()
    assert library.store.models() == []
    (partial,) = library.store.partials()
    model = library.downloader().download(REPO)
    assert model.path.read_bytes() == tiny_gguf
    assert hub.downloads_of(FILE)[-1].range == f"bytes={partial.done_bytes}-"


def test_flipped_byte_is_refused(library: Library, hub: FakeHub) -> None:
    hub.repos[REPO].files[FILE].flip_byte_at = 5000
    message = _fails(Problem.BAD_HASH, lambda: library.downloader().download(REPO))
    assert "sha256" in str(message)
    assert library.store.models() == [] and library.store.partials() == []


def test_a_sha256_that_is_not_one_is_refused(library: Library, hub: FakeHub, tmp_path: Path) -> None:
    hub.repos[REPO].files[FILE].advertised_sha256 = "../../outside"  # it would name the partial file
    _fails(Problem.BAD_FILE, lambda: library.downloader().download(REPO))
    assert hub.downloads_of(FILE) == [] and not (tmp_path / "outside.part").exists()


def test_a_file_that_is_not_a_gguf_is_not_listed(library: Library, hub: FakeHub) -> None:
    hub.add("spark-tests/junk-GGUF", {"junk.gguf": b"GGUF" + bytes(5000)})
    _fails(Problem.BAD_FILE, lambda: library.downloader().download("spark-tests/junk-GGUF"))
    assert library.store.models() == [] and library.store.partials() == []


def test_disk_full_is_refused_before_any_byte(hub: FakeHub, tmp_path: Path) -> None:
    library = make_library(hub, tmp_path / "models", free=1 << 20)
    message = _fails(Problem.DISK_FULL, lambda: library.downloader().download(REPO))
    assert "free" in str(message)
    assert hub.downloads_of(FILE) == []


def test_gated_repo(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    hub.add("spark-tests/gated-GGUF", {FILE: tiny_gguf}, gated=True)
    message = _fails(Problem.GATED, lambda: library.downloader().download("spark-tests/gated-GGUF"))
    assert "HF_TOKEN" in str(message)


def test_private_repo_needs_its_token(hub: FakeHub, tmp_path: Path, tiny_gguf: bytes) -> None:
    hub.add("spark-tests/private-GGUF", {FILE: tiny_gguf}, token="hf_right")
    anonymous = make_library(hub, tmp_path / "a")
    _fails(Problem.NOT_FOUND, lambda: anonymous.downloader().download("spark-tests/private-GGUF"))
    wrong = make_library(hub, tmp_path / "b", token="hf_wrong")
    _fails(Problem.FORBIDDEN, lambda: wrong.downloader().download("spark-tests/private-GGUF"))
    right = make_library(hub, tmp_path / "c", token="hf_right")
    assert right.downloader().download("spark-tests/private-GGUF").path.read_bytes() == tiny_gguf
    assert hub.downloads_of(FILE)[-1].authorization == "Bearer hf_right"


def test_missing_repo_and_file(library: Library, hub: FakeHub) -> None:
    _fails(Problem.NOT_FOUND, lambda: library.downloader().download("spark-tests/nothing-here"))
    _fails(Problem.NO_FILE, lambda: library.downloader().download(REPO, "other.gguf"))
    with pytest.raises(LibraryError) as info, library.hub.open_stream(REPO, "gone.gguf", "main", 0):
        pass
    assert info.value.problem is Problem.NO_FILE  # the Hub's own 404 EntryNotFound


def test_no_network_and_offline(tmp_path: Path) -> None:
    closed = HubSettings(endpoint="http://127.0.0.1:9", token=None, offline=False)  # the discard port: refused
    _fails(Problem.NO_NETWORK, lambda: HubClient(closed).repo_files(REPO))  # (search retries for ~20 s first)
    offline = HubSettings(endpoint="http://127.0.0.1:9", token=None, offline=True)
    _fails(Problem.OFFLINE, lambda: HubClient(offline).repo_files(REPO))


def test_unsupported_architecture_is_refused_before_downloading(
    library: Library, hub: FakeHub, tiny_gguf: bytes
) -> None:
    hub.add("spark-tests/future-GGUF", {FILE: tiny_gguf}, architecture="future-arch")
    message = _fails(Problem.UNSUPPORTED, lambda: library.downloader().download("spark-tests/future-GGUF"))
    assert "future-arch" in str(message)
    assert hub.downloads_of(FILE) == []


def test_several_files_need_a_choice(library: Library, hub: FakeHub, tiny_gguf: bytes) -> None:
    hub.add("spark-tests/many-GGUF", {"m-Q8_0.gguf": tiny_gguf, "m-Q5_K_M.gguf": tiny_gguf, "mmproj-f16.gguf": b"x"})
    message = _fails(Problem.CHOOSE_FILE, lambda: library.downloader().download("spark-tests/many-GGUF"))
    assert "m-Q8_0.gguf" in str(message) and "mmproj" not in str(message)
    # the repo's projector comes with the model, checked as loading checks it: a broken one adds neither
    broken = _fails(Problem.BAD_FILE, lambda: library.downloader().download("spark-tests/many-GGUF", "m-Q8_0.gguf"))
    assert "mmproj-f16.gguf" in str(broken) and library.store.models() == []


def test_search_asks_for_gguf_repos(library: Library, hub: FakeHub) -> None:
    hub.add("spark-tests/other-GGUF", {FILE: b"x"}, downloads=500)
    found = library.hub.search("gguf")
    assert [r.id for r in found] == ["spark-tests/other-GGUF", REPO]
    assert hub.requests[-1].query["filter"] == ["gguf"]


def test_remove(library: Library, hub: FakeHub) -> None:
    model = library.downloader().download(REPO)
    assert library.store.remove(model.name) == model
    assert library.store.models() == [] and not model.path.exists()
