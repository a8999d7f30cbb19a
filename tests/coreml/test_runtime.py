"""The Core ML runtime backend. Tests marked `mac` run real Core ML predictions (skipped off macOS on Apple
Silicon by tests/conftest.py); the rest check what must hold everywhere."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import pytest
import torch

from coreml.runtime import CoreMLBackend, compute_units_name, probe
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable
from engine.memory import FullAttentionMemory
from tests.coreml.conftest import SLOTS
from tests.coreml.helpers import feed, prompt_ids, run_greedy
from tests.coreml.test_parity import assert_parity


def test_probe_explains_why_core_ml_is_unavailable_off_mac() -> None:
    p = probe()
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        pytest.skip("this is a Mac")
    assert not p.available and "macOS 15+ on Apple Silicon" in p.reason


def test_compute_units_come_from_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLOT_SPARK_COREML_UNITS", raising=False)
    assert compute_units_name(None) == "CPU_AND_NE"
    monkeypatch.setenv("MLOT_SPARK_COREML_UNITS", "cpu_and_gpu")
    assert compute_units_name(None) == "CPU_AND_GPU"
    assert compute_units_name("CPU_ONLY") == "CPU_ONLY"
    with pytest.raises(BackendUnavailable, match="compute units"):
        compute_units_name("GPU_ONLY")


@pytest.fixture(scope="module")
def coreml_backend(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> CoreMLBackend:
    cache = tmp_path_factory.mktemp("coreml-cache")
    backend = CoreMLBackend(tiny_dir, cache_dir=cache)
    backend.allocate(1, SLOTS)  # converts into the cache, loads every function, warms up
    return backend


@pytest.mark.mac
def test_probe_is_available_on_this_mac() -> None:
    assert probe().available, probe().reason


@pytest.mark.mac
@pytest.mark.parametrize("units", ["CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"])
def test_core_ml_matches_the_torch_engine(units: str, tiny_dir: Path, coreml_backend: CoreMLBackend) -> None:
    backend = CoreMLBackend(tiny_dir, compute_units=units, cache_dir=coreml_backend.cache_dir)
    backend.allocate(1, SLOTS)
    torch_be = TorchBackend(tiny_dir, device="cpu", dtype=torch.float16)
    torch_be.allocate(1, SLOTS)
    assert_parity(torch_be, backend, prompt_ids(75, backend.config.vocab_size))


@pytest.mark.mac
def test_state_read_write_and_fork(coreml_backend: CoreMLBackend) -> None:
    b = coreml_backend
    b.allocate(1, SLOTS)
    memory = FullAttentionMemory(b)
    feed(b, memory, prompt_ids(40, b.config.vocab_size))
    k, v = b.read_kv(0, torch.arange(40))
    twin = b.fork()
    twin.write_kv(0, torch.arange(40), k, v)
    k2, v2 = twin.read_kv(0, torch.arange(40))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.count_nonzero(b.fork().read_kv(0, torch.arange(40))[0]) == 0  # a fork starts empty


@pytest.mark.mac
def test_compute_plan_and_decode_speed(coreml_backend: CoreMLBackend, tiny_dir: Path) -> None:
    from coreml.runtime import compute_plan_summary

    assert coreml_backend.package is not None
    plan = compute_plan_summary(coreml_backend.package)
    assert set(plan) >= {"prefill", "prefill_8", "decode"}
    for units in ("CPU_AND_NE", "CPU_AND_GPU"):
        b = CoreMLBackend(tiny_dir, compute_units=units, cache_dir=coreml_backend.cache_dir)
        b.allocate(1, SLOTS)
        t0 = time.perf_counter()
        run_greedy(b, FullAttentionMemory(b), prompt_ids(8, b.config.vocab_size), 32, chunk=8)
        print(f"{units}: {32 / (time.perf_counter() - t0):.1f} tokens/s (tiny model, includes host overhead)")
