"""`python -m engine models …` against the loopback Hub, and a downloaded model chatting by its listed name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main
from engine.loading.model_files import DEFAULT_MODEL_NAME, resolve_model_path
from tests.engine.library.helpers import FILE, REPO
from tests.helpers.fake_hub import FakeHub


@pytest.fixture
def cli(hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("MLOT_SPARK_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("MLOT_SPARK_CACHE_DIR", str(tmp_path / "cache"))
    return Cli(capsys)


class Cli:
    """`python -m engine ARGS` in this process (the CLI's own `main`): exit code, stdout, stderr."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = main(list(args))
        out, err = self.capsys.readouterr()
        return code, out, err


def test_download_list_chat_remove(cli: Cli) -> None:
    code, out, err = cli("models", "download", REPO, "--json")
    assert code == 0, err
    name = json.loads(out)["model"]["name"]

    listed = json.loads(cli("models", "list", "--json")[1])["models"]
    assert [m["name"] for m in listed] == [DEFAULT_MODEL_NAME, name]
    entry = listed[1]
    assert entry["family"] == "llama" and Path(entry["path"]).name == FILE
    assert entry["size_bytes"] == Path(entry["path"]).stat().st_size

    code, out, err = cli(
        "generate", "--model", name, "--prompt", "Hello", "--chat", "--max-tokens", "4", "--greedy", "--json"
    )
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) >= 1

    code, out, _ = cli("models", "remove", name, "--json")
    assert code == 0 and json.loads(out)["removed"]["name"] == name
    code, _, err = cli("models", "remove", name)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1


def test_errors_are_one_line(cli: Cli, hub: FakeHub) -> None:
    hub.add("spark-tests/gated-GGUF", {FILE: b"GGUF"}, gated=True)
    for args in (
        ["models", "download", "spark-tests/gated-GGUF"],
        ["models", "download", "spark-tests/missing"],
        ["models", "download", REPO, "--file", "nope.gguf"],
        ["models", "download", "not a repo"],
    ):
        code, _, err = cli(*args)
        assert code == 2, args
        assert err.startswith("error: ") and err.count("\n") == 1, err


def test_search_json(cli: Cli) -> None:
    code, out, err = cli("models", "search", "tiny", "--json")
    assert code == 0, err
    assert [r["id"] for r in json.loads(out)["repos"]] == [REPO]


def test_a_name_resolves_to_a_stored_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLOT_SPARK_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "some-model").mkdir(parents=True)
    (tmp_path / "models" / ".downloads").mkdir()
    assert resolve_model_path("some-model") == tmp_path / "models" / "some-model"
    assert resolve_model_path(".downloads") == Path(".downloads")  # hidden folders are never models
    assert resolve_model_path("unknown-model") == Path("unknown-model")  # left for check_model_path to word
    assert resolve_model_path(DEFAULT_MODEL_NAME).name.endswith(".gguf")
    (tmp_path / "some-model").mkdir()
    assert resolve_model_path("some-model") == Path("some-model")  # a path here wins over a stored name


def test_hostile_names_and_a_failing_hub_print_one_escaped_line(cli: Cli, hub: FakeHub) -> None:
    for args in (
        ["models", "download", REPO, "--file", "a\x1b[2Jb\nc\u202e.gguf"],
        ["models", "download", REPO, "--file", "nul\x00.gguf"],
        ["models", "download", "owner/" + "n" * 10_000],
        ["models", "remove", "x\x1b]0;title\x07"],
    ):
        code, _, err = cli(*args)
        assert code == 2, args
        assert err.startswith("error: ") and err.count("\n") == 1 and err[:-1].isprintable(), repr(err)
        assert len(err) < 1000
    hub.hostile.status = 500
    code, _, err = cli("models", "download", REPO)
    assert code == 2 and err.count("\n") == 1 and "500" in err  # no retry warnings before the one line
