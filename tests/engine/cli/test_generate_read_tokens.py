"""`generate --json`'s `read_tokens` (tokens the model computed in this run): a compact conversation whose memory
the app kept reads it back and computes only the reply; without the kept copy it recomputes the whole memory first,
and continues with the same tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from engine.cli.generate import open_engine
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.session.kept import KeptMemory
from tests.helpers.engine_cli import engine_cli
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("read-tokens"))


def test_read_tokens_counts_what_the_model_computed(model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # the CLI's cache dir (MLOT_SPARK_CACHE_DIR): its kept memory under kept/
    # Opened as `generate` opens it (its backend, weight precision and geometry), so the numerics match.
    engine = open_engine(
        argparse.Namespace(
            model=model,
            threads=None,
            cache_dir=None,
            no_prefix_cache=True,
            backend="auto",
            quantize="auto",
            kv_type="f16",
        )
    )
    session = engine.new_session()
    settings = GenerationSettings(max_tokens=6, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    for _ in session.chat("Tell me about the harbour and its boats.", settings):
        pass
    record = tmp_path / "c.spark"
    session.save(record, compact=True)
    assert session.keep(KeptMemory(cache / "kept"), record)
    held = len(session.memory.tokens)
    args = ["generate", "--model", str(model), "--load-session", str(record), "--continue", "--max-tokens", "4"]
    args += ["--greedy", "--json"]  # (--no-prefix-cache would leave the kept memory unread too)
    kept = engine_cli(*args, cache=cache)
    assert kept.returncode == 0, kept.stderr
    from_kept = json.loads(kept.stdout)
    # The pending token and each reply token but the last go through the model; the memory is read back.
    assert from_kept["read_tokens"] == len(from_kept["tokens"]) == 4
    for entry in (cache / "kept").iterdir():
        entry.unlink()
    again = engine_cli(*args, cache=cache)
    assert again.returncode == 0, again.stderr
    replayed = json.loads(again.stdout)
    assert replayed["read_tokens"] == held + len(replayed["tokens"])  # the whole memory recomputed first
    assert replayed["tokens"] == from_kept["tokens"]
