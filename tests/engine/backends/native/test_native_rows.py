"""The native step of a few tokens of one row (spark_decode_rows, a speculative verify): each token's logits, the k, v
it stores and its query summaries equal, bit for bit, what one-token native steps give for the same tokens, on a
tiny checkpoint and on the default model, across a growth of the slot table, in a full-attention memory and in a
cascade; and the backend takes it for every one-row step of up to MAX_ROWS tokens, not for wider ones."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.native import load_kernels
from engine.backends.native.decoder import MAX_ROWS
from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill, settle, verify_forward
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.core import CascadeMemory
from engine.model.slots import GROWTH_SLOTS
from tests.helpers.default_model import default_model_dir
from tests.helpers.timers import NativeStepCounter
from tests.helpers.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(load_kernels().kernels is None, reason="the native kernels do not build here")


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 64 and three query heads per KV head, as SmolLM2's."""
    return make_tiny_model(tmp_path_factory.mktemp("rows-head64"), "llama", hidden=192, heads=3, kv_heads=1)


def new_memory(b: TorchBackend, kind: str) -> Memory:
    if kind == "full":
        b.allocate(1, 2 * GROWTH_SLOTS)
        return FullAttentionMemory(b)
    return CascadeMemory(b, CascadeConfig(sink_tokens=4, window=24, block_size=8, retrieval_blocks=2, gate_rank=0))


