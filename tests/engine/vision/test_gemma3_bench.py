"""`bench vision` on the tiny Gemma 3 folder (its template writing Gemma 3's own image marker): both engines read
the same prompt, and every headline is reported."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.bench import vision
from tests.helpers.tiny_gemma3 import PARTS_TEMPLATE, TOKENS_PER_IMAGE, make_tiny_gemma3

pytest.importorskip("transformers")


def test_bench_vision_reports_its_headlines(tmp_path: Path) -> None:
    folder = make_tiny_gemma3(tmp_path / "gemma3", chat_template=PARTS_TEMPLATE)
    args = argparse.Namespace(model=folder, backend="cpu", quantize="auto", threads=None, quick=True)
    out = vision.run(args)
    assert out["prompt_tokens"] == out["peer_prompt_tokens"] > TOKENS_PER_IMAGE + 2  # the picture and its markers
    for key in ("encode_ms", "ttft_ms", "peer_encode_ms", "peer_ttft_ms"):
        assert out[key] > 0
    assert set(out["ratio_vs_peer"]) == {"encode", "ttft"}
