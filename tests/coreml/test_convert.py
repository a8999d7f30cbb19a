"""Provenance, the conversion cache and its keys, atomic writes, and the CLI's error contract."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from coreml import convert as conv
from coreml.__main__ import main
from coreml.convert import REQUIRED_PROVENANCE, Geometry, atomic_package, cache_key, cached_package
from coreml.errors import ConversionError
from coreml.package import Package
from engine.weights import load_model


def test_provenance_is_in_the_package_metadata(tiny_dir: Path, package: Callable[[str], Path]) -> None:
    prov = Package.open(package("int4")).provenance
    assert set(REQUIRED_PROVENANCE) <= set(prov)
    assert prov["fingerprint"] == load_model(tiny_dir).fingerprint
    assert prov["quantize"] == "int4" and prov["slots"] == "160"
    assert json.loads(prov["functions"]) == {"prefill": 64, "prefill_8": 8, "decode": 1}
    assert prov["coremltools"] == "9.0" and prov["torch"].startswith("2.")
    assert prov["cache_key"] == cache_key(prov["fingerprint"], Geometry(160), "int4")


def test_cache_key_changes_with_everything_that_changes_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    base = cache_key("fp", Geometry(256), "none")
    assert base == cache_key("fp", Geometry(256), "none")
    others = {cache_key("fp2", Geometry(256), "none"), cache_key("fp", Geometry(288), "none"), cache_key("fp", Geometry(256), "lut4"),
              cache_key("fp", Geometry(256, (("decode", 1),)), "none")}
    monkeypatch.setattr(conv, "tool_versions", lambda: {"coremltools": "9.1", "torch": "2.13.0"})
    others.add(cache_key("fp", Geometry(256), "none"))
    assert base not in others and len(others) == 5


def test_cache_converts_once_and_rebuilds_a_corrupt_entry(
    tiny_dir: Path, package: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seed the cache with the session's package (same model, geometry, quantization) instead of converting again.
    key = Package.open(package("none")).provenance["cache_key"]
    shutil.copytree(package("none"), tmp_path / f"{key}.mlpackage")
    builds: list[Path] = []
    monkeypatch.setattr(conv, "build_package", lambda model, fp, out, **kw: builds.append(out) or out)
    stages: list[str] = []
    assert cached_package(tiny_dir, slots=160, cache_dir=tmp_path, progress=lambda s, f: stages.append(s)) == tmp_path / f"{key}.mlpackage"
    assert builds == [] and stages == ["Using the cached Core ML package"]
    (tmp_path / f"{key}.mlpackage" / "Manifest.json").write_text("{")  # a damaged entry is never trusted
    cached_package(tiny_dir, slots=160, cache_dir=tmp_path)
    assert builds == [tmp_path / f"{key}.mlpackage"]


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    final = tmp_path / "model.mlpackage"
    with pytest.raises(RuntimeError):
        with atomic_package(final) as tmp:
            tmp.mkdir()
            (tmp / "Manifest.json").write_text("{}")
            assert not final.exists()  # a reader looking for the package finds nothing while it is written
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_replacing_a_package_is_atomic(tmp_path: Path) -> None:
    final = tmp_path / "model.mlpackage"
    final.mkdir()
    (final / "old").write_text("old")
    with atomic_package(final) as tmp:
        tmp.mkdir()
        (tmp / "new").write_text("new")
        assert (final / "old").exists()  # the old package stays whole until the rename
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.mlpackage"]


def test_conversion_failure_in_coremltools_is_one_sentence_and_leaves_no_package(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coremltools as ct

    def refuse(*args, **kwargs):
        raise RuntimeError("PyTorch convert function for op 'fancy_attention' not implemented.")

    monkeypatch.setattr(ct, "convert", refuse)
    with pytest.raises(ConversionError, match="cannot convert the op 'fancy_attention'"):
        conv.convert(tiny_dir, tmp_path / "out.mlpackage", slots=128)
    assert list(tmp_path.iterdir()) == []


def test_cli_errors_are_one_line_on_stderr(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(tiny_dir, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert main(["convert", "--model", str(gpt2), "--out", str(tmp_path / "x.mlpackage")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPT2LMHeadModel" in err[0] and "not supported" in err[0]
    assert main(["convert", "--model", str(tiny_dir), "--out", str(tmp_path / "y.mlpackage"), "--slots", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiple of 32" in err[0]
    assert not any(p.suffix == ".mlpackage" for p in tmp_path.iterdir())


def test_check_passes_a_sound_package(package: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(package("lut4"))]) == 0
    out = capsys.readouterr().out
    assert "ok   ANE rules" in out and "ok   reference run" in out and out.strip().endswith("sound")
