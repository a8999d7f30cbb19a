"""Model configs in both layouts transformers writes: 4 (top-level rope_theta / rope_scaling) and 5 (rope_parameters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.errors import ModelLoadError
from engine.memory.base import FullAttentionMemory
from engine.model.config import ModelConfig, RopeScaling
from tests.helpers.tiny import make_tiny_model


def logits(model: Path) -> torch.Tensor:
    ids = torch.arange(1, 30)[None]
    backend = TorchBackend(model, "cpu", kv_dtype=torch.float32)
    backend.allocate(1, 64)
    return backend.forward(ids, FullAttentionMemory(backend).plan(ids[0].tolist()).as_batch())[0]


@pytest.mark.parametrize("arch", ["llama", "llama3"])
def test_transformers_5_layout_gives_the_same_config_and_logits(tmp_path: Path, arch: str) -> None:
    v4 = make_tiny_model(tmp_path / "v4", arch)
    v5 = tmp_path / "v5"
    shutil.copytree(v4, v5)
    transformers.AutoConfig.from_pretrained(v4).save_pretrained(v5)  # transformers 5 writes rope_parameters
    written = json.loads((v5 / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written and "rope_scaling" not in written
    a, b = ModelConfig.from_file(v4 / "config.json"), ModelConfig.from_file(v5 / "config.json")
    assert a == b
    if arch == "llama3":
        assert a.rope_theta == 500000.0 and a.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)
    assert torch.equal(logits(v4), logits(v5))


def test_rope_parameters_by_hand_linear_and_refusals() -> None:
    base = json.loads(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    cfg = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e5, "factor": 2.0}})
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling == RopeScaling("linear", 2.0)
    assert (
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e5}}).rope_scaling
        is None
    )
    for kind in ("yarn", "dynamic"):
        with pytest.raises(ModelLoadError, match=f"{kind} rope scaling"):
            ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": kind, "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="longrope scaling lacks its factors"):  # LongRoPE: tests/.../test_longrope
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="rotary base"):
        ModelConfig.from_dict({**base, "rope_theta": -1})
