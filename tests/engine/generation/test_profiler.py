"""The profiler's parts add up, cover every listed category, export a valid Chrome trace, and cost nothing when off."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.profiler import Breakdown, Profiler
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from tests.helpers.tiny import make_tiny_model

SETTINGS = GenerationSettings(max_tokens=10, sampling=SamplingSettings(greedy=True), prefill_chunk=8)
LAYERS = 3


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[TorchBackend, Tokenizer]:
    d = make_tiny_model(tmp_path_factory.mktemp("tiny"), layers=LAYERS)
    return TorchBackend(d), Tokenizer.from_dir(d)


def run(backend: TorchBackend, tok: Tokenizer, profiler: Profiler | None) -> list[int]:
    b = backend.fork()
    b.allocate(1, 64)
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    gen = (
        profiler.stream_generate(b, FullAttentionMemory(b), tok, ids, SETTINGS)
        if profiler
        else stream_generate(b, FullAttentionMemory(b), tok, ids, SETTINGS)
    )
    return [ev.token for ev in gen if ev.token is not None]


def hooks(backend: TorchBackend) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in backend.model.modules())


def timed_run(backend: TorchBackend, tok: Tokenizer, profiler: Profiler) -> tuple[list[int], list[float]]:
    """A profiled run whose steps the caller times itself: the tokens and each event's wait (seconds)."""
    b = backend.fork()
    b.allocate(1, 64)
    gen = profiler.stream_generate(
        b, FullAttentionMemory(b), tok, tok.encode("The quick brown fox jumps over the lazy dog."), SETTINGS
    )
    tokens, waits = [], []
    while True:
        start = time.perf_counter()
        event = next(gen, None)
        if event is None:
            return tokens, waits
        waits.append(time.perf_counter() - start)
        if event.token is not None:
            tokens.append(event.token)


def test_sum_error_is_the_share_no_part_covers() -> None:
    assert Breakdown("decode", 2, 1.0, {"a": 0.5, "b": 0.3}).sum_error == pytest.approx(0.2)
    assert Breakdown("decode", 2, 1.0, {"a": 0.7, "b": 0.4}).sum_error == pytest.approx(0.1)  # parts over the total
    assert Breakdown("decode", 0, 0.0, {}).sum_error == 0.0


def test_parts_add_up_and_cover_every_category(three_layers: tuple[TorchBackend, Tokenizer]) -> None:
    backend, tok = three_layers
    prof = Profiler()
    tokens, waits = timed_run(backend, tok, prof)
    assert tokens == run(backend, tok, None)  # profiling changes no result
    outside = {"prefill": waits[0], "decode": sum(waits[1:])}  # each step runs inside one wait for an event
    for kind, steps in (("prefill", 1), ("decode", len(waits) - 1)):
        bd = prof.breakdown(kind)
        assert bd.steps == steps and 0 < bd.total_s <= outside[kind]
        assert all(v >= 0 for v in bd.parts.values())
        expected = {"embedding", "lm_head", "paging", "backend_overhead", "sampling", "detokenize"}
        expected |= {f"layer.{i}.{p}" for i in range(LAYERS) for p in ("attention", "mlp")}
        assert expected <= set(bd.parts)
        assert set(bd.categories()) >= {
            "attention",
            "mlp",
            "embedding",
            "lm_head",
            "paging",
            "backend_overhead",
            "sampling",
            "detokenize",
        }
        covered = sum(bd.parts.values())
        assert covered <= bd.total_s * (1 + 1e-9)  # parts are disjoint pieces of the steps
        # Against the waits timed out here (which hold the steps): what the parts leave uncovered is at most the
        # share of the waits they leave.
        assert 0 <= bd.sum_error <= 1 - covered / outside[kind] + 1e-9
        slowest = bd.bottlenecks(3)
        assert [s for _, s in slowest] == sorted((s for _, s in slowest), reverse=True)
        assert slowest[0][0] in bd.categories()
    assert prof.bottlenecks(1)[0] == prof.breakdown("decode").bottlenecks(1)[0]


def test_zero_cost_when_off(three_layers: tuple[TorchBackend, Tokenizer]) -> None:
    backend, tok = three_layers
    before = hooks(backend)
    prof = Profiler()
    gen = prof.stream_generate(backend.fork(), FullAttentionMemory(backend), tok, [5, 6, 7], SETTINGS)
    next(gen)
    assert hooks(backend) > before  # hooks exist only while a profiled run is going
    list(gen)
    assert hooks(backend) == before


def test_chrome_trace(three_layers: tuple[TorchBackend, Tokenizer], tmp_path: Path) -> None:
    backend, tok = three_layers
    prof = Profiler()
    run(backend, tok, prof)
    data = json.loads(prof.export_chrome_trace(tmp_path / "trace.json").read_text())
    events = data["traceEvents"]
    assert len(events) == len(prof.spans)
    assert all(e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    steps = [e for e in events if e["cat"] == "step"]
    assert {e["name"] for e in steps} == {"prefill_step", "decode_step"}
    for e in events:  # every part lies inside its step
        step = next(s for s in steps if s["args"]["step"] == e["args"]["step"])
        assert step["ts"] <= e["ts"] + 1e-3 and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3


def test_bench_profile_smoke(tmp_path: Path) -> None:
    import argparse

    from engine.bench import profile as bench

    d = make_tiny_model(tmp_path / "m", layers=2)
    out = bench.run(argparse.Namespace(model=d, backend="cpu", threads=None, quick=True, json=True, quantize="auto"))
    assert out["numerics"].startswith("torch-cpu-float32-wq8_0native")  # auto = Q8_0 blocks on the cpu backend
    assert 0 <= out["sum_error"] < 1
    assert out["slowest"] in out["decode"]["categories_ms_per_step"]
    # Decoding steps on the native kernels are one part (all layers and the head in one call), not overhead.
    assert out["decode"]["categories_ms_per_step"]["native_step"] > 0
    assert json.loads(Path(out["chrome_trace"]).read_text())["traceEvents"]
