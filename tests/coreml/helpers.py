"""Drive a backend greedily and build torch references from a package's own (dequantized) weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from coreml.bundle import HEAD, Bundle, chunk_name
from coreml.embedding import HostEmbedding
from coreml.interpreter import Interpreter
from coreml.wrapper import engine_state_dict
from engine.backends.base import Backend
from engine.backends.torch_backend import TorchBackend
from engine.memory.base import Memory
from engine.model.config import ModelConfig

# Slot table of the shared bundles: full-attention parity (75-token prompt + 64 decode steps) fits, and so does
# the cascade geometry used by the paging test (4 sinks + 3x16 retrieval + 96 window = 148 -> 160).
SLOTS = 160
# Forces the fp16 bundle of the 2-layer tiny model into two layer chunks (one layer is ~295 KB of fp16 weights).
TWO_CHUNKS = 300_000
# variant -> (quantize, compute units, tied embeddings, max chunk bytes)
VARIANTS: dict[str, tuple[str, str, bool, int | None]] = {
    "none": ("none", "CPU_AND_NE", False, TWO_CHUNKS),
    "int8": ("int8", "CPU_AND_NE", True, None),
    "int4": ("int4", "CPU_AND_GPU", True, None),
    "lut4": ("lut4", "CPU_AND_NE", True, None),
    "lut6": ("lut6", "CPU_AND_NE", True, None),
}


def model_dir_of(variant: str, tiny_dir: Path, tied_dir: Path) -> Path:
    return tied_dir if VARIANTS[variant][2] else tiny_dir


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
