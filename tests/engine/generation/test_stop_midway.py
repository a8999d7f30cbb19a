"""A Stop while a prompt is read acts between two layers of a chunk, and the chunk it stops is taken back whole: the
memory then holds exactly the chunks before it, and reading on gives what an uninterrupted read gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import FinishReason, GenerationSettings, prefill, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.model.network import ForwardCancelled
from engine.model.slots import SlotBatch
from tests.engine.memory.cascade.helpers import random_ids
from tests.helpers.stopping import StopAt
from tests.helpers.tiny import make_tiny_model

LAYERS = 4
CHUNK = 8
# A prefill polls once before each chunk, then the forward once before each layer but the first.
POLLS_PER_CHUNK = 1 + (LAYERS - 1)
# 4 sinks and a 24-token window: a chunk from token 28 on pushes tokens out of the window into episodic memory.
SMALL = CascadeConfig(sink_tokens=4, window=24, block_size=8, retrieval_blocks=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("stop") / "tiny", layers=LAYERS, max_positions=512)


class LayerCounting:
    """The backend, counting the forwards a stop interrupted."""

    def __init__(self, inner: TorchBackend) -> None:
        self.inner = inner
        self.cancelled = 0

    def forward(
        self, tokens: torch.Tensor, batch: SlotBatch, last_only: bool = False, should_stop: StopAt | None = None
    ) -> torch.Tensor:
        try:
            return self.inner.forward(tokens, batch, last_only, should_stop)
        except ForwardCancelled:
            self.cancelled += 1
            raise

    def expect(self, slots: int) -> None:
        self.inner.expect(slots)


def memory_for(kind: str, backend: TorchBackend) -> Memory:
    if kind == "full":
        backend.allocate(1, 128)
        return FullAttentionMemory(backend)
    return CascadeMemory(backend, SMALL)


def mid_chunk(chunk_index: int, layer: int) -> int:
    """The poll that comes before `layer` (1..LAYERS-1) of chunk `chunk_index`."""
    return chunk_index * POLLS_PER_CHUNK + 1 + layer


@pytest.mark.parametrize("kind", ["full", "cascade"])
@pytest.mark.parametrize("layer", [1, LAYERS - 1])
def test_a_stopped_chunk_is_taken_back_and_reading_on_is_exact(model: Path, kind: str, layer: int) -> None:
    ids = random_ids(72, seed=5)
    stopped_in = 5  # tokens 40..47: on the cascade this chunk pushes tokens out of the window
    backend = TorchBackend(model)
    counting = LayerCounting(backend)
    memory = memory_for(kind, backend)
    stop = StopAt(mid_chunk(stopped_in, layer))
    assert prefill(counting, memory, ids, CHUNK, should_stop=stop) is None  # type: ignore[arg-type]
    assert counting.cancelled == 1  # stopped inside the forward, not between chunks
    assert memory.tokens == ids[: stopped_in * CHUNK]

    twin_backend = TorchBackend(model)
    twin = memory_for(kind, twin_backend)  # fed only the chunks before the stop
    prefill(twin_backend, twin, ids[: stopped_in * CHUNK], CHUNK)
    if isinstance(memory, CascadeMemory):
        assert isinstance(twin, CascadeMemory)
        assert memory.working.evicted == twin.working.evicted > 0
        assert memory.working.state() == twin.working.state()
        assert memory.episodic.state()[0] == twin.episodic.state()[0]
        assert memory.prefix.hasher.hexdigest() == twin.prefix.hasher.hexdigest()

    # Reading on from there gives the logits of one uninterrupted read, and so does the decoding after it.
    rest = prefill(backend, memory, ids[stopped_in * CHUNK :], CHUNK)
    whole_backend = TorchBackend(model)
    whole = memory_for(kind, whole_backend)
    want = prefill(whole_backend, whole, ids, CHUNK)
    assert rest is not None and want is not None
    torch.testing.assert_close(rest, want, atol=0, rtol=0)
    assert memory.tokens == whole.tokens


def test_a_stop_while_reading_ends_the_reply_cancelled_with_the_chunks_before_it(model: Path) -> None:
    backend = TorchBackend(model)
    memory = memory_for("full", backend)
    ids = random_ids(40, seed=2)
    settings = GenerationSettings(max_tokens=8, prefill_chunk=CHUNK, sampling=SamplingSettings(greedy=True))
    stop = StopAt(1 + mid_chunk(3, 2))  # stream_generate polls once before the prefill
    events = list(stream_generate(backend, memory, Tokenizer.from_dir(model), ids, settings, should_stop=stop))
    assert [(e.token, e.finish_reason) for e in events] == [(None, FinishReason.CANCELLED)]
    assert memory.tokens == ids[: 3 * CHUNK]
