"""The Core ML runtime backend. Off-Mac it runs through a fake of coremltools' bridge that enforces the bridge's
rules (fake_coreml.py); tests marked `mac` run real Core ML predictions (skipped off macOS on Apple Silicon)."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from coreml.convert import cached_bundle, default_slots
from coreml.reference import InterpreterBackend
from engine.backends.coreml.programs import ANE_MAX_SLOTS
from engine.backends.coreml.runtime import CoreMLBackend, compute_units_name, probe
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable
from engine.loading.model_files import read_config
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeMemory
from engine.session.engine import memory_factory_for
from tests.helpers.coreml_bundles import assert_parity, feed, prompt_ids, run_greedy
from tests.helpers.coreml_fixtures import SLOTS
from tests.helpers.fake_coreml import BridgeError, FakeLoader, FakeMLState
from tests.helpers.tiny import make_tiny_model


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


def test_int4_on_the_neural_engine_is_refused_in_one_sentence(coreml_tied_dir: Path) -> None:
    with pytest.raises(BackendUnavailable, match="int4 per-block weights run only on the GPU"):
        CoreMLBackend(coreml_tied_dir, compute_units="CPU_AND_NE", quantize="int4", loader=FakeLoader())


def test_the_fake_bridge_refuses_fp16_state_writes() -> None:
    """The bug class this fake exists for: MLState.write_state does not take float16."""
    state = FakeMLState("chunk_0", {"k_cache": np.zeros((1, 2, 32, 32), np.float16)})
    with pytest.raises(BridgeError, match="float32"):
        state.write_state("k_cache", np.ones((1, 2, 32, 32), np.float16))
    state.write_state("k_cache", np.ones((1, 2, 32, 32), np.float32))
    assert state.values["k_cache"].dtype == np.float16 and state.values["k_cache"].sum() == 2 * 32 * 32


def test_the_engine_lays_its_cascade_out_in_the_slot_count_make_app_converts_for(tmp_path: Path) -> None:
    """A model trained on more positions than a Core ML program holds: engine.session.engine fits the cascade to the
    backend's max_slots, and that slot count is the one packaging/build_coreml.py converts for (default_slots), so
    the runtime finds the shipped bundle instead of converting on the user's Mac."""
    model = make_tiny_model(tmp_path / "long", hidden=128, heads=4, kv_heads=2, intermediate=256, max_positions=4096)
    config = read_config(model)

    class SlotLimited(TorchBackend):  # what the session sees of a CoreMLBackend: its slot limit
        max_slots = CoreMLBackend.max_slots

    memory = memory_factory_for(model, prefix_cache=False)(SlotLimited(model, device="cpu", dtype=torch.float16))
    assert isinstance(memory, CascadeMemory)
    assert memory.cfg.num_slots == default_slots(model, config) == ANE_MAX_SLOTS
    unlimited = memory_factory_for(model, prefix_cache=False)(TorchBackend(model, device="cpu", dtype=torch.float16))
    assert isinstance(unlimited, CascadeMemory) and unlimited.cfg.num_slots == 4096  # elsewhere: the trained context


def test_a_missing_bundle_is_converted_only_by_a_converter_passed_in(coreml_tied_dir: Path, tmp_path: Path) -> None:
    """The runtime sits below the converter: without one it names the command that makes the bundle; with one
    (coreml.convert.cached_bundle's signature) it asks for exactly the bundle it looks up."""
    empty = tmp_path / "empty-cache"
    with pytest.raises(BackendUnavailable, match=r"no Core ML conversion for 64 slots.*python -m coreml convert"):
        CoreMLBackend(coreml_tied_dir, cache_dir=empty, loader=FakeLoader()).allocate(1, 64)
    asked: list[tuple[Path, int, str, str, Path | None]] = []

    def convert(model_dir: Path, *, slots: int, quantize: str, units: str, cache_dir: Path | None) -> Path:
        asked.append((model_dir, slots, quantize, units, cache_dir))
        raise BackendUnavailable("converter called")

    with pytest.raises(BackendUnavailable, match="converter called"):
        CoreMLBackend(coreml_tied_dir, cache_dir=empty, loader=FakeLoader(), convert=convert).allocate(1, 64)
    assert asked == [(coreml_tied_dir, 64, "none", "CPU_AND_NE", empty)]


@pytest.fixture()
def fake_backend(coreml_tied_dir: Path, default_bundle: Path, coreml_cache: Path) -> tuple[CoreMLBackend, FakeLoader]:
    loader = FakeLoader()
    backend = CoreMLBackend(coreml_tied_dir, cache_dir=coreml_cache, loader=loader)
    backend.allocate(1, SLOTS)  # finds the session's default bundle in the cache (no conversion)
    assert backend.path == default_bundle
    return backend, loader


