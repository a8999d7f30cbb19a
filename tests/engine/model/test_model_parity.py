"""The heart of the suite: our Llama-family implementation equals transformers' on tiny random checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine.backends import BackendChoice
from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import GenerationSettings, decode_step, prefill
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.session.engine import Engine
from tests.helpers.hf_greedy import hf_greedy_tokens
from tests.helpers.tiny import make_tiny_model

ARCHS = ["llama", "llama3", "mistral", "qwen2"]
ATOL = 2e-5


@pytest.fixture(scope="module", params=ARCHS)
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen2 also covers tied embeddings; llama3 covers rope_scaling type llama3.
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tie=request.param == "qwen2")


def hf_model(d: Path):  # type: ignore[no-untyped-def]
    return transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def our_backend(d: Path, slots: int = 128, kv_dtype: torch.dtype = torch.float32) -> TorchBackend:
    # fp32 KV to compare the math at fp32 tolerance; the product's fp16 KV is bounded separately below.
    b = TorchBackend(d, "cpu", kv_dtype=kv_dtype)
    b.allocate(1, slots)
    return b


def test_prefill_logits_match_transformers(arch_dir: Path) -> None:
    ids = torch.randint(0, 300, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf_model(arch_dir)(ids).logits[0]  # (T, V)
    backend = our_backend(arch_dir)
    plan = FullAttentionMemory(backend).plan(ids[0].tolist())
    ours = backend.forward(ids, plan.as_batch())[0]  # (T, V)
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


def test_chunked_prefill_and_step_decode_match_transformers(arch_dir: Path) -> None:
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(arch_dir)(ids).logits[0]  # (T, V)
    backend = our_backend(arch_dir)
    memory = FullAttentionMemory(backend)
    seq = ids[0].tolist()
    last = prefill(backend, memory, seq[:20], chunk=7)  # chunks of 7, 7, 6
    assert torch.allclose(last, ref[19], atol=ATOL)
    for t in range(20, 40):
        step = decode_step(backend, memory, seq[t])
        assert torch.allclose(step, ref[t], atol=ATOL), (t, (step - ref[t]).abs().max())


def test_greedy_generation_matches_transformers_generate(arch_dir: Path) -> None:
    backend = our_backend(arch_dir, slots=256)
    engine = Engine(BackendChoice(backend, ()), Tokenizer.from_dir(arch_dir), arch_dir, FullAttentionMemory)
    session = engine.new_session()
    prompt = engine.tokenizer.encode("The quick brown fox")
    settings = GenerationSettings(max_tokens=24, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    ours = [ev.token for ev in session.complete_ids(prompt, settings)]
    assert ours == hf_greedy_tokens(hf_model(arch_dir), prompt, 24)


def test_fp16_weights_load_and_compute_in_fp32(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "fp16", dtype=torch.float16)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf_model(d).float()(ids).logits[0]
    backend = our_backend(d)
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())
    ours = backend.forward(ids, FullAttentionMemory(backend).plan(ids[0].tolist()).as_batch())[0]
    assert torch.allclose(ours, ref, atol=ATOL)


def test_fp16_kv_cache_stays_close_to_fp32_math(arch_dir: Path) -> None:
    """The product stores KV at fp16 (like Core ML, MPS and llama.cpp's default): logits move by rounding only."""
    ids = torch.randint(0, 300, (1, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(arch_dir)(ids).logits[0]  # (T, V)
    backend = our_backend(arch_dir, kv_dtype=torch.float16)
    memory = FullAttentionMemory(backend)
    seq = ids[0].tolist()
    prefill(backend, memory, seq[:10], chunk=10)
    steps = torch.stack([decode_step(backend, memory, t) for t in seq[10:]])  # (20, V)
    err = (steps - ref[10:]).abs().max() / ref.abs().max()
    assert err < 5e-3, err
    assert torch.equal(steps.argmax(-1), ref[10:].argmax(-1))
