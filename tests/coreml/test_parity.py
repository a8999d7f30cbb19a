"""The converted bundle, run by the reference interpreter, against the torch engine in fp16.

75-token prompts exercise every function (64 + 8 + 3 x 1); 64 greedy decode steps follow. Same tokens, logits
within fp16 tolerance. Quantized bundles are compared against the torch engine running the bundle's own
dequantized weights, so the check isolates the programs from the (intended) compression error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from coreml.reference import InterpreterBackend
from coreml.wrapper import ChannelRMSNorm
from engine.backends.coreml.bundle import Bundle
from engine.backends.torch_backend import TorchBackend
from engine.loading.weights import load_model
from engine.memory.base import FullAttentionMemory
from engine.model.network import SlotBatch, Transformer
from tests.helpers.coreml_bundles import ATOL, assert_parity, feed, prompt_ids, torch_fp16_with_package_weights
from tests.helpers.coreml_fixtures import model_dir_of


def test_fp16_parity_across_two_layer_chunks(coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]) -> None:
    interp = InterpreterBackend(coreml_bundle("none"))
    assert len(interp.bundle.chunks) == 2  # the hidden state crosses the host between the chunks
    torch_be = TorchBackend(coreml_tiny_dir, device="cpu", dtype=torch.float16)
    torch_be.allocate(1, interp.num_slots)
    ref_tokens, got_tokens = assert_parity(torch_be, interp, prompt_ids(75, interp.config.vocab_size))
    assert got_tokens == ref_tokens  # the unquantized bundle reproduces all 64 greedy tokens


@pytest.mark.parametrize("variant", ["int8", "int4", "lut4", "lut6"])
def test_quantized_parity_against_dequantized_weights(
    variant: str, coreml_tiny_dir: Path, coreml_tied_dir: Path, coreml_bundle: Callable[[str], Path], tmp_path: Path
) -> None:
    pkg = coreml_bundle(variant)
    model_dir = model_dir_of(variant, coreml_tiny_dir, coreml_tied_dir)
    interp = InterpreterBackend(pkg)
    assert interp.bundle.tied  # the host embedding decodes rows of the compressed head
    torch_be = torch_fp16_with_package_weights(pkg, tmp_path / "dequantized")
    torch_be.allocate(1, interp.num_slots)

    def up_proj(folder: Path) -> torch.Tensor:  # as stored, independent of the CPU backend's runtime layout
        return load_model(folder, dtype=torch.float16).model.model.layers[0].mlp.up_proj.weight

    assert not torch.equal(up_proj(tmp_path / "dequantized"), up_proj(model_dir))  # really compressed ...
    assert_parity(torch_be, interp, prompt_ids(75, interp.config.vocab_size, seed=1))  # ... and computed right


def test_prefill_runs_the_head_only_for_the_used_row(coreml_bundle: Callable[[str], Path]) -> None:
    interp = InterpreterBackend(coreml_bundle("none"))
    memory = FullAttentionMemory(interp)
    ids = prompt_ids(72, interp.config.vocab_size, seed=2)
    full = interp.forward(torch.tensor([ids]), memory.plan(ids).as_batch())
    interp.allocate(1, interp.num_slots)
    memory = FullAttentionMemory(interp)
    last = interp.forward(torch.tensor([ids]), memory.plan(ids).as_batch(), last_only=True)
    assert last.shape == (1, 1, interp.config.vocab_size)
    torch.testing.assert_close(last[0, 0], full[0, -1], atol=0, rtol=0)


def test_query_summary_is_the_mean_pre_rope_query_per_kv_group(
    coreml_tiny_dir: Path, coreml_bundle: Callable[[str], Path]
) -> None:
    """(B, L, Hkv, D): per layer, q_proj(input_norm(x)) (+ bias) averaged over the step's tokens and the query heads
    of each KV group, across calls of different sizes (64 + 8 + 3 x 1) and across layer chunks."""
    interp = InterpreterBackend(coreml_bundle("none"))
    c = interp.config
    ids = prompt_ids(75, c.vocab_size, seed=4)
    memory = FullAttentionMemory(interp)
    interp.forward(torch.tensor([ids]), memory.plan(ids).as_batch(), last_only=True)
    got = interp.query_summary()
    assert (
        got is not None
        and got.shape == (1, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)
        and got.dtype == torch.float32
    )
    model = load_model(coreml_tiny_dir, dtype=torch.float32).model
    normed: list[torch.Tensor] = []
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda m, i, o: normed.append(o)) for layer in model.model.layers
    ]
    with torch.inference_mode():
        model.forward_causal(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    sd = load_model(coreml_tiny_dir, dtype=torch.float32).model.state_dict()
    for i, hn in enumerate(normed):
        q = hn[0] @ sd[f"model.layers.{i}.self_attn.q_proj.weight"].T  # (T, H*D)
        if c.qkv_bias:
            q = q + sd[f"model.layers.{i}.self_attn.q_proj.bias"]
        want = q.view(len(ids), c.num_key_value_heads, c.num_kv_groups, c.head_dim).mean(dim=(0, 2))  # (Hkv, D)
        torch.testing.assert_close(got[0, i], want, atol=2e-2, rtol=2e-2)


def test_rmsnorm_in_layernorm_form_is_exact_and_does_not_overflow() -> None:
    """concat([y, -y, c, -c]) LayerNorm equals RMSNorm (eps included), in fp32 and in fp16 with |x| up to 6e4."""
    torch.manual_seed(0)
    c, eps = 96, 1e-5
    weight = torch.rand(c) + 0.5
    norm = ChannelRMSNorm(weight, eps)
    for scale in (1e-3, 1.0, 300.0, 6e4):
        x = torch.randn(1, c, 1, 5) * scale
        x = x.clamp(-65000, 65000)
        want = x / torch.sqrt(x.pow(2).mean(dim=1, keepdim=True) + eps) * weight[None, :, None, None]
        got32 = norm.float()(x.float())
        torch.testing.assert_close(got32, want, atol=2e-3, rtol=2e-3)
        got16 = ChannelRMSNorm(weight, eps)(x.half()).float()
        assert torch.isfinite(got16).all()
        torch.testing.assert_close(got16, want, atol=2e-2, rtol=2e-2)


def test_fp16_accumulation_mode_drifts_but_stays_bounded(coreml_bundle: Callable[[str], Path]) -> None:
    """The ANE-pessimistic interpreter (fp16 sums) differs from the default one, within a stated bound."""
    pkg = coreml_bundle("none")
    wide, narrow = InterpreterBackend(pkg), InterpreterBackend(pkg, accumulate="fp16")
    ids = prompt_ids(72, wide.config.vocab_size, seed=6)
    a = feed(wide, FullAttentionMemory(wide), ids)
    b = feed(narrow, FullAttentionMemory(narrow), ids)
    drift = float((a - b).abs().max())
    assert 0 < drift < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_large_vocabulary_is_split_below_the_ane_limit(coreml_big_vocab: tuple[Transformer, Path]) -> None:
    """V = 16384 + 616: the LM head is split in two pieces (logits_0, logits_1) and the tied matrix is stored once,
    in the head, where the host embedding reads rows on both sides of the split."""
    model, pkg = coreml_big_vocab
    backend = InterpreterBackend(pkg)
    assert list(backend.bundle.vocab_pieces) == [(0, 16384), (16384, 17000)]
    assert Bundle.open(pkg).tied and not (pkg / "embed.bin").exists()
    cache = model.new_cache(1, 64)
    ids = [5, 16383, 16384, 16999, 42, 16500]  # ids on both sides of the split
    for t, tok in enumerate(ids):
        mask = torch.zeros(1, 1, 1, 64, dtype=torch.bool)
        mask[..., : t + 1] = True
        batch = SlotBatch(torch.tensor([[t]]), torch.tensor([[t]]), torch.arange(64)[None], mask)
        with torch.inference_mode():
            ref = model(torch.tensor([[tok]]), cache, batch).float()
        got = backend.forward(torch.tensor([[tok]]), batch)
        assert got.shape == (1, 1, 17000)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        assert int(got.argmax()) == int(ref.argmax())
    assert np.isfinite(got.numpy()).all()
