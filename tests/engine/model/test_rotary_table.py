"""The rotary table holds the positions steps have reached, not the whole trained context: grown, it holds the bits
of a table computed whole, and a forward at a position it did not hold yet grows it first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.model.attention import ROTARY_GROWTH, RotaryTable, rope_cos_sin
from engine.model.config import ModelConfig
from engine.model.slots import SlotBatch
from tests.helpers.tiny import make_tiny_model

LLAMA = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "vocab_size": 64,
        "max_position_embeddings": 32768,
        "rope_theta": 500000.0,
    }
)


@pytest.mark.parametrize("local_theta", [None, 10000.0])  # one rope, or Gemma 3's two kinds
def test_a_grown_table_holds_the_bits_of_one_computed_whole(local_theta: float | None) -> None:
    cfg = dataclasses.replace(LLAMA, rope_local_theta=local_theta)
    table = RotaryTable(cfg, 20000, "cpu", torch.float32)
    assert table.size == ROTARY_GROWTH
    table.cover(ROTARY_GROWTH + 1)
    assert table.size == 2 * ROTARY_GROWTH  # grown by doubling
    table.cover(3 * ROTARY_GROWTH)
    assert table.size == 4 * ROTARY_GROWTH
    table.cover(19000)
    assert table.size == 20000  # no further than its limit
    whole = [rope_cos_sin(cfg, torch.arange(table.size))]
    if local_theta is not None:
        local = dataclasses.replace(cfg, rope_theta=local_theta, rope_scaling=None, rope_freq_factors=None)
        whole.append(rope_cos_sin(local, torch.arange(table.size)))
    half = cfg.head_dim // 2
    for kind, (cos, sin) in enumerate(whole):
        got_cos = table.cos if local_theta is None else table.cos[kind]
        got_sin = table.sin if local_theta is None else table.sin[kind]
        assert torch.equal(got_cos, cos)
        assert torch.equal(got_sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=1))  # signed
    with pytest.raises(IndexError):
        table.cover(20001)


def test_a_forward_past_the_held_positions_grows_the_table_first(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "m", max_positions=16384)
    far = TorchBackend(model, "cpu", native_chunks=False)
    whole = TorchBackend(model, "cpu", native_chunks=False)
    whole.model.rotary().cover(whole.model.rotary().limit)  # every position held up front
    at = 2 * ROTARY_GROWTH + 5
    batch = SlotBatch(
        positions=torch.tensor([[at - 1, at]]),
        write_slots=torch.tensor([[0, 1]]),
        slot_positions=torch.tensor([[at - 1, at]]),
        mask=torch.tensor([[[[True, False], [True, True]]]]),
    )
    ids = torch.tensor([[5, 7]])
    for b in (far, whole):
        b.allocate(1, 16)
    assert far.model.rotary().size <= at
    got = far.forward(ids, batch)
    assert far.model.rotary().size > at
    assert torch.equal(got, whole.forward(ids, batch))
