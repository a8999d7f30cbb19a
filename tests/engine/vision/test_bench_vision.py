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
    args.peer_python = None
    if vision.peer_python(args) is not None:
        pytest.skip("llama_cpp imports here: the peer would be llama.cpp's mtmd")
    out = vision.run(args)
    assert out["peer"] == "transformers" and out["encoder"] == "vision encoder: PyTorch cpu float32"
    assert out["prompt_tokens"] == out["peer_prompt_tokens"] > 5 * 4  # 2 x 2 tiles and the global view, 4 tokens each
    assert out["image"] == "896x896" and out["quantize"] == "none"
    for key in ("encode_ms", "ttft_ms", "peer_encode_ms", "peer_ttft_ms"):
        assert out[key] > 0
    assert set(out["ratio_vs_peer"]) == {"encode", "ttft"}


def test_a_text_model_is_refused(tmp_path: Path) -> None:
    from engine.errors import SparkError
    from tests.helpers.tiny import make_tiny_model

    args = argparse.Namespace(model=make_tiny_model(tmp_path / "text"), backend="cpu", quantize="auto", threads=None)
    args.quick, args.peer_python = True, None
    with pytest.raises(SparkError, match="is not a vision model folder"):
        vision.run(args)


def test_the_peer_interpreter_is_the_one_named(tmp_path: Path) -> None:
    args = argparse.Namespace(peer_python="/opt/lcp/bin/python")
    assert vision.peer_python(args) == "/opt/lcp/bin/python"


FAKE_PEER = """import json, sys
print(json.dumps({"ready": True, "llama_cpp": "fake"}), flush=True)
for n, line in enumerate(sys.stdin):
    size = len(open(line.strip(), "rb").read())
    print(json.dumps({"encode_ms": 1.5 * size, "ttft_ms": 2.0 + n, "prompt_tokens": 7, "token": 3}), flush=True)
"""


def fake_interpreter(tmp_path: Path, body: str) -> str:
    """An executable standing for the peer's interpreter: it runs `body` whatever script and flags it is given."""
    import sys

    path = tmp_path / "fake-python"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return str(path)


def test_the_mtmd_peer_is_driven_a_picture_at_a_time(tmp_path: Path) -> None:
    python = fake_interpreter(tmp_path, FAKE_PEER)
    peer = vision.MtmdPeer(python, tmp_path / "t.gguf", tmp_path / "m.gguf", "<image>Q", 2, tmp_path)
    try:
        assert peer.version == "fake"
        assert peer.ask(b"12345") == (7.5, 2.0)
        assert peer.ask(b"1") == (1.5, 3.0) and peer.prompt_tokens == 7
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_a_failing_peer_is_one_sentence(tmp_path: Path) -> None:
    from engine.errors import SparkError

    python = fake_interpreter(tmp_path, 'print(\'{"error": "mtmd could not load m.gguf"}\')')
    with pytest.raises(SparkError, match=r"mtmd peer failed: mtmd could not load m\.gguf"):
        vision.MtmdPeer(python, tmp_path / "t.gguf", tmp_path / "m.gguf", "<image>", 1, tmp_path)
    python = fake_interpreter(tmp_path, 'import os, sys; print("[New LWP 1]", flush=True); os.abort()')
    with pytest.raises(SparkError, match="was killed by signal 6"):
        vision.MtmdPeer(python, tmp_path / "t.gguf", tmp_path / "m.gguf", "<image>", 1, tmp_path)
