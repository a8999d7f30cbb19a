"""A runtime that never answers: a Core ML load or prediction past its bound is abandoned with one sentence, the
registry falls back to the next backend saying why, and remembers it for that model. Off-Mac through a fake
runtime that hangs (tests/helpers/fake_coreml.py); the compute plan, which only macOS provides, in `mac` tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from coreml.convert import cached_bundle
from engine.backends import REGISTRY, BackendEntry, open_backend
from engine.backends.base import Backend, BackendProbe
from engine.backends.coreml.runtime import CoreMLBackend
from engine.backends.coreml.watchdog import Health, RuntimeHung, Watchdog
from engine.backends.memo import MEMO_NAME, BackendMemo
from engine.memory.base import FullAttentionMemory
from tests.helpers.coreml_bundles import feed, prompt_ids
from tests.helpers.coreml_fixtures import SLOTS
from tests.helpers.fake_coreml import HangingLoader

BOUND = 0.2  # seconds a call may take before it counts as hung (the fake hangs until released)


@pytest.fixture()
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()  # the abandoned threads return once the test is over


def one_sentence(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text.endswith("."), text
    return text


def test_a_call_past_its_bound_is_abandoned_and_the_runtime_refuses_after(release: threading.Event) -> None:
    reasons: list[str] = []
    dog = Watchdog(Health(on_hang=reasons.append), load_s=BOUND, predict_s=BOUND)
    assert dog.predict(lambda: 7) == 7
    with pytest.raises(ValueError, match="boom"):  # an error in the call is the call's, re-raised here
        dog.predict(lambda: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(RuntimeHung) as e:
        dog.load(release.wait)
    assert "loading the model" in one_sentence(e.value) and reasons == [str(e.value)]
    ran: list[bool] = []
    for watchdog in (dog, dog.fork()):  # later calls, and a fork's, refuse at once without running
        with pytest.raises(RuntimeHung):
            watchdog.predict(lambda: ran.append(True))
    assert not ran and len(reasons) == 1


def test_a_core_ml_load_that_never_returns_is_refused_in_one_sentence(
    coreml_tied_dir: Path, default_bundle: Path, coreml_cache: Path
) -> None:
    loader = HangingLoader(hang_load=True)
    try:
        backend = CoreMLBackend(
            coreml_tied_dir, cache_dir=coreml_cache, loader=loader, watchdog=Watchdog(load_s=BOUND, predict_s=BOUND)
        )
        with pytest.raises(RuntimeHung) as e:
            backend.allocate(1, SLOTS)
        one_sentence(e.value)
    finally:
        loader.release.set()


def test_a_prediction_that_never_returns_is_refused_and_remembered(
    coreml_tied_dir: Path, default_bundle: Path, coreml_cache: Path, tmp_path: Path
) -> None:
    loader = HangingLoader(hang_load=False)
    memo = BackendMemo(tmp_path)
    health = Health(on_hang=lambda reason: memo.avoid(coreml_tied_dir, "coreml", reason))
    try:
        backend = CoreMLBackend(
            coreml_tied_dir,
            cache_dir=coreml_cache,
            loader=loader,
            watchdog=Watchdog(health, load_s=60, predict_s=BOUND),
        )
        backend.allocate(1, SLOTS)
        ids = prompt_ids(8, backend.config.vocab_size)
        assert torch.isfinite(feed(backend, FullAttentionMemory(backend), ids)).all()
        loader.hang_predict = True
        with pytest.raises(RuntimeHung) as e:
            feed(backend, FullAttentionMemory(backend), ids)
        assert "a prediction" in one_sentence(e.value)
        assert memo.avoided(coreml_tied_dir) == {"coreml": str(e.value)}
    finally:
        loader.release.set()


def test_auto_falls_back_past_a_hung_runtime_and_remembers_it_for_the_model(
    coreml_tied_dir: Path, tmp_path: Path, release: threading.Event
) -> None:
    opened: list[str] = []

    def hanging_open(model_dir: Path, quantize: str, on_hang: object) -> Backend:
        opened.append("coreml")
        Watchdog(Health(on_hang=on_hang), load_s=BOUND).load(release.wait)  # type: ignore[arg-type]
        raise AssertionError("the watchdog lets no hung load through")

    registry = {**REGISTRY, "coreml": BackendEntry(lambda: BackendProbe("coreml", True, ""), hanging_open)}
    memo = BackendMemo(tmp_path)
    first = open_backend(coreml_tied_dir, "auto", memo=memo, registry=registry)
    assert first.backend.name == "cpu" and opened == ["coreml"]
    assert "coreml: Core ML did not finish loading the model" in first.explain()
    assert (tmp_path / MEMO_NAME).is_file()
    second = open_backend(coreml_tied_dir, "auto", memo=memo, registry=registry)
    assert second.backend.name == "cpu" and opened == ["coreml"]  # not tried again: no second hang
    assert "earlier on this model: Core ML did not finish loading" in second.explain()


def test_a_damaged_memo_is_no_memo(tmp_path: Path, coreml_tied_dir: Path) -> None:
    for text in ("{not json", "[1, 2]", '{"x": 5}', "[" * 100_000):
        (tmp_path / MEMO_NAME).write_text(text)
        assert BackendMemo(tmp_path).avoided(coreml_tied_dir) == {}
    BackendMemo(tmp_path).avoid(coreml_tied_dir, "coreml", "why")
    assert BackendMemo(tmp_path).avoided(coreml_tied_dir) == {"coreml": "why"}


@pytest.mark.mac
def test_the_compute_plan_says_which_units_run_the_model(coreml_tied_dir: Path, coreml_cache: Path) -> None:
    backend = CoreMLBackend(coreml_tied_dir, cache_dir=coreml_cache, convert=cached_bundle)
    backend.allocate(1, SLOTS)
    plan = backend.compute_devices()
    assert plan is not None and plan
    for shares in plan.values():
        assert abs(sum(shares.values()) - 1.0) < 1e-6


def test_without_a_loaded_bundle_there_is_no_compute_plan(coreml_tied_dir: Path) -> None:
    assert CoreMLBackend(coreml_tied_dir, loader=HangingLoader()).compute_devices() is None