def rows_and_singles(
    chunked: TorchBackend, single: TorchBackend, kind: str, context: list[int], piece: list[int]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The same context fed to both backends; then `piece` as one chunk (its logits (T, V) and token summaries
    (T, L, Hkv, D)) and token by token (the same, stacked)."""
    a, b = new_memory(chunked, kind), new_memory(single, kind)
    prefill(chunked, a, context, chunk=64)
    prefill(single, b, context, chunk=64)
    steps = NativeStepCounter()
    with chunked.timed_parts(steps):
        logits = verify_forward(chunked, a, piece)  # (T, V)
    settle(a, 0)
    assert steps.native_steps == 1  # the whole chunk in one native call
    summaries = chunked.token_summaries()
    assert summaries is not None
    one_by_one, theirs = [], []
    for t in piece:
        one_by_one.append(decode_step(single, b, t))
        got = single.token_summaries()
        assert got is not None
        theirs.append(got[0])
    return (logits, summaries), (torch.stack(one_by_one), torch.stack(theirs))


def assert_tables_equal(x: TorchBackend, y: TorchBackend, upto: int) -> None:
    assert torch.equal(x.cache.k[:, :, :, :upto], y.cache.k[:, :, :, :upto])
    assert torch.equal(x.cache.v[:, :, :, :upto], y.cache.v[:, :, :, :upto])


@pytest.mark.parametrize("kv", [torch.float16, torch.float32])
@pytest.mark.parametrize("width", [2, 5, 8, 13, MAX_ROWS])
def test_a_chunk_equals_one_token_steps_across_a_table_growth(head64_dir: Path, width: int, kv: torch.dtype) -> None:
    chunked = TorchBackend(head64_dir, "cpu", quantize="q4_1", kv_dtype=kv)
    single = chunked.fork()
    context = [3 + (i * 7) % 200 for i in range(GROWTH_SLOTS - 1)]  # the chunk's writes grow the table
    piece = [5 + (i * 11) % 200 for i in range(width)]
    (logits, summaries), (ref_logits, ref_summaries) = rows_and_singles(chunked, single, "full", context, piece)
    assert chunked.cache.capacity > GROWTH_SLOTS  # it did grow during the chunk
    assert torch.equal(logits, ref_logits)
    assert torch.equal(summaries, ref_summaries)
    assert_tables_equal(chunked, single, len(context) + width)


@pytest.mark.parametrize("width", [3, 9])
def test_a_chunk_in_a_cascade_equals_one_token_steps(head64_dir: Path, width: int) -> None:
    chunked = TorchBackend(head64_dir, "cpu", quantize="q8_0")
    single = chunked.fork()
    context = [3 + (i * 5) % 200 for i in range(12)]  # sinks and part of the window: room for the chunk
    piece = [7 + (i * 13) % 200 for i in range(width)]
    (logits, summaries), (ref_logits, ref_summaries) = rows_and_singles(chunked, single, "cascade", context, piece)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(summaries, ref_summaries)


@pytest.mark.parametrize("width", [4, MAX_ROWS])
def test_a_chunk_on_two_threads_equals_one_token_steps(head64_dir: Path, width: int) -> None:
    """Two threads split each token's attention into chunks of its own (a long enough table): the chunk's tokens
    share their rotated keys and run their attentions as one job, yet each equals its one-token step."""
    chunked = TorchBackend(head64_dir, "cpu", quantize="q4_1")
    single = chunked.fork()
    context = [3 + (i * 7) % 200 for i in range(300)]
    piece = [5 + (i * 11) % 200 for i in range(width)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (logits, summaries), (ref_logits, ref_summaries) = rows_and_singles(chunked, single, "full", context, piece)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(summaries, ref_summaries)


def test_the_step_summary_weighs_each_token_as_the_pytorch_path_does(head64_dir: Path) -> None:
    native = TorchBackend(head64_dir, "cpu", quantize="q8_0", kv_dtype=torch.float32)
    stepwise = TorchBackend(head64_dir, "cpu", quantize="q8_0", kv_dtype=torch.float32, native_chunks=False)
    context, piece = [3 + (i * 7) % 200 for i in range(20)], [9, 8, 7, 6]
    for b in (native, stepwise):
        mem = new_memory(b, "full")
        prefill(b, mem, context, chunk=64)
        verify_forward(b, mem, piece)
    # Only the float summation order of attention differs between the paths: the summaries agree closely.
    torch.testing.assert_close(native.query_summary(), stepwise.query_summary(), atol=1e-4, rtol=1e-3)
    ours, theirs = native.token_summaries(), stepwise.token_summaries()
    assert ours is not None and theirs is not None and ours.shape == theirs.shape == (4, *ours.shape[1:])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-3)


def test_only_one_row_steps_of_up_to_max_rows_tokens_run_natively(head64_dir: Path) -> None:
    b = TorchBackend(head64_dir, "cpu", quantize="q8_0")
    mem = new_memory(b, "full")
    steps = NativeStepCounter()
    with b.timed_parts(steps):
        prefill(b, mem, list(range(3, 3 + MAX_ROWS + 1)), chunk=MAX_ROWS + 1)  # too wide: PyTorch
        assert steps.native_steps == 0
        prefill(b, mem, list(range(40, 40 + MAX_ROWS)), chunk=MAX_ROWS)
        assert steps.native_steps == 1


def test_the_default_model_chunk_equals_one_token_steps() -> None:
    chunked = TorchBackend(default_model_dir(), "cpu", quantize="auto")
    single = chunked.fork()
    context = [3 + (i * 37) % 4000 for i in range(GROWTH_SLOTS - 5)]
    for width in (2, 12):  # the kernels' row route and token-lane route
        piece = [100 + (i * 53) % 4000 for i in range(width)]
        (logits, summaries), (ref_logits, ref_summaries) = rows_and_singles(chunked, single, "full", context, piece)
        assert torch.equal(logits, ref_logits)
        assert torch.equal(summaries, ref_summaries)
        assert_tables_equal(chunked, single, len(context) + width)


def test_verify_pays_where_a_verify_is_one_call_of_kernels_measured_to_make_it_pay(head64_dir: Path) -> None:
    """`auto` speculation's signal (Backend.verify_pays): a verify in one native call (spark_decode_rows) on the
    AVX-512 VNNI kernels; not where a verify runs through PyTorch, not on fp32 PyTorch."""
    kernels = load_kernels().kernels
    assert kernels is not None
    assert not TorchBackend(head64_dir).verify_pays
    assert not TorchBackend(head64_dir, quantize="q8_0", kernels="native", native_chunks=False).verify_pays
    assert not TorchBackend(head64_dir, quantize="q8_0", kernels="native", native_steps=False).verify_pays
    native = TorchBackend(head64_dir, quantize="q8_0", kernels="native")
    assert native.verify_pays is (kernels.isa == "avx512-vnni")
