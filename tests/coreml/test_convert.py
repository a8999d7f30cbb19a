"""Provenance, chunk planning, memory check, cancellation, progress, the conversion cache and its keys, atomic
writes, hostile manifests, and the CLI's error contract."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from coreml import convert as conv
from coreml.__main__ import main
from coreml.convert import (
    atomic_dir,
    build_bundle,
    cached_bundle,
    expected_bytes,
    plan_chunks,
)
from coreml.errors import ConversionCancelled
from engine.backends.coreml import cache
from engine.backends.coreml.bundle import MANIFEST, REQUIRED, Bundle
from engine.backends.coreml.cache import Geometry, cache_key
from engine.backends.coreml.errors import ConversionError, PackageError
from engine.backends.coreml.programs import DEFAULT_QUANTIZE, resolve
from engine.backends.coreml.runtime import CoreMLBackend
from engine.loading.weights import load_model
from engine.model.config import ModelConfig
from tests.helpers.coreml_fixtures import SLOTS
from tests.helpers.fake_coreml import FakeLoader


def test_provenance_is_in_the_manifest(coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]) -> None:
    b = Bundle.open(coreml_bundle("none"))
    prov = b.provenance
    assert set(REQUIRED) <= set(prov)
    assert prov["fingerprint"] == load_model(coreml_tiny_dir).fingerprint
    assert prov["quantize"] == "none" and prov["slots"] == SLOTS and prov["units"] == "CPU_AND_NE"
    assert prov["functions"] == {"prefill": 64, "prefill_8": 8, "decode": 1}
    assert prov["chunks"] == [[0, 1], [1, 2]] and prov["tied"] is False
    assert prov["coremltools"] == "9.0" and prov["torch"].startswith("2.")
    assert prov["cache_key"] == cache_key(prov["fingerprint"], Geometry(SLOTS, max_chunk_bytes=300_000), "none")
    assert (b.path / "embed.bin").stat().st_size == b.config.vocab_size * b.config.hidden_size * 2


def test_chunks_hold_at_most_the_byte_limit_and_the_real_geometry_plans_one_chunk() -> None:
    smollm = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "tie_word_embeddings": True,
        }
    )
    assert plan_chunks(smollm, "none", 1 << 30) == [(0, 30)]  # 30 layers, ~204 MB fp16
    chunks = plan_chunks(smollm, "none", 50_000_000)
    assert chunks[0] == (0, 7) and chunks[-1][1] == 30 and all(b - a <= 7 for a, b in chunks)
    with pytest.raises(ConversionError, match="One decoder layer holds"):
        plan_chunks(smollm, "none", 1_000_000)
    # the tied matrix counts once; int8 stores a byte per weight plus a scale per row
    assert expected_bytes(smollm, "int8") < expected_bytes(smollm, "none") / 1.9


def test_compression_follows_the_compute_units() -> None:
    assert resolve("auto", "CPU_AND_NE") == DEFAULT_QUANTIZE == resolve(None, "CPU_AND_NE")
    assert resolve("int4", "CPU_AND_GPU") == "int4" and resolve("int4", "ALL") == "int4"
    for units in ("CPU_AND_NE", "CPU_ONLY"):
        with pytest.raises(ConversionError, match=f"int4 per-block weights run only on the GPU, so {units}"):
            resolve("int4", units)
    with pytest.raises(ConversionError, match="Unknown quantization"):
        resolve("q4_k", "CPU_AND_NE")


def test_memory_is_checked_before_any_work(coreml_tied_dir: Path, tmp_path: Path) -> None:
    model = load_model(coreml_tied_dir, dtype=__import__("torch").float16).model
    with pytest.raises(ConversionError, match=r"needs about .* GB of free memory and 0.0 GB are available"):
        build_bundle(model, "fp", tmp_path / "out", quantize="none", geometry=Geometry(SLOTS), available_memory=1000)
    assert list(tmp_path.iterdir()) == []


def test_progress_is_monotone_and_cancel_leaves_nothing(coreml_tied_dir: Path, tmp_path: Path) -> None:
    model = load_model(coreml_tied_dir, dtype=__import__("torch").float16).model
    seen: list[tuple[str, float]] = []

    def cancel() -> bool:
        return len(seen) >= 2  # the user presses Cancel after the first function was converted

    with pytest.raises(ConversionCancelled, match="cancelled; nothing was written"):
        build_bundle(
            model,
            "fp",
            tmp_path / "out",
            quantize="none",
            geometry=Geometry(SLOTS),
            progress=lambda s, f: seen.append((s, f)),
            cancel=cancel,
        )
    assert list(tmp_path.iterdir()) == []
    assert [f for _, f in seen] == sorted(f for _, f in seen) and seen[0][0].startswith("Converting chunk_0")


def test_cache_key_changes_with_everything_that_changes_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    base = cache_key("fp", Geometry(256), "none")
    assert base == cache_key("fp", Geometry(256), "none")
    others = {
        cache_key("fp2", Geometry(256), "none"),
        cache_key("fp", Geometry(288), "none"),
        cache_key("fp", Geometry(256), "lut4"),
        cache_key("fp", Geometry(256, (("decode", 1),)), "none"),
        cache_key("fp", Geometry(256), "none", "CPU_AND_GPU"),
        cache_key("fp", Geometry(256, max_chunk_bytes=1 << 20), "none"),
    }
    monkeypatch.setattr(cache, "tool_versions", lambda: {"coremltools": "9.1", "torch": "2.13.0"})
    others.add(cache_key("fp", Geometry(256), "none"))
    assert base not in others and len(others) == 7


def test_cache_converts_once_and_rebuilds_a_corrupt_entry(
    coreml_tied_dir: Path, default_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = default_bundle.name
    shutil.copytree(default_bundle, tmp_path / key)
    builds: list[Path] = []
    monkeypatch.setattr(conv, "build_bundle", lambda model, fp, out, **kw: builds.append(out) or out)
    stages: list[str] = []
    assert (
        cached_bundle(coreml_tied_dir, slots=SLOTS, cache_dir=tmp_path, progress=lambda s, f: stages.append(s))
        == tmp_path / key
    )
    assert builds == [] and stages == ["Using the cached Core ML model"]
    (tmp_path / key / MANIFEST).write_text("{")  # a damaged entry is never trusted
    cached_bundle(coreml_tied_dir, slots=SLOTS, cache_dir=tmp_path)
    assert builds == [tmp_path / key]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: "[1, 2]", "not a JSON object"),
        (lambda m: {k: v for k, v in m.items() if k != "chunks"}, "lacks 'chunks'"),
        (lambda m: {**m, "chunks": [[0, 1]]}, "covers 1 layers"),
        (lambda m: {**m, "chunks": [[0, 2], [2, 1]]}, "do not cover the layers in order"),
        (lambda m: {**m, "slots": -3}, "invalid slot count"),
        (lambda m: {**m, "format": "1"}, "has format"),
        (lambda m: {**m, "vocab_pieces": [[0, 10]]}, "covers 10 classes"),
    ],
)
def test_a_hostile_manifest_is_refused_in_one_sentence(
    coreml_bundle: Callable[[str], Path], tmp_path: Path, edit, message: str
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(coreml_bundle("none"), bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    changed = edit(manifest)
    (bad / MANIFEST).write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with pytest.raises(PackageError, match=message):
        Bundle.open(bad)
    assert main(["check", str(bad)]) == 1


def test_a_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    final = tmp_path / "model"
    with pytest.raises(RuntimeError), atomic_dir(final) as tmp:
        tmp.mkdir()
        (tmp / MANIFEST).write_text("{}")
        assert not final.exists()  # a reader looking for the bundle finds nothing while it is written
        raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []


def test_replacing_a_bundle_is_atomic(tmp_path: Path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / "old").write_text("old")
    with atomic_dir(final) as tmp:
        tmp.mkdir()
        (tmp / "new").write_text("new")
        assert (final / "old").exists()  # the old bundle stays whole until the rename
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_conversion_failure_in_coremltools_is_one_sentence_and_leaves_nothing(
    coreml_tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coremltools as ct

    def refuse(*args, **kwargs):
        raise RuntimeError("PyTorch convert function for op 'fancy_attention' not implemented.")

    monkeypatch.setattr(ct, "convert", refuse)
    with pytest.raises(ConversionError, match="cannot convert the op 'fancy_attention'"):
        conv.convert(coreml_tiny_dir, tmp_path / "out", slots=128)
    assert list(tmp_path.iterdir()) == []


def test_cli_errors_are_one_line_on_stderr(
    coreml_tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(coreml_tiny_dir, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert main(["convert", "--model", str(gpt2), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPT2LMHeadModel" in err[0] and "not supported" in err[0]
    assert main(["convert", "--model", str(coreml_tiny_dir), "--out", str(tmp_path / "y"), "--slots", "100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "multiple of 32" in err[0]
    assert main(["convert", "--model", str(coreml_tiny_dir), "--out", str(tmp_path / "z"), "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only on the GPU" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_check_passes_a_sound_bundle(coreml_bundle: Callable[[str], Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(coreml_bundle("lut4"))]) == 0
    out = capsys.readouterr().out
    assert (
        "ok   ANE lint: no errors" in out
        and "ok   reference run" in out
        and "ok   size" in out
        and out.strip().endswith("sound")
    )


def test_convert_without_out_fills_the_cache_the_runtime_reads(
    coreml_tied_dir: Path,
    default_bundle: Path,
    coreml_cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`python -m coreml convert` without --out answers with the bundle the runtime (which converts nothing) then
    finds by itself: here the session's default bundle, already in a cache laid out as the app's."""
    (tmp_path / "coreml").symlink_to(coreml_cache)
    monkeypatch.setenv("MLOT_SPARK_CACHE_DIR", str(tmp_path))
    assert main(["convert", "--model", str(coreml_tied_dir), "--slots", str(SLOTS)]) == 0
    made = Path(capsys.readouterr().out.strip())
    assert made == tmp_path / "coreml" / default_bundle.name
    backend = CoreMLBackend(coreml_tied_dir, loader=FakeLoader())
    backend.allocate(1, SLOTS)
    assert backend.path == made
