"""The weights are resident once: after a backend has copied a GGUF's blocks, the file's mapping gives its pages
back, and loading never imports torch._dynamo (torch.cat or init on meta tensors would: ~70 MB)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import prefill
from engine.hw.memory import own_mappings
from engine.loading.gguf import GGUFModel
from engine.memory.base import FullAttentionMemory
from tests.helpers.real_model import real_gguf

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _mapped_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path`."""
    return sum(m.sizes.get("Rss") or 0 for m in own_mappings() if m.path == str(path)) // 1024


def _kib_at(address: int) -> int:
    """Resident KiB of the one mapping of this process that holds `address` (not of every mapping of its file:
    another test's GGUFModel of the same file may be unmapped meanwhile)."""
    held = next(m for m in own_mappings() if m.start <= address < m.end)
    return (held.sizes.get("Rss") or 0) // 1024


def test_release_pages_gives_back_the_blocks_and_keeps_every_byte() -> None:
    path = real_gguf().resolve()
    gm = GGUFModel(path)
    stored = gm.stored_tensors()
    before = {name: np.array(t.data, copy=True) for name, t in stored.items()}  # reads every block: resident
    assert _mapped_kib(path) * 1024 > 0.9 * sum(b.nbytes for b in before.values())

    gm.release_pages()

    # What stays is at most a huge page at either end (the header's tail is faulted in with the first tensor).
    assert _mapped_kib(path) <= 2 * 2048 + 64
    for name, t in stored.items():  # faulted back in from the file, unchanged
        assert np.array_equal(np.asarray(t.data), before[name]), name


def test_a_matrix_gives_its_pages_back_chunk_by_chunk() -> None:
    """Copying or checking a large matrix releases each chunk of rows once read (StoredTensor.row_chunks): the
    file's pages and the copy are never both resident whole."""
    path = real_gguf().resolve()
    gm = GGUFModel(path)
    emb = gm.stored_tensors()["model.embed_tokens.weight"]  # 28 MB of Q8_0
    chunks = list(emb.row_chunks())
    assert len(chunks) >= 3 and chunks[0][0] == 0 and chunks[-1][1] == emb.shape[0]
    assert all(b == a for (_, b), (a, _) in itertools.pairwise(chunks))  # rows covered once, in order
    gm.release_pages()
    held = np.array(emb.data, copy=True)  # every page resident again
    row_kib = emb.data.nbytes / emb.shape[0] / 1024
    at = emb.data.ctypes.data
    for a, b in chunks:
        before = _kib_at(at)
        emb.release((a, b))
        after = _kib_at(at)
        # At least that chunk's whole pages go; the rest of the matrix stays, but for the neighbours of a huge page
        # the chunk's edge splits (a file-backed huge page is unmapped whole: up to 2 MB each side).
        assert before - after >= (b - a) * row_kib - 8
        assert after >= (emb.shape[0] - b) * row_kib - 2 * 2048
    emb.release()
    # What stays is at most the huge pages the matrix shares with its neighbours at either end (faulted in whole).
    assert _kib_at(at) <= 2 * 2048 + 64 and np.array_equal(np.asarray(emb.data), held)


def test_a_loaded_model_reads_no_page_of_its_file_while_it_runs() -> None:
    """The backend runs its own copy: neither loading nor a forward leaves the file's pages resident (a norm read
    in place once mapped in megabytes of the weights around it, where the page cache holds large folios)."""
    path = real_gguf().resolve()
    backend = TorchBackend(path, "cpu", quantize="auto")
    backend.allocate(1, 64)
    assert _mapped_kib(path) <= 1024
    assert prefill(backend, FullAttentionMemory(backend), list(range(100, 132)), 16) is not None
    assert _mapped_kib(path) <= 1024


def test_loading_the_default_model_does_not_import_dynamo() -> None:
    code = (
        "import sys, torch\n"
        "from engine.backends.torch_backend import TorchBackend\n"
        f"TorchBackend({str(real_gguf())!r}, device='cpu', quantize='auto')\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
