"""L3: survives a restart, never uses another model's or backend's entries, drops broken entries with a warning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.memory.cascade import PersistentStore


def _kv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, 8, 16, generator=g).half(), torch.randn(2, 2, 8, 16, generator=g).half()


def test_survives_a_restart(tmp_path: Path) -> None:
    k, v = _kv()
    a = PersistentStore(tmp_path, "model-a", "torch-cpu-float32")
    key = a.key("prefix-digest")
    a.put(key, k, v, 8)
    b = PersistentStore(tmp_path, "model-a", "torch-cpu-float32")  # a new process over the same directory
    got = b.get(key)
    assert got is not None
    torch.testing.assert_close(got[0], k)
    torch.testing.assert_close(got[1], v)
    assert b.stats().hits == 1 and b.stats().entries == 1


def test_foreign_model_or_backend_entries_are_never_used(tmp_path: Path) -> None:
    k, v = _kv()
    a = PersistentStore(tmp_path, "model-a", "torch-cpu-float32")
    a.put(a.key("p"), k, v, 8)
    for other in (
        PersistentStore(tmp_path, "model-b", "torch-cpu-float32"),
        PersistentStore(tmp_path, "model-a", "torch-mps-float16"),
    ):
        assert other.key("p") != a.key("p")
        assert other.get(other.key("p")) is None
    # A file planted under the other model's key (e.g. copied caches) is rejected by its recorded identity.
    b = PersistentStore(tmp_path, "model-b", "torch-cpu-float32")
    (tmp_path / "blocks" / f"{a.key('p')}.safetensors").rename(tmp_path / "blocks" / f"{b.key('p')}.safetensors")
    b = PersistentStore(tmp_path, "model-b", "torch-cpu-float32")
    with pytest.warns(RuntimeWarning, match="another model"):
        assert b.get(b.key("p")) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "header"])
def test_broken_entries_are_dropped_with_a_warning(tmp_path: Path, damage: str) -> None:
    k, v = _kv()
    s = PersistentStore(tmp_path, "m", "n")
    key = s.key("p")
    s.put(key, k, v, 8)
    path = tmp_path / "blocks" / f"{key}.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-10] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:
        data[9] = ord("!")
    path.write_bytes(bytes(data))
    s = PersistentStore(tmp_path, "m", "n")
    with pytest.warns(RuntimeWarning, match="Dropped a persistent KV cache entry"):
        assert s.get(key) is None
    assert not path.exists() and key not in s
    assert s.stats().evictions == 1


def test_leftover_temp_files_are_ignored(tmp_path: Path) -> None:
    s = PersistentStore(tmp_path, "m", "n")
    (tmp_path / "blocks" / ".tmp-abc.safetensors").write_bytes(b"half a write")  # a process killed mid-write
    s = PersistentStore(tmp_path, "m", "n")
    assert s.stats().entries == 0


def test_lru_budget(tmp_path: Path) -> None:
    k, v = _kv()
    s = PersistentStore(tmp_path, "m", "n", budget_bytes=10**9)
    s.put(s.key("a"), k, v, 8)
    size = s.bytes
    s.budget_bytes = 2 * size
    s.put(s.key("b"), k, v, 8)
    assert s.get(s.key("a")) is not None  # a is now more recently used than b
    s.put(s.key("c"), k, v, 8)
    assert s.key("b") not in s and s.key("a") in s and s.key("c") in s
    assert s.stats().evictions == 1 and s.bytes <= s.budget_bytes
