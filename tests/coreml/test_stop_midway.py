"""A Core ML bundle's forward polls `should_stop` between its layer chunks (run here by the reference interpreter):
a Stop while a prompt is read takes the stopped chunk back whole, and reading on gives what an uninterrupted read
gives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from coreml.reference import InterpreterBackend
from engine.generation.loop import prefill
from engine.memory.base import FullAttentionMemory
from tests.helpers.coreml_bundles import prompt_ids
from tests.helpers.stopping import StopAt

CHUNK = 16


def test_a_stop_between_layer_chunks_takes_the_chunk_back(coreml_bundle: Callable[[str], Path]) -> None:
    pkg = coreml_bundle("none")  # two layer chunks
    ids = prompt_ids(64, InterpreterBackend(pkg).config.vocab_size, seed=3)

    interp = InterpreterBackend(pkg)
    memory = FullAttentionMemory(interp)
    first = prefill(interp, memory, ids[:CHUNK], CHUNK)
    stop = StopAt(2)  # the poll before the chunk, then the one before its second layer chunk
    assert first is not None and prefill(interp, memory, ids[CHUNK : 2 * CHUNK], CHUNK, should_stop=stop) is None
    assert stop.polls == 2 and memory.tokens == ids[:CHUNK]
    got = prefill(interp, memory, ids[CHUNK:], CHUNK)

    whole = InterpreterBackend(pkg)
    want = prefill(whole, FullAttentionMemory(whole), ids, CHUNK)
    assert got is not None and want is not None
    torch.testing.assert_close(got, want, atol=0, rtol=0)
