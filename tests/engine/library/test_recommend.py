"""Recommendations follow the machine: what fits its memory, what runs well on its backends, what to pick first."""

from __future__ import annotations

from engine.library.catalog import load_catalog
from engine.library.recommend import Fit, Machine, Measured, recommend

GB = 1 << 30


def _by_id(machine: Machine) -> dict[str, tuple[Fit, bool, str]]:
    return {r.model.id: (r.fit, r.first_pick, r.file.quantization) for r in recommend(load_catalog(), machine)}


def test_a_16gb_mac_with_the_gpu_picks_the_8b() -> None:
    rows = _by_id(Machine(16 * GB, ("coreml", "mps", "cpu")))
    assert rows["qwen3-8b"] == (Fit.RUNS_WELL, True, "Q4_K_M")
    assert sum(first for _, first, _ in rows.values()) == 1
    assert "smollm2-135m" not in rows  # the bundled model is not a download


def test_an_8gb_mac_is_not_offered_the_8b() -> None:
    rows = _by_id(Machine(8 * GB, ("mps", "cpu")))
    assert rows["qwen3-8b"][0] is Fit.TOO_BIG and rows["qwen3-4b"][0] is not Fit.TOO_BIG
    first = [model for model, (_, pick, _) in rows.items() if pick]
    assert len(first) == 1 and rows[first[0]][0] is Fit.RUNS_WELL and first[0] != "qwen3-8b"


def test_a_cpu_only_machine_prefers_lighter_weights() -> None:
    accelerated = _by_id(Machine(32 * GB, ("cuda", "cpu")))
    cpu = _by_id(Machine(32 * GB, ("cpu",)))
    assert accelerated["qwen3-8b"][0] is Fit.RUNS_WELL and cpu["qwen3-8b"][0] is Fit.FITS


def test_a_small_machine_gets_smaller_files_or_nothing() -> None:
    rows = _by_id(Machine(4 * GB, ("cpu",)))
    assert rows["qwen3-8b"][0] is Fit.TOO_BIG
    assert rows["llama3.2-1b"][1:] == (False, "Q4_K_M")  # its Q8_0 is too big here, its Q4_K_M fits
    assert sum(pick for _, pick, _ in rows.values()) == 1
    nothing = _by_id(Machine(3 * GB, ("cpu",)))
    assert not any(pick for _, pick, _ in nothing.values())
    catalog = load_catalog()
    text = {m.id for m in catalog.models if not m.vision}
    assert all(fit is Fit.TOO_BIG for model, (fit, _, _) in nothing.items() if model in text)
    assert nothing["smolvlm-256m"][0] is not Fit.TOO_BIG  # a small vision model fits, listed but never the first pick


def test_a_two_core_cpu_is_not_told_to_fetch_what_it_cannot_run_at_a_chatting_pace() -> None:
    machine = Machine(16 * GB, ("cpu",), threads=1)  # 2 cores: 1 decoding thread (one is left to the window)
    rows = _by_id(machine)
    assert rows["qwen3-8b"][0] is Fit.SLOW and not rows["qwen3-4b"][1]  # memory alone said "fits" and "best pick"
    pick = next(r for r in recommend(load_catalog(), machine) if r.first_pick)
    assert pick.fit is Fit.RUNS_WELL and pick.tokens_per_s >= 10
    assert machine.processors == "1 CPU thread"


def test_the_loaded_models_measured_speed_is_this_computers() -> None:
    fast = Machine(16 * GB, ("cpu",), threads=1, measured=Measured(800 << 20, 40.0))  # 32 GB/s read
    slow = Machine(16 * GB, ("cpu",), threads=15, measured=Measured(800 << 20, 2.0))  # many cores, measured slow
    assert _by_id(fast)["qwen3-8b"][0] is Fit.FITS and _by_id(slow)["qwen3-8b"][0] is Fit.SLOW
    tiny = Machine(16 * GB, ("cpu",), threads=1, measured=Measured(100 << 20, 60.0))  # overhead-bound: not used
    assert tiny.bytes_per_s == Machine(16 * GB, ("cpu",), threads=1).bytes_per_s
    assert "graphics processor" in Machine(16 * GB, ("mps", "cpu"), threads=8).processors
