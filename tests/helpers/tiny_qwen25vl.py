"""A tiny random Qwen2.5-VL checkpoint written by transformers itself (`save_pretrained` of the model and its
processor): the window-attention ViT, its 2x2 patch merger and a Qwen2 text model with multimodal rotary positions,
with the tiny BPE tokenizer of tests.helpers.tiny plus Qwen's vision tokens. Patches of 2 pixels, a 2x2 merge and
windows of 8 pixels (2x2 merged tokens), so a picture's tokens fall in several windows; block 1 of 3 attends over
the whole picture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import CHAT_TEMPLATE
from tests.helpers.tiny_families import text_settings
from tests.helpers.tiny_vision import init_near_identity, vision_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH = 2
MERGE = 2
MIN_PIXELS = 8 * 8
MAX_PIXELS = 40 * 48  # larger pictures shrink to fit (smart_resize)


def image_only_processor() -> Any:
    """Qwen2_5_VLProcessor without its video processor (which needs torchvision, not installed): images and text
    go through the processor's own code."""
    import transformers

    class ImageOnlyProcessor(transformers.Qwen2_5_VLProcessor):  # type: ignore[misc]
        @classmethod
        def get_attributes(cls) -> list[str]:
            return ["image_processor", "tokenizer"]

    return ImageOnlyProcessor


def make_tiny_qwen25vl(out: Path, *, seed: int = 0) -> Path:
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok, hf_tok = vision_tokenizer(out, VISION_TOKENS)
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    text: dict[str, Any] = {
        **text_settings(vocab, bos, eos),
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    }
    vision: dict[str, Any] = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": 2,
        "window_size": 8,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    }
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.token_to_id("<|image_pad|>"),
        video_token_id=tok.token_to_id("<|video_pad|>"),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)
    init_near_identity(model, 0.25)
    model.save_pretrained(out, safe_serialization=True)
    processor = image_only_processor()(
        image_processor=transformers.Qwen2VLImageProcessorPil(
            patch_size=PATCH, merge_size=MERGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
        ),
        tokenizer=hf_tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out
