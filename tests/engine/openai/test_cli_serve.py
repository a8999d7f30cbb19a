"""`python -m engine serve` and `bench serve`: what they refuse, in one line, and how the bench finds its peer."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from engine.bench.serve import find_peer_gguf
from engine.cli import main
from engine.errors import SparkError


def test_bad_flags_are_one_line(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    assert main(["serve", "--model", str(tiny_dir), "--port", "70000"]) == 2
    assert main(["serve", "--model", str(tiny_dir), "--max-batch", "0"]) == 2
    assert main(["serve", "--model", str(tiny_dir), "--speculative", "draft"]) == 2
    assert main(["serve", "--model", str(tiny_dir), "--max-files", "0"]) == 2
    assert main(["serve", "--model", str(tiny_dir), "--max-file-bytes", str(64 * 1024**2)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --port must be between 0 and 65535, not 70000.",
        "error: --max-batch must be at least 1, not 0.",
        "error: --speculative draft needs --draft-model M (a smaller model of the same vocabulary).",
        "error: --max-files must be at least 1, not 0.",
        "error: --max-file-bytes may be at most 33,554,432, the most a document may weigh.",
    ]


def test_a_taken_port_is_one_line(capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        code = main(["serve", "--model", str(tiny_dir), "--port", str(port), "--cache-dir", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2
        and err[-1].startswith(f"error: Cannot listen on 127.0.0.1:{port}")
        and "Traceback" not in "".join(err)
    )


def test_bench_finds_the_peer_gguf(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    none = argparse.Namespace(peer_gguf=None)
    assert find_peer_gguf(none, folder) is None
    (folder / "w.gguf").write_bytes(b"GGUF")
    assert find_peer_gguf(none, folder) == folder / "w.gguf"
    assert find_peer_gguf(none, folder / "w.gguf") == folder / "w.gguf"
    assert find_peer_gguf(argparse.Namespace(peer_gguf=folder / "w.gguf"), tmp_path) == folder / "w.gguf"
    with pytest.raises(SparkError, match="not a file"):
        find_peer_gguf(argparse.Namespace(peer_gguf=tmp_path / "missing.gguf"), folder)
