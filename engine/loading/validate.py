"""`validate_gguf`: everything loading a GGUF checks, without loading its weights (the model library runs it after
each download, before the file is offered).

The header against the file's size (engine.loading.gguf_header), the metadata and every tensor's shape and layer
against the architecture (engine.loading.gguf_validate), every tensor's values finite, then the tokenizer built from it and its chat template
compiled and rendered once for a one-message conversation, under the template's time and size limits.
"""

from __future__ import annotations

from pathlib import Path

from engine.loading.gguf import GGUFModel
from engine.loading.tokenizer import Tokenizer

_TRIAL = [{"role": "user", "content": "Hello"}]


def validate_gguf(path: str | Path) -> None:
    """Raise one `SparkError` sentence (`ModelLoadError` or `TokenizerError`) naming what is wrong with the GGUF at
    `path`, or return when every check that loading makes passes. Reads the header, the metadata and every
    tensor's scales or values (not the weights' decoding)."""
    model = GGUFModel(Path(path))
    model.check_data()
    tokenizer = Tokenizer.from_gguf(model.tokenizer_metadata())
    tokenizer.apply_chat_template(_TRIAL, add_generation_prompt=True)
