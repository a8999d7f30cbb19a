"""Hostile command-line values: each is one sentence on stderr and a non-zero exit, never a traceback, a hang or
an unbounded allocation; a broken cache costs one warning, never the reply; a failed save never loses the reply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cli-hostile"))


def engine_cli(*args: str | bytes, cache: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "MLOT_SPARK_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, env=env, cwd=ROOT, timeout=300)


def one_line_error(r: subprocess.CompletedProcess[bytes], expected: str) -> None:
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2, err
    assert expected in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--threads", "-1"], "--threads must be between 1 and"),
        (["--threads", "0"], "--threads must be between 1 and"),
        (["--threads", "100000"], "--threads must be between 1 and"),
        (["--seed", str(2**64)], "--seed must be between 0 and"),
        (["--seed", "-1"], "--seed must be between 0 and"),
        (["--max-tokens", "1000000000"], "--max-tokens must be between 1 and"),
        (["--prompt-file", "/dev/zero"], "more than the"),
        ([b"--prompt", b"caf\xe9 \xff"], "--prompt is not valid UTF-8 text"),
    ],
)
def test_out_of_range_values_are_one_sentence(
    model: Path, tmp_path: Path, flags: list[str | bytes], expected: str
) -> None:
    args: list[str | bytes] = ["generate", "--model", str(model), "--max-tokens", "2", *flags]
    if not any(f in (b"--prompt", "--prompt-file") for f in flags):
        args += ["--prompt", "hi"]
    one_line_error(engine_cli(*args, cache=tmp_path), expected)


@pytest.mark.parametrize("threads", ["0", "-3", "100000"])
def test_bench_threads_are_range_checked_before_any_work(model: Path, tmp_path: Path, threads: str) -> None:
    one_line_error(
        engine_cli("bench", "decode", "--model", str(model), "--threads", threads, cache=tmp_path),
        "--threads must be between 1 and",
    )


def test_a_file_given_as_cache_dir_costs_one_warning_not_the_reply(model: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "cache-file"
    blocker.write_text("x")
    r = engine_cli(
        "generate",
        "--model",
        str(model),
        "--prompt",
        "The quick",
        "--max-tokens",
        "4",
        "--greedy",
        "--json",
        "--cache-dir",
        str(blocker),
        cache=tmp_path,
    )
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert len(json.loads(r.stdout)["tokens"]) >= 1
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "is off for this run" in warnings[0] and "Traceback" not in err, err


def test_a_failed_save_prints_the_reply_first_and_says_so_after(model: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "talk.spark"
    os.mkfifo(fifo)
    r = engine_cli(
        "generate",
        "--model",
        str(model),
        "--prompt",
        "The quick",
        "--max-tokens",
        "4",
        "--greedy",
        "--json",
        "--save-session",
        str(fifo),
        "--no-prefix-cache",
        cache=tmp_path,
    )
    assert len(json.loads(r.stdout)["tokens"]) >= 1  # the reply is out
    one_line_error(r, "The reply was printed but not saved")
