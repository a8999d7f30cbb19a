"""A tiny random Gemma 3 with vision written by transformers itself (`save_pretrained` of
Gemma3ForConditionalGeneration and its Gemma3Processor): SigLIP encoder, average pooling, soft-embedding norm and
projection, and a Gemma 3 text model (five sliding layers of an 8-token window, then a global one), with the tiny
BPE tokenizer of tests.helpers.tiny plus Gemma 3's image tokens. Pictures of 32 pixels, patches of 4: 64 patches
pooled to 4 image tokens. Its chat template is tests.helpers.tiny's, or `PARTS_TEMPLATE`: Gemma 3's shape, reading
content as typed parts and writing `<start_of_image>` for an image part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny import CHAT_TEMPLATE
from tests.helpers.tiny_families import family_config
from tests.helpers.tiny_vision import init_near_identity, vision_tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE = 32  # the encoder's square input, pixels
PATCH = 4
TOKENS_PER_IMAGE = 4  # (32 / 4)**2 = 64 patches pooled 4 x 4
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['content'] is string %}{{ m['content'] | trim }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] | trim }}"
    "{% endif %}{% endfor %}{% endif %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tiny_gemma3(
    out: Path, *, seed: int = 0, chat_template: str = CHAT_TEMPLATE, query_pre_attn_scalar: int = 24
) -> Path:
    """`query_pre_attn_scalar`: 16 (the head width) for a model a Gemma 3 GGUF can hold, which scales queries so."""
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok, hf_tok = vision_tokenizer(
        out, [BOI, EOI, SOFT], {"extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}}
    )
    bos, eos = tok.token_to_id("<|bos|>"), tok.token_to_id("<|end|>")
    assert bos is not None and eos is not None
    text = family_config("gemma3", tok.get_vocab_size(), bos, eos, query_pre_attn_scalar=query_pre_attn_scalar)
    vision: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH,
        "vision_use_head": False,
    }
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=tok.token_to_id(BOI),
        eoi_token_index=tok.token_to_id(EOI),
        image_token_index=tok.token_to_id(SOFT),
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    # Gemma scales its text norms and the soft-embedding norm by 1 + w: those near the identity around 0.
    init_near_identity(model, 0.08, zero_centred=_scaled_by_one_plus)
    model.save_pretrained(out, safe_serialization=True)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=hf_tok,
        image_seq_length=TOKENS_PER_IMAGE,
        chat_template=chat_template,
    )
    processor.save_pretrained(out)
    return out


def _scaled_by_one_plus(name: str) -> bool:
    return ("language_model" in name and name.endswith("norm.weight")) or "mm_soft_emb_norm" in name
