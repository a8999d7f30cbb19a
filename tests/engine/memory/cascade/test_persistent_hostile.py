"""L3 against hostile input: keys are content hashes or refused, no path leaves the store's folder, planted
FIFOs and links are refused without blocking, and any I/O error turns the store off with one warning."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from engine.memory.cascade import PersistentStore


def _kv() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 2, 8, 16, generator=g).half(), torch.randn(2, 2, 8, 16, generator=g).half()


@pytest.mark.parametrize(
    "key", ["../../victim", "../" * 8 + "tmp/x", "A" * 64, "a" * 63, "/etc/passwd", "", "a" * 64 + "/x"]
)
def test_keys_that_are_not_content_hashes_never_become_paths(tmp_path: Path, key: str) -> None:
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"weights")
    store = PersistentStore(tmp_path / "cache" / "kv", "m", "n")
    store.put(key, *_kv(), 8)
    assert store.get(key) is None and key not in store
    assert victim.read_bytes() == b"weights"
    assert [p.name for p in (tmp_path / "cache" / "kv" / "blocks").iterdir()] == []


def test_an_entry_planted_as_a_symlink_or_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x" * 100)
    store = PersistentStore(tmp_path / "kv", "m", "n")
    link_key, fifo_key = store.key("link"), store.key("fifo")
    (tmp_path / "kv" / "blocks" / f"{link_key}.safetensors").symlink_to(outside)
    os.mkfifo(tmp_path / "kv" / "blocks" / f"{fifo_key}.safetensors")
    store = PersistentStore(tmp_path / "kv", "m", "n")  # reopened: both are listed by the folder scan
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert store.get(link_key) is None and store.get(fifo_key) is None
    assert outside.read_bytes() == b"x" * 100  # never deleted through the cache


def test_a_file_where_the_cache_folder_should_be_turns_the_store_off_with_one_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="is off for this run") as record:
        store = PersistentStore(blocker, "m", "n")
        store.put(store.key("p"), *_kv(), 8)
        assert store.get(store.key("p")) is None
        store.flush()
    assert len(record) == 1 and store.disabled
    assert blocker.read_text() == "not a folder"


def test_a_write_failing_mid_run_turns_the_store_off_and_keeps_working(tmp_path: Path) -> None:
    store = PersistentStore(tmp_path / "kv", "m", "n")
    key = store.key("p")
    store.put(key, *_kv(), 8)
    assert store.get(key) is not None
    blocks = tmp_path / "kv" / "blocks"
    for p in blocks.iterdir():
        p.unlink()
    blocks.rmdir()
    blocks.write_text("the folder is gone")  # every later write fails with an OSError, like a full disk
    with pytest.warns(RuntimeWarning, match="is off for this run") as record:
        store.put(store.key("q"), *_kv(), 8)
        store.put(store.key("r"), *_kv(), 8)
    assert len(record) == 1 and store.disabled
    assert store.get(key) is None and store.get(store.key("q")) is None and store.stats().entries == 0
