"""Chat messages for a vision model's template. Templates such as SmolVLM's iterate a message's content as parts
(`{"type": "text", "text": ...}`, `{"type": "image"}`) and render nothing for a plain string; the engine keeps
content as text with an `<image>` marker where each picture sits, so for such a template each message's text is
split at its markers into those parts (transformers' own message shape)."""

from __future__ import annotations

import re
from typing import Any

from engine.vision.idefics3 import IMAGE_TOKEN

# `x['type']`, `x["type"]` or `x.type`: the template reads content parts
_PARTS = re.compile(r"""\[\s*['"]type['"]\s*\]|\.type\b""")


def reads_parts(template: str | None) -> bool:
    """Whether a chat template reads message content as a list of typed parts."""
    return template is not None and _PARTS.search(template) is not None


def template_messages(messages: list[dict[str, Any]], template: str | None) -> list[dict[str, Any]]:
    """`messages` as `template` reads them: string content split into text and image parts where it reads parts,
    unchanged otherwise."""
    if not reads_parts(template):
        return messages
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            parts: list[dict[str, str]] = []
            for k, piece in enumerate(content.split(IMAGE_TOKEN)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts or [{"type": "text", "text": ""}]}
        out.append(m)
    return out
