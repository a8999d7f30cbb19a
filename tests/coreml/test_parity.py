"""The converted program, run by the reference interpreter, against the torch engine in fp16.

75-token prompts exercise every function (64 + 8 + 3 x 1); 64 greedy decode steps follow. Same tokens, logits
within fp16 tolerance. Quantized packages are compared against the torch engine running the package's own
dequantized weights, so the check isolates the program from the (intended) compression error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from coreml.reference import InterpreterBackend
from engine.backends.base import Backend
from engine.backends.torch_backend import TorchBackend
from engine.memory import FullAttentionMemory
from engine.model import SlotBatch, Transformer
from engine.weights import load_model
from tests.coreml.helpers import prompt_ids, run_greedy, torch_fp16_with_package_weights

DECODE_STEPS = 64
ATOL = 3e-2  # logits are O(3); fp16 carries ~3 significant digits, and the program's op order differs from torch's


def assert_parity(reference: Backend, candidate: Backend, prompt: list[int]) -> tuple[list[int], list[int]]:
    """The torch engine decodes greedily; the candidate is fed the same tokens. Every step's logits agree within
    ATOL, and the candidate picks the same token wherever the reference's top-2 margin exceeds 2 * ATOL (a closer
    call is a tie at fp16 precision). In practice all 64 tokens agree for fp16 and int8 (asserted below)."""
    ref_logits, ref_tokens = run_greedy(reference, FullAttentionMemory(reference), prompt, DECODE_STEPS)
    got_logits, got_tokens = run_greedy(candidate, FullAttentionMemory(candidate), prompt, DECODE_STEPS, forced=ref_tokens)
    assert len(got_logits) == len(ref_logits)
    for r, g in zip(ref_logits, got_logits):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r.float(), atol=ATOL, rtol=0)
    for step, (r, ref_tok, got_tok) in enumerate(zip(ref_logits[:-1], ref_tokens, got_tokens)):
        top2 = r[-1].float().topk(2).values
        if float(top2[0] - top2[1]) > 2 * ATOL:
            assert got_tok == ref_tok, f"decode step {step}: {got_tok} != {ref_tok}"
    return ref_tokens, got_tokens


def test_fp16_parity_prefill_and_64_decode_steps(tiny_dir: Path, package: Callable[[str], Path]) -> None:
    interp = InterpreterBackend(package("none"))
    torch_be = TorchBackend(tiny_dir, device="cpu", dtype=torch.float16)
    torch_be.allocate(1, interp.num_slots)
    ref_tokens, got_tokens = assert_parity(torch_be, interp, prompt_ids(75, interp.config.vocab_size))
    assert got_tokens == ref_tokens  # the unquantized package reproduces all 64 greedy tokens


@pytest.mark.parametrize("quantize", ["int8", "int4", "lut4", "lut6"])
def test_quantized_parity_against_dequantized_weights(
    quantize: str, tiny_dir: Path, package: Callable[[str], Path], tmp_path: Path
) -> None:
    pkg = package(quantize)
    interp = InterpreterBackend(pkg)
    torch_be = torch_fp16_with_package_weights(tiny_dir, pkg, tmp_path / "dequantized")
    torch_be.allocate(1, interp.num_slots)
    # The weights really are compressed (not silently left fp16) ...
    def up_proj(folder: Path) -> torch.Tensor:  # as stored, independent of the CPU backend's runtime layout
        return load_model(folder, dtype=torch.float16).model.model.layers[0].mlp.up_proj.weight

    assert not torch.equal(up_proj(tmp_path / "dequantized"), up_proj(tiny_dir))
    # ... and the program computes exactly what those weights mean.
    assert_parity(torch_be, interp, prompt_ids(75, interp.config.vocab_size, seed=1))


def test_large_vocabulary_is_split_below_the_ane_limit(big_vocab: tuple[Transformer, Path]) -> None:
    """V = 16384 + 616: the embedding and LM head are split in two pieces, outputs logits_0 and logits_1."""
    model, pkg = big_vocab
    backend = InterpreterBackend(pkg)
    assert backend.vocab_pieces == [(0, 16384), (16384, 17000)]
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
