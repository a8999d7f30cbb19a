"""`generate --json-schema FILE` and `--grammar FILE`: the reply follows the file on the real default model; a file
that is malformed, explosive or unreadable is one sentence on stderr before any model loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from tests.helpers.default_model import default_model_dir

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "reason": {"type": "string", "maxLength": 40}},
    "required": ["answer", "reason"],
    "additionalProperties": False,
}


def engine_cli(*args: str, cache: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, env=env, cwd=ROOT, timeout=600)


def test_json_schema_and_grammar_files_shape_the_reply(tmp_path: Path) -> None:
    model = str(default_model_dir())
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(SCHEMA))
    common = ["generate", "--model", model, "--chat", "--json", "--temperature", "1.0", "--seed", "3"]
    r = engine_cli(*common, "--prompt", "Is water wet?", "--json-schema", str(schema), cache=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    out = json.loads(r.stdout)
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["finish_reason"] == "stop"
    grammar = tmp_path / "colour.gbnf"
    grammar.write_text('root ::= "The colour is " ("red" | "green" | "blue") "."\n')
    r = engine_cli(*common, "--prompt", "Name a colour.", "--grammar", str(grammar), cache=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(r.stdout)["text"] in ("The colour is red.", "The colour is green.", "The colour is blue.")


def deep(levels: int) -> str:
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize(
    ("flag", "text", "expected"),
    [
        ("--json-schema", deep(40), "nests deeper than"),
        ("--json-schema", "[" * 100_000, "is not valid JSON"),
        ("--json-schema", '{"type": "integer", "minimum": 9, "maximum": 1}', "cannot be used"),
        ("--grammar", "start: (", "cannot be used"),
        ("--grammar", "root ::= (", "cannot be read"),
    ],
)
def test_bad_files_are_one_sentence(tmp_path: Path, flag: str, text: str, expected: str) -> None:
    path = tmp_path / "shape.txt"
    path.write_text(text)
    r = engine_cli("generate", "--prompt", "hi", flag, str(path), cache=tmp_path)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode != 0 and expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
