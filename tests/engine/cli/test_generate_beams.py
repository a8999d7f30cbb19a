"""`generate --beams N --json`: the best beam's reply with every beam's tokens, logprob and score (best first), the
same tokens as the engine's beam search in-process; bad beam flags are one sentence before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]


def engine_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, env=env, cwd=ROOT, timeout=600)


def test_generate_beams_json_reports_every_beam(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    common = ["generate", "--model", str(model), "--prompt", "The quick brown fox", "--max-tokens", "8", "--json"]
    r = engine_cli(*common, "--beams", "3", "--length-penalty", "1.0", "--no-prefix-cache", cache=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout)
    beams = out["beams"]
    assert len(beams) == 3 and beams[0]["tokens"] == out["tokens"] and beams[0]["text"] == out["text"]
    assert [b["score"] for b in beams] == sorted((b["score"] for b in beams), reverse=True)
    for b in beams:
        assert b["score"] == pytest.approx(b["logprob"] / len(b["tokens"]), rel=1e-5)
    plain = json.loads(engine_cli(*common, "--greedy", "--no-prefix-cache", cache=tmp_path).stdout)
    assert "beams" not in plain


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(["--beams", "0"], "--beams must be 1 to 16"), (["--length-penalty", "1e9", "--beams", "2"], "--length-penalty")],
)
def test_bad_beam_flags_are_one_sentence(tmp_path: Path, flags: list[str], expected: str) -> None:
    r = engine_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x", *flags, cache=tmp_path)
    assert r.returncode != 0 and expected in r.stderr.decode() and "Traceback" not in r.stderr.decode()
