"""Core ML test helpers: drive a backend greedily, build torch references from a bundle's own (dequantized)
weights, compare the two, count a bundle's op types."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from coreml.interpreter import Interpreter
from coreml.wrapper import engine_state_dict
from engine.backends.base import Backend
from engine.backends.coreml.bundle import HEAD, Bundle, chunk_name
from engine.backends.coreml.embedding import HostEmbedding
from engine.backends.torch_backend import TorchBackend
from engine.memory.base import FullAttentionMemory, Memory
from engine.model.config import ModelConfig


def feed(backend: Backend, memory: Memory, ids: list[int]) -> torch.Tensor:
    """One step of `ids` (any length: the package backend splits it); returns logits (T, V) float32."""
    plan = memory.plan(ids)
    out = backend.forward(torch.tensor([ids], dtype=torch.long), plan.as_batch())
    memory.after_forward()
    return out[0]


def run_greedy(
    backend: Backend, memory: Memory, prompt: list[int], steps: int, forced: list[int] | None = None, chunk: int = 75
) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill `prompt` in steps of `chunk`, then `steps` decode steps: (every step's logits, argmax tokens).

    With `forced`, those tokens are fed instead of the argmax (teacher forcing), so two backends stay on the same
    sequence and every step's logits can be compared even where a near-tie flips an argmax.
    """
    logits = [feed(backend, memory, prompt[i : i + chunk]) for i in range(0, len(prompt), chunk)]
    tokens: list[int] = []
    for i in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(feed(backend, memory, [forced[i] if forced is not None else tokens[-1]]))
    return logits, tokens


def bundle_state_dict(bundle_path: Path) -> dict[str, torch.Tensor]:
    """The engine state dict of exactly the weights a bundle's programs use (constexpr ops applied)."""
    bundle = Bundle.open(bundle_path)
    chunks = [
        (a, Interpreter(bundle.package(chunk_name(i))).functions["decode"].consts)
        for i, (a, _) in enumerate(bundle.chunks)
    ]
    head = Interpreter(bundle.package(HEAD)).functions["decode"].consts
    embed = HostEmbedding(bundle)(np.arange(bundle.config.vocab_size))
    return engine_state_dict(chunks, head, embed, bundle.config)


def torch_fp16_with_package_weights(package: Path, out: Path) -> TorchBackend:
    """A torch fp16 backend running exactly the weights the bundle's programs use (constexpr ops applied), with
    the bundle's own config (the model may be a GGUF, which has no config.json to copy)."""
    state = bundle_state_dict(package)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(Bundle.open(package).config.raw), encoding="utf-8")
    config = ModelConfig.from_file(out / "config.json")
    if config.tie_word_embeddings:  # stored once, as in the bundle: the head's (dequantized) matrix
        assert torch.equal(state["model.embed_tokens.weight"], state["lm_head.weight"])
        del state["lm_head.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return TorchBackend(out, device="cpu", dtype=torch.float16)


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def op_types(bundle: Bundle) -> Counter[str]:
    return Counter(
        op.type
        for name in bundle.program_names
        for fn in bundle.package(name).spec.mlProgram.functions.values()
        for b in fn.block_specializations.values()
        for op in b.operations
    )


DECODE_STEPS = 64
ATOL = 3e-2  # logits are O(3); fp16 carries ~3 significant digits, and the program's op order differs from torch's


def assert_parity(
    reference: Backend, candidate: Backend, prompt: list[int], steps: int = DECODE_STEPS
) -> tuple[list[int], list[int]]:
    """The torch engine decodes greedily; the candidate is fed the same tokens. Every step's logits agree within
    ATOL, and the candidate picks the same token wherever the reference's top-2 margin exceeds 2 * ATOL (a closer
    call is a tie at fp16 precision)."""
    ref_logits, ref_tokens = run_greedy(reference, FullAttentionMemory(reference), prompt, steps)
    got_logits, got_tokens = run_greedy(candidate, FullAttentionMemory(candidate), prompt, steps, forced=ref_tokens)
    assert len(got_logits) == len(ref_logits)
    for r, g in zip(ref_logits, got_logits, strict=True):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r.float(), atol=ATOL, rtol=0)
    for step, (r, ref_tok, got_tok) in enumerate(zip(ref_logits[:-1], ref_tokens, got_tokens, strict=True)):
        top2 = r[-1].float().topk(2).values
        if float(top2[0] - top2[1]) > 2 * ATOL:
            assert got_tok == ref_tok, f"decode step {step}: {got_tok} != {ref_tok}"
    return ref_tokens, got_tokens
