"""The policy drives the real generation loop through the `Pacer` hook (tiny random model on CPU)."""

from __future__ import annotations

from pathlib import Path

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings, stream_generate
from engine.generation.sampling import Sample
from engine.hw.policy import HardwarePolicy, Mode
from engine.hw.thermal import ThermalState
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from tests.engine.hw.fakes import FakeMemory, FakeThermal, FakeTime
from tests.helpers.tiny import make_tiny_model


def test_serious_state_shrinks_prefill_chunks_and_paces_decode(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path / "tiny")
    backend = TorchBackend(model_dir, device="cpu")
    backend.allocate(1, 256)
    chunks: list[int] = []
    forward = backend.forward

    def recording_forward(tokens, batch, last_only=False, should_stop=None):  # type: ignore[no-untyped-def]
        chunks.append(tokens.shape[1])
        return forward(tokens, batch, last_only, should_stop)

    backend.forward = recording_forward  # type: ignore[method-assign]
    t = FakeTime()
    policy = HardwarePolicy(
        FakeThermal(ThermalState.SERIOUS), FakeMemory(), Mode.BALANCED, clock=t.clock, sleep=t.sleep
    )

    settings = GenerationSettings(max_tokens=5, prefill_chunk=256)
    events = list(
        stream_generate(
            backend,
            FullAttentionMemory(backend),
            Tokenizer.from_dir(model_dir),
            list(range(1, 151)),
            settings,
            sampler=lambda logits: Sample(7, 0.0),
            pacer=policy,
        )
    )

    assert len(events) == 5
    assert chunks[:3] == [64, 64, 22]  # 150 prompt tokens in balanced-serious chunks of at most 64
    assert t.sleeps == [0.02] * 4  # a cool-down before each decode step