def test_runtime_host_code_through_the_bridge_rules(
    fake_backend: tuple[CoreMLBackend, FakeLoader], default_bundle: Path
) -> None:
    """Every program is loaded once per function; predictions, state reads and writes pass the bridge's checks;
    the results equal the reference interpreter's exactly (same programs, same host code)."""
    backend, loader = fake_backend
    programs = backend.bundle.program_names
    assert sorted((p, f) for p, f, _ in loader.loaded) == sorted((p, f) for p in programs for f in backend.functions)
    assert {u for _, _, u in loader.loaded} == {"CPU_AND_NE"}
    ref = InterpreterBackend(default_bundle)
    ids = prompt_ids(40, backend.config.vocab_size)
    torch.testing.assert_close(
        feed(backend, FullAttentionMemory(backend), ids), feed(ref, FullAttentionMemory(ref), ids), atol=0, rtol=0
    )
    k, v = backend.read_kv(0, torch.arange(40))
    twin = backend.fork()
    twin.write_kv(0, torch.arange(40), k, v)  # float32 through the bridge: exact
    k2, v2 = twin.read_kv(0, torch.arange(40))
    assert k2.dtype == torch.float16 and torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.count_nonzero(backend.fork().read_kv(0, torch.arange(40))[0]) == 0  # a fork starts empty


@pytest.fixture(scope="module")
def coreml_backend(coreml_tied_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> CoreMLBackend:
    cache = tmp_path_factory.mktemp("coreml-cache")
    backend = CoreMLBackend(coreml_tied_dir, cache_dir=cache, convert=cached_bundle)
    backend.allocate(1, SLOTS)  # converts into the cache, compiles each program once, loads every function
    return backend


@pytest.mark.mac
def test_probe_is_available_on_this_mac() -> None:
    assert probe().available, probe().reason


@pytest.mark.mac
@pytest.mark.parametrize("units", ["CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"])
def test_core_ml_matches_the_torch_engine(
    units: str, coreml_tied_dir: Path, coreml_backend: CoreMLBackend, tmp_path: Path
) -> None:
    from tests.helpers.coreml_bundles import torch_fp16_with_package_weights

    backend = CoreMLBackend(
        coreml_tied_dir, compute_units=units, cache_dir=coreml_backend.cache_dir, convert=cached_bundle
    )
    backend.allocate(1, SLOTS)
    assert backend.path is not None
    torch_be = torch_fp16_with_package_weights(backend.path, tmp_path / "dequantized")
    torch_be.allocate(1, SLOTS)
    assert_parity(torch_be, backend, prompt_ids(75, backend.config.vocab_size))


@pytest.mark.mac
def test_state_write_read_round_trip_on_core_ml(coreml_backend: CoreMLBackend) -> None:
    b = coreml_backend
    b.allocate(1, SLOTS)
    memory = FullAttentionMemory(b)
    feed(b, memory, prompt_ids(40, b.config.vocab_size))
    k, v = b.read_kv(0, torch.arange(40))
    twin = b.fork()
    twin.write_kv(0, torch.arange(40), k, v)
    k2, v2 = twin.read_kv(0, torch.arange(40))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    # The restored table continues exactly as the original does.
    torch.testing.assert_close(
        twin.forward(torch.tensor([[7]]), memory.plan([7]).as_batch()),
        b.forward(torch.tensor([[7]]), memory.plan([7]).as_batch()),
        atol=0,
        rtol=0,
    )


@pytest.mark.mac
def test_compiled_once_beside_the_bundle(coreml_backend: CoreMLBackend) -> None:
    assert coreml_backend.path is not None
    for name in coreml_backend.bundle.program_names:
        assert coreml_backend.bundle.compiled_path(name).is_dir()


@pytest.mark.mac
def test_neural_engine_share_of_the_default_model(
    real_gguf_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """≥ 90 % of the estimated cost of every program function on the Neural Engine (MLComputePlan), and decode
    tokens/s of Core ML on CPU_AND_NE against the torch CPU backend in the same run."""
    from engine.backends.coreml.runtime import compute_plan_share

    backend = CoreMLBackend(real_gguf_model, cache_dir=tmp_path_factory.mktemp("real-cache"), convert=cached_bundle)
    backend.allocate(1, backend.bundle.slots if backend.path else 800)
    assert backend.path is not None
    for where, share in compute_plan_share(backend.path).items():
        ane = sum(s for d, s in share.items() if "NeuralEngine" in d)
        assert ane >= 0.9, f"{where}: {share}"
    rates = {}
    for name, b in (("coreml", backend), ("cpu", TorchBackend(real_gguf_model, device="cpu", dtype=torch.float32))):
        b.allocate(1, backend.num_slots)
        t0 = time.perf_counter()
        run_greedy(b, FullAttentionMemory(b), prompt_ids(8, b.config.vocab_size), 32, chunk=8)
        rates[name] = 32 / (time.perf_counter() - t0)
    print(f"decode tokens/s: {rates}, ratio coreml/cpu {rates['coreml'] / rates['cpu']:.2f}")
    assert rates["coreml"] > 0
