"""The command-line contract of docs/DESIGN.md, run as a user would (subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.backends import open_backend
from tests.helpers.engine_cli import engine_cli
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli"))


def test_generate_json_has_the_contract_fields(model: Path, tmp_path: Path) -> None:
    r = engine_cli(
        "generate",
        "--model",
        str(model),
        "--prompt",
        "The quick",
        "--max-tokens",
        "8",
        "--greedy",
        "--json",
        cache=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "tokens", "prompt_tokens", "ttft_s", "tokens_per_s", "backend", "finish_reason"}
    assert out["backend"] == "cpu" and out["prompt_tokens"] > 0
    assert out["finish_reason"] in ("length", "stop") and 1 <= len(out["tokens"]) <= 8


def test_save_load_continue_equals_one_run(model: Path, tmp_path: Path) -> None:
    common = [
        "--model",
        str(model),
        "--prompt",
        "Memory cascade",
        "--seed",
        "7",
        "--temperature",
        "1.0",
        "--json",
        "--no-prefix-cache",
    ]
    whole = engine_cli("generate", *common, "--max-tokens", "20", cache=tmp_path)
    spark = tmp_path / "conv.spark"
    first = engine_cli("generate", *common, "--max-tokens", "8", "--save-session", str(spark), cache=tmp_path)
    assert first.returncode == 0, first.stderr
    rest = engine_cli(
        "generate",
        "--model",
        str(model),
        "--load-session",
        str(spark),
        "--continue",
        "--max-tokens",
        "12",
        "--seed",
        "7",
        "--temperature",
        "1.0",
        "--json",
        "--no-prefix-cache",
        cache=tmp_path,
    )
    assert rest.returncode == 0, rest.stderr
    tokens = json.loads(first.stdout)["tokens"] + json.loads(rest.stdout)["tokens"]
    if json.loads(whole.stdout)["finish_reason"] == "length":
        assert tokens == json.loads(whole.stdout)["tokens"]
    else:  # the one run hit EOS early: the split run must agree up to there
        assert tokens[: len(json.loads(whole.stdout)["tokens"])] == json.loads(whole.stdout)["tokens"]


def test_chat_mode_uses_the_template(model: Path, tmp_path: Path) -> None:
    r = engine_cli(
        "generate", "--model", str(model), "--prompt", "hi", "--chat", "--max-tokens", "4", "--json", cache=tmp_path
    )
    raw = engine_cli("generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "4", "--json", cache=tmp_path)
    assert json.loads(r.stdout)["prompt_tokens"] > json.loads(raw.stdout)["prompt_tokens"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["generate", "--model", "/nonexistent/model", "--prompt", "x"], "does not exist"),
        (["generate", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["generate", "--prompt", "x", "--temperature", "5e-324"], "temperature"),
        (["generate", "--prompt", "x", "--temperature", "1e308"], "temperature"),
        (["generate", "--prompt", "x", "--top-p", "0"], "top-p"),
        (["generate", "--continue"], "--continue needs --load-session"),
        (["generate", "--max-tokens", "0", "--prompt", "x"], "--max-tokens"),
    ],
)
def test_errors_are_one_line_without_traceback(args: list[str], expected: str, tmp_path: Path) -> None:
    r = engine_cli(*args, cache=tmp_path)
    assert r.returncode != 0
    assert expected in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_prompt_file_that_is_a_folder(model: Path, tmp_path: Path) -> None:
    r = engine_cli("generate", "--model", str(model), "--prompt-file", str(tmp_path), cache=tmp_path)
    assert r.returncode == 2 and "is a folder" in r.stderr


def test_huge_prompt_is_refused_clearly(model: Path, tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    big.write_text("x" * 10_000_000)
    r = engine_cli("generate", "--model", str(model), "--prompt-file", str(big), cache=tmp_path)
    assert r.returncode == 2 and "more than the" in r.stderr and "Traceback" not in r.stderr


def test_sampling_defaults_come_from_generation_config_unless_flags_say_otherwise(model: Path, tmp_path: Path) -> None:
    import argparse
    import json as _json

    from engine.cli.generate import add_sampling_args, settings_from_args

    d = tmp_path / "m"
    d.mkdir()
    (d / "generation_config.json").write_text(
        _json.dumps({"do_sample": True, "temperature": 0.3, "top_p": 0.8, "max_new_tokens": 42})
    )
    p = argparse.ArgumentParser()
    add_sampling_args(p)
    s = settings_from_args(p.parse_args([]), d)
    assert (s.max_tokens, s.sampling.temperature, s.sampling.top_p, s.sampling.greedy) == (42, 0.3, 0.8, False)
    s = settings_from_args(p.parse_args(["--temperature", "0.9", "--max-tokens", "5"]), d)
    assert (s.max_tokens, s.sampling.temperature, s.sampling.top_p) == (5, 0.9, 0.8)
    (d / "generation_config.json").write_text(_json.dumps({"do_sample": False}))
    assert settings_from_args(p.parse_args([]), d).sampling.greedy
    assert not settings_from_args(p.parse_args(["--temperature", "1.0"]), d).sampling.greedy


def test_a_subcommand_missing_from_the_build_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine import cli

    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", "engine.cli.not_in_this_build")
    assert cli.main(["bench", "decode", "--json"]) == 2
    assert "not available in this build" in capsys.readouterr().err


def test_generate_speculates_with_the_same_greedy_tokens_and_reports_acceptance(model: Path, tmp_path: Path) -> None:
    common = ["--model", str(model), "--prompt", "def main():\n    return 42\ndef main():\n", "--max-tokens", "16"]
    runs = {
        mode: engine_cli("generate", *common, "--greedy", "--json", *extra, cache=tmp_path)
        for mode, extra in (
            ("default", []),
            ("off", ["--speculative", "off"]),
            ("lookup", ["--speculative", "lookup", "--draft-tokens", "3"]),
            ("draft", ["--speculative", "draft", "--draft-model", str(model), "--draft-tokens", "2"]),
        )
    }
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    out = {mode: json.loads(r.stdout) for mode, r in runs.items()}
    assert out["lookup"]["tokens"] == out["off"]["tokens"] == out["draft"]["tokens"] == out["default"]["tokens"]
    assert "accepted_per_forward" not in out["off"]
    # The default, auto, speculates greedy replies where verifying is measured to pay (native AVX-512 VNNI kernels).
    pays = open_backend(model, "cpu", "auto").backend.verify_pays
    assert ("accepted_per_forward" in out["default"]) is pays
    assert out["draft"]["accepted_per_forward"] > 1.0  # the model drafting for itself: every draft accepted
    bad = engine_cli("generate", *common, "--speculative", "draft", cache=tmp_path)
    assert bad.returncode != 0 and "--draft-model" in bad.stderr and "Traceback" not in bad.stderr


def test_greedy_takes_the_argmax_without_the_models_default_penalty(model: Path, tmp_path: Path) -> None:
    import argparse

    from engine.cli.generate import add_sampling_args, settings_from_args

    p = argparse.ArgumentParser()
    add_sampling_args(p)
    assert settings_from_args(p.parse_args([]), model).sampling.repetition_penalty == 1.1  # the tiny model's loop guard
    for flags in (["--greedy"], ["--temperature", "0"]):
        s = settings_from_args(p.parse_args(flags), model).sampling
        assert s.is_greedy and s.repetition_penalty == 1.0, flags
    s = settings_from_args(p.parse_args(["--greedy", "--repetition-penalty", "1.3"]), model).sampling
    assert s.is_greedy and s.repetition_penalty == 1.3
    assert "no repetition penalty" in " ".join(p.format_help().split())


def test_greedy_generate_runs_without_the_default_penalty(model: Path, tmp_path: Path) -> None:
    """`generate --greedy` gives the tokens of greedy with the penalty explicitly off, not those of the loop guard
    (a random tiny model repeats itself, so a penalty changes its greedy tokens)."""
    common = ["generate", "--model", str(model), "--prompt", "the the the", "--max-tokens", "24", "--json"]
    runs = [
        engine_cli(*common, *flags, cache=tmp_path)
        for flags in (
            ["--greedy"],
            ["--greedy", "--repetition-penalty", "1"],
            ["--greedy", "--repetition-penalty", "1.1"],
        )
    ]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    plain, off, guard = (json.loads(r.stdout)["tokens"] for r in runs)
    assert plain == off and off != guard
