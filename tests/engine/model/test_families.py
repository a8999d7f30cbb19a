"""Qwen3, Gemma 3 and Phi-3 as transformers writes them: our logits equal transformers' in fp32, from the Hugging
Face folder and from a GGUF written from it, and Gemma 3's sliding-window layers see only their window, in full
attention and in the cascade."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.generation.batch import generate_batch
from engine.generation.loop import GenerationSettings, decode_step, prefill
from engine.generation.sampling import SamplingSettings
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade import CascadeMemory
from engine.memory.cascade.config import CascadeConfig
from engine.model.config import ModelConfig
from tests.helpers.gguf_files import write_gguf
from tests.helpers.hf_greedy import hf_greedy_tokens
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_families import FAMILIES, GEMMA_WINDOW, make_tiny_family

ATOL = 2e-5
IDS = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))  # 5x Gemma's tiny window


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_family(tmp_path_factory.mktemp(request.param) / request.param, request.param)


def hf_logits(d: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        out: torch.Tensor = m(ids).logits[0]  # (T, V)
    return out


def backend(model: Path, slots: int = 64) -> TorchBackend:
    b = TorchBackend(model, "cpu", kv_dtype=torch.float32)  # fp32 KV: the math compared at fp32 tolerance
    b.allocate(1, slots)
    return b


def test_config_reads_each_family(family_dir: Path) -> None:
    cfg = ModelConfig.from_file(family_dir / "config.json")
    family = family_dir.name
    assert cfg.qk_norm == (family in ("qwen3", "gemma3"))
    assert cfg.sandwich_norms == cfg.scale_embeddings == (family == "gemma3")
    if family == "gemma3":
        assert cfg.layer_windows == (GEMMA_WINDOW,) * 5 + (0,)
        assert cfg.rope_local_theta == 10000.0 and cfg.rope_theta == 1000000.0
        assert cfg.query_scale == pytest.approx(24**-0.5) and cfg.hidden_act == "gelu_pytorch_tanh"
        assert cfg.tie_word_embeddings
    else:
        assert cfg.layer_windows == () and cfg.plain_llama == (family == "phi3")


def test_prefill_and_step_decode_match_transformers(family_dir: Path) -> None:
    ref = hf_logits(family_dir)
    b = backend(family_dir)
    memory = FullAttentionMemory(b)
    seq = IDS[0].tolist()
    last = prefill(b, memory, seq[:20], chunk=7)  # large and small steps, past Gemma's window of 8
    assert torch.allclose(last, ref[19], atol=ATOL), (last - ref[19]).abs().max()
    for t in range(20, 40):
        step = decode_step(b, memory, seq[t])
        assert torch.allclose(step, ref[t], atol=ATOL), (t, (step - ref[t]).abs().max())


def test_one_prefill_matches_transformers(family_dir: Path) -> None:
    ref = hf_logits(family_dir)
    b = backend(family_dir)
    ours = b.forward(IDS, FullAttentionMemory(b).plan(IDS[0].tolist()).as_batch())[0]  # (T, V)
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_written_from_the_folder_matches_transformers(family: str, tmp_path: Path) -> None:
    # A Gemma 3 GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim**-0.5, so the folder does too.
    extra = {"query_pre_attn_scalar": 16} if family == "gemma3" else {}
    d = make_tiny_family(tmp_path / family, family, **extra)
    gguf_path = write_gguf(d, tmp_path / f"{family}.gguf", "f32")
    b = backend(gguf_path)
    folder = ModelConfig.from_file(d / "config.json")
    assert dataclasses.replace(b.config, rms_norm_eps=folder.rms_norm_eps) == folder  # the eps went through fp32

    ours = b.forward(IDS, FullAttentionMemory(b).plan(IDS[0].tolist()).as_batch())[0]
    ref = hf_logits(d)
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


def _with_window(src: Path, out: Path, window: int, all_sliding: bool = False) -> Path:
    """A copy of a Gemma folder with another sliding window (and every layer sliding, when asked)."""
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["sliding_window"] = window
    if all_sliding:
        cfg["layer_types"] = ["sliding_attention"] * cfg["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_gemma_sliding_layers_see_only_their_window(tmp_path: Path) -> None:
    d = make_tiny_family(tmp_path / "gemma3", "gemma3")
    wide = _with_window(d, tmp_path / "wide", 512)  # the same weights, every layer seeing everything
    ref, ref_wide = hf_logits(d), hf_logits(wide)
    # Past the window the two models differ: a layer that saw past its window would give the wide logits.
    assert (ref[GEMMA_WINDOW + 4 :] - ref_wide[GEMMA_WINDOW + 4 :]).abs().max() > 1e-2
    assert torch.allclose(ref[:GEMMA_WINDOW], ref_wide[:GEMMA_WINDOW], atol=ATOL)
    b = backend(d)
    memory = FullAttentionMemory(b)
    seq = IDS[0].tolist()
    prefill(b, memory, seq[:12], chunk=12)
    for t in range(12, 40):
        step = decode_step(b, memory, seq[t])
        assert torch.allclose(step, ref[t], atol=ATOL), (t, (step - ref[t]).abs().max())


def test_cascade_pages_nothing_into_sliding_layers(tmp_path: Path) -> None:
    """Every layer sliding: the output depends on the last 8 tokens only, so however the cascade evicts, keeps
    sinks and pages blocks back in, its logits equal transformers' full forward, where a sink or a retrieved block
    seen by a sliding layer would change them."""
    d = _with_window(make_tiny_family(tmp_path / "gemma3", "gemma3"), tmp_path / "sliding", 8, all_sliding=True)
    ids = torch.randint(0, 300, (1, 120), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(d, ids)
    b = backend(d)
    cfg = CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=2, gate_rank=0, reroute_every=4)
    memory = CascadeMemory(b, cfg)
    seq = ids[0].tolist()
    prefill(b, memory, seq[:16], chunk=16)
    for t in range(16, 120):
        step = decode_step(b, memory, seq[t])
        assert torch.allclose(step, ref[t], atol=ATOL), (t, (step - ref[t]).abs().max())
    assert memory.episodic.blocks and memory.working.resident_blocks > 0  # blocks were paged in all along


def test_batched_rows_give_sliding_layers_their_window(tmp_path: Path) -> None:
    """Rows of different lengths in one padded forward (the server's batches): each row's sliding layers see
    their own window, so every row's greedy reply is transformers'."""
    d = make_tiny_family(tmp_path / "gemma3", "gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompts = [IDS[0, :23].tolist(), IDS[0, 3:14].tolist(), IDS[0, 1:31].tolist()]
    settings = GenerationSettings(max_tokens=12, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    got = generate_batch(backend(d, 128), Tokenizer.from_dir(d), prompts, settings)
    assert [c.tokens for c in got] == [hf_greedy_tokens(hf, p, 12) for p in prompts]


def test_llama32_tied_gguf_matches_transformers(tmp_path: Path) -> None:
    """Llama 3.2's shape: tied embeddings (no output.weight in its GGUF) and llama3 rope scaling (rope_freqs)."""
    d = make_tiny_model(tmp_path / "llama32", "llama3", tie=True)
    gguf_path = write_gguf(d, tmp_path / "llama32.gguf", "f32")
    b = backend(gguf_path)
    assert b.config.tie_word_embeddings and b.config.rope_freq_factors is not None
    ours = b.forward(IDS, FullAttentionMemory(b).plan(IDS[0].tolist()).as_batch())[0]
    ref = hf_logits(d)
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()
