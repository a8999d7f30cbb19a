"""A tiny random SmolVLM / Idefics3 checkpoint written by transformers itself (`save_pretrained` of the model and its
processor): SigLIP encoder, pixel shuffle, connector and a Llama text model, with the tiny BPE tokenizer of
tests.helpers.tiny plus Idefics3's image tokens. Frames of 16 pixels, patches of 4: 16 patches, 4 image tokens each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import CHAT_TEMPLATE
from tests.helpers.tiny_families import text_settings
from tests.helpers.tiny_vision import init_near_identity, vision_tokenizer

IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)
]
FRAME = 16  # the vision encoder's square input, pixels
LONGEST_EDGE = 2 * FRAME  # the processor's first resize: up to 2 x 2 tiles plus the global view


def make_tiny_idefics3(
    out: Path, *, seed: int = 0, splitting: bool = True, text_overrides: dict[str, Any] | None = None
) -> Path:
    """`text_overrides`: text model settings over the defaults (a Core ML bundle needs a head dimension of 32)."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok, hf_tok = vision_tokenizer(out, IMAGE_TOKENS)
    vocab = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    text: dict[str, Any] = {
        "model_type": "llama",
        **text_settings(vocab, bos, eos),
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        **(text_overrides or {}),
    }
    vision: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": FRAME,
        "patch_size": 4,
    }
    cfg = transformers.Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg).to(torch.float32)
    init_near_identity(model, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(
            size={"longest_edge": LONGEST_EDGE},
            max_image_size={"longest_edge": FRAME},
            do_image_splitting=splitting,
        ),
        tokenizer=hf_tok,
        image_seq_len=(FRAME // 4) ** 2 // 4,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    return out
