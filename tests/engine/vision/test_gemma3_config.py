"""Gemma 3's published vision config.json (gemma-3-4b-it's shape: a `text_config` and a `vision_config` holding only
what differs from transformers' defaults) reads as transformers reads it: the text model's sizes, rope and windows,
the encoder's sizes, and its pictures attending both ways."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model.config import ModelConfig
from engine.vision.gemma3 import build_tower

transformers = pytest.importorskip("transformers")

GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_the_published_config_reads_as_transformers_reads_it() -> None:
    ours = ModelConfig.from_dict(GEMMA3_4B)
    theirs = transformers.Gemma3Config(**GEMMA3_4B)
    text, vision = theirs.text_config, theirs.vision_config
    assert ours.architecture == "Gemma3ForCausalLM" and ours.image_ids and ours.images_bidirectional
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(ours, name) == getattr(text, name), name
    assert (ours.num_key_value_heads, ours.head_dim) == (text.num_key_value_heads, text.head_dim)
    assert ours.max_position_embeddings == text.max_position_embeddings
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert ours.rope_theta == full["rope_theta"] and ours.rope_local_theta == local["rope_theta"]
    assert ours.rope_scaling is not None and (ours.rope_scaling.rope_type, ours.rope_scaling.factor) == ("linear", 8.0)
    assert full["rope_type"] == "linear" and full["factor"] == 8.0
    assert ours.layer_windows == tuple(text.sliding_window if t == "sliding_attention" else 0 for t in text.layer_types)
    assert ours.query_scale is None and text.query_pre_attn_scalar == ours.head_dim  # 256**-0.5, the plain scale
    assert ours.tie_word_embeddings and ours.hidden_act == text.hidden_activation

    with torch.device("meta"):
        tower = build_tower(GEMMA3_4B, ours.hidden_size)
    cfg = tower.config
    assert (cfg.hidden_size, cfg.intermediate_size) == (vision.hidden_size, vision.intermediate_size)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (vision.num_hidden_layers, vision.num_attention_heads)
    assert (cfg.image_size, cfg.patch_size, cfg.layer_norm_eps) == (
        vision.image_size,
        vision.patch_size,
        vision.layer_norm_eps,
    )
    assert cfg.hidden_act == vision.hidden_act and tower.tokens_per_frame == 256
    assert tower.multi_modal_projector.kernel == 4  # 64 x 64 patches pooled to 16 x 16
