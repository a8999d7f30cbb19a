"""`bench vision` on the tiny SmolVLM folder: both engines read the same prompt, and every headline is reported."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.bench import vision
from tests.helpers.tiny_idefics3 import make_tiny_idefics3

pytest.importorskip("transformers")


def test_bench_vision_reports_its_headlines(tmp_path: Path) -> None:
    folder = make_tiny_idefics3(tmp_path / "smolvlm")
    (folder / "chat_template.jinja").write_text(vision.SMOLVLM_TEMPLATE)  # the template both engines render
    args = argparse.Namespace(model=folder, backend="cpu", quantize="auto", threads=None, quick=True)
    out = vision.run(args)
    assert out["prompt_tokens"] == out["peer_prompt_tokens"] > 5 * 4  # 2 x 2 tiles and the global view, 4 tokens each
    assert out["image"] == "896x896" and out["quantize"] == "none"
    for key in ("encode_ms", "ttft_ms", "peer_encode_ms", "peer_ttft_ms"):
        assert out[key] > 0
    assert set(out["ratio_vs_peer"]) == {"encode", "ttft"}


def test_a_text_model_is_refused(tmp_path: Path) -> None:
    from engine.errors import SparkError
    from tests.helpers.tiny import make_tiny_model

    args = argparse.Namespace(model=make_tiny_model(tmp_path / "text"), backend="cpu", quantize="auto", threads=None)
    args.quick = True
    with pytest.raises(SparkError, match="is not a vision model folder"):
        vision.run(args)
