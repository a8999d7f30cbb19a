"""`session inspect` never lets a file drive the terminal; `session verify --model` runs restore's own checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.cli import main as cli_main
from engine.session.file import restore, save_session
from engine.session.schema import LATEST_TIME
from tests.engine.session.session_fuzzing import CONFIG, World

HOSTILE = "hi \x1b]0;pwned\x07\x1b[2J\x9b31m \u202eevil\u202c \x7f end"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("session-cli"))


def _hostile_file(world: World, path: Path) -> Path:
    save_session(
        path,
        fingerprint=world.fingerprint,
        tokenizer_hash="\x1b[31m",
        messages=[{"role": "user\x1b[2J", "content": HOSTILE, "timestamp": LATEST_TIME}],
        system_prompt=HOSTILE,
        settings={},
        memory_state=(world.meta, world.tensors),
        pending_token=None,
        sampler_state=None,
        created=LATEST_TIME,
    )
    return path


def test_inspect_escapes_control_and_bidi_characters(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _hostile_file(world, tmp_path / "evil.spark")
    assert cli_main(["session", "inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b\u202e\u202c\x7f"), repr(out)
    assert "\\x1b]0;pwned\\x07" in out and "\\u202e" in out  # visible, not acted on
    assert cli_main(["session", "inspect", str(path), "--json"]) == 0
    raw = capsys.readouterr().out
    assert not any(c in raw for c in "\x1b\x07\x9b\u202e\u202c\x7f"), repr(raw)
    info = json.loads(raw)
    assert info["messages"][0]["content"] == HOSTILE and info["system_prompt"] == HOSTILE  # escaped, not altered


def test_verify_with_the_model_runs_restores_checks(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "talk.spark"
    path.write_bytes(world.files["zlib"])
    same = tmp_path / "same-model"  # the world's model with its cascade geometry in cascade.json
    shutil.copytree(world.model, same)
    (same / "cascade.json").write_text(json.dumps(CONFIG.to_dict()))
    assert cli_main(["session", "verify", str(path), "--model", str(same)]) == 0
    assert "restores on this model" in capsys.readouterr().out

    other = tmp_path / "same-weights-other-geometry"
    shutil.copytree(world.model, other)
    (other / "cascade.json").write_text(
        json.dumps({"window": 64, "block_size": 8, "sink_tokens": 4, "retrieval_blocks": 2})
    )
    assert cli_main(["session", "verify", str(path)]) == 0  # the file itself is sound
    capsys.readouterr()
    # A saved geometry other than the model's current one restores in its own layout (within the trained context):
    # verify says so, and restore agrees.
    assert cli_main(["session", "verify", str(path), "--model", str(other)]) == 0
    assert "restores on this model" in capsys.readouterr().out
    from engine.backends.torch_backend import TorchBackend
    from engine.memory.cascade import CascadeConfig, CascadeMemory

    backend = TorchBackend(other, "cpu")
    config = CascadeConfig(window=64, block_size=8, sink_tokens=4, retrieval_blocks=2)
    restored = restore(path, backend, lambda b: CascadeMemory(b, config))
    assert restored.memory.cfg.window == CONFIG.window  # laid out as saved
