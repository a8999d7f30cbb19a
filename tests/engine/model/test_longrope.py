"""Phi-3/Phi-4's LongRoPE with partial rotary (Phi-4-mini rotates 0.75 of each head), from a tiny checkpoint
transformers writes: our logits equal transformers' in fp32, from the folder and from a GGUF written from it (its
factors as llama.cpp's rope_factors_long/short tensors), with the long factors (trained context past the original)
and the short ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill
from engine.loading.rotary_rows import partial_rotary_order, reorder_rows
from engine.memory.base import FullAttentionMemory
from engine.model.attention import rope_cos_sin
from engine.model.config import ModelConfig
from tests.helpers.gguf_files import write_gguf
from tests.helpers.tiny_families import make_tiny_family

ATOL = 2e-5
IDS = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))  # past the long case's 32
LONG = [1.0, 1.5, 2.25, 4.0, 8.0, 16.0]  # float32-exact, as a GGUF keeps them; 6 = (0.75 * 16) / 2
SHORT = [1.0, 1.0, 1.25, 1.5, 2.0, 3.0]


def longrope_phi3(out: Path, original: int) -> Path:
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "long_factor": LONG,
        "short_factor": SHORT,
        "original_max_position_embeddings": original,
    }
    return make_tiny_family(out, "phi3", rope_parameters=rope, original_max_position_embeddings=original)


def hf_logits(d: Path) -> torch.Tensor:
    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        out: torch.Tensor = m(IDS).logits[0]  # (T, V)
    return out


def backend(model: Path) -> TorchBackend:
    b = TorchBackend(model, "cpu", kv_dtype=torch.float32)
    b.allocate(1, 64)
    return b


@pytest.mark.parametrize(("original", "long"), [(32, True), (512, False)])
def test_longrope_partial_rotary_matches_transformers(original: int, long: bool, tmp_path: Path) -> None:
    d = longrope_phi3(tmp_path / "phi3", original)
    cfg = ModelConfig.from_file(d / "config.json")
    assert cfg.rotary_dims == 12 and cfg.rope_dim == 12 and cfg.long_rope == long
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "longrope"
    assert (cfg.rope_scaling.attention_factor > 1.0) == long  # factor 512 / 32 = 16: scores grow; 1 at 512 / 512
    ref = hf_logits(d)
    b = backend(d)
    ours = b.forward(IDS, FullAttentionMemory(b).plan(IDS[0].tolist()).as_batch())[0]
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()
    b = backend(d)
    memory = FullAttentionMemory(b)
    seq = IDS[0].tolist()
    assert torch.allclose(prefill(b, memory, seq[:20], chunk=7), ref[19], atol=ATOL)
    for t in range(20, 40):
        step = decode_step(b, memory, seq[t])
        assert torch.allclose(step, ref[t], atol=ATOL), (t, (step - ref[t]).abs().max())

    gguf_path = write_gguf(d, tmp_path / "phi3.gguf", "f32")
    g = backend(gguf_path)
    assert dataclasses.replace(g.config, rms_norm_eps=cfg.rms_norm_eps) == cfg  # factors and dims went through
    ours = g.forward(IDS, FullAttentionMemory(g).plan(IDS[0].tolist()).as_batch())[0]
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


def test_pass_through_channels_do_not_rotate(tmp_path: Path) -> None:
    cfg = ModelConfig.from_file(longrope_phi3(tmp_path / "phi3", 32) / "config.json")
    cos, sin = rope_cos_sin(cfg, torch.arange(100))  # (100, 16)
    passed = [6, 7, 14, 15]  # pairs i >= R/2 = 6 of D/2 = 8, at (i, i + 8)
    assert torch.equal(cos[:, passed], torch.ones(100, 4)) and torch.equal(sin[:, passed], torch.zeros(100, 4))
    order = partial_rotary_order(16, 12)
    assert sorted(order) == list(range(16)) and order[:6] == list(range(6)) and order[8:14] == list(range(6, 12))
    w = torch.randn(2 * 16, 5)
    assert torch.equal(reorder_rows(reorder_rows(w, 2, 16, 12), 2, 16, 12, back=True), w)


def test_damaged_longrope_is_one_sentence(tmp_path: Path) -> None:
    import json

    from engine.errors import ModelLoadError

    d = longrope_phi3(tmp_path / "phi3", 32)
    raw = json.loads((d / "config.json").read_text())
    raw["rope_parameters"]["long_factor"] = LONG[:4]
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="longrope factors are not 6 each") as err:
        ModelConfig.from_file(d / "config.json")
    assert "\n" not in str(err.value)


def test_a_window_past_the_trained_context_is_global_attention(tmp_path: Path) -> None:
    import json

    d = longrope_phi3(tmp_path / "phi3", 32)
    raw = json.loads((d / "config.json").read_text())
    raw["sliding_window"] = 2 * raw["max_position_embeddings"]  # as Phi-4-mini's config: 262,144 of 131,072
    cfg = ModelConfig.from_dict(raw)
    assert cfg.layer_windows == () and cfg.plain_llama  # the native step and the Core ML graph's plain layer
