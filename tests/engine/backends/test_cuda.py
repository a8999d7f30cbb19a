"""The CUDA path (the fallback after Core ML and MPS): the same model on a CUDA device gives the CPU's logits and
tokens, and the generation features that move tensors between steps (the cascade's paging, speculative verifies
and their rollback, beam forks, a Stop between layers, a q8_0 table) run there as on the CPU. Skipped where no CUDA
device is present, as in CI; run on a machine with one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.generation.beam import BeamSettings
from engine.generation.loop import GenerationSettings, prefill, stream_generate
from engine.generation.sampling import SamplingSettings
from engine.generation.speculative import Controller, Speculation, Speculator
from engine.loading.tokenizer import Tokenizer
from engine.memory.base import FullAttentionMemory, Memory
from engine.memory.cascade import CascadeConfig, CascadeMemory
from engine.model.kv_types import KVType
from tests.helpers.drafts import Reference
from tests.helpers.stopping import StopAt
from tests.helpers.tiny import make_tiny_model
from tests.helpers.tiny_families import FAMILIES, make_tiny_family

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingSettings(greedy=True)
SMALL = CascadeConfig(sink_tokens=4, window=24, block_size=8, retrieval_blocks=2)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("cuda") / "tiny", layers=4, max_positions=512)


def backend(d: Path, device: str, slots: int = 0) -> TorchBackend:
    b = TorchBackend(d, device, dtype=torch.float32, kv_dtype=torch.float32)
    if slots:
        b.allocate(1, slots)
    return b


def memory(kind: str, b: TorchBackend) -> Memory:
    if kind == "full":
        b.allocate(1, 256)
        return FullAttentionMemory(b)
    return CascadeMemory(b, SMALL)


def tokens(b: TorchBackend, mem: Memory, tok: Tokenizer, prompt: list[int], settings: GenerationSettings) -> list[int]:
    return [e.token for e in stream_generate(b, mem, tok, prompt, settings) if e.token is not None]


@pytest.mark.parametrize("family", ["llama", *FAMILIES])
def test_logits_and_greedy_tokens_equal_the_cpus(tmp_path: Path, four_layers: Path, family: str) -> None:
    d = four_layers if family == "llama" else make_tiny_family(tmp_path / family, family)
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 3)
    cpu, gpu = backend(d, "cpu", 256), backend(d, "cuda", 256)
    ids = torch.tensor([prompt])
    want = prefill(cpu, FullAttentionMemory(cpu), prompt, 16)
    got = prefill(gpu, FullAttentionMemory(gpu), prompt, 16)
    assert want is not None and got is not None and ids.numel() == len(prompt)
    assert got.device.type == "cpu" or got.is_cuda
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=1e-4, atol=1e-4)
    settings = GenerationSettings(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    for kind in ("full", "cascade"):  # the cascade's window slides and pages blocks back within the reply
        c, g = backend(d, "cpu"), backend(d, "cuda")
        assert tokens(g, memory(kind, g), tok, prompt, settings) == tokens(c, memory(kind, c), tok, prompt, settings)


def test_fp16_on_cuda_stays_close_to_fp32(four_layers: Path) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode("def main():\n    return 42\n")
    cpu = backend(four_layers, "cpu", 256)
    gpu = TorchBackend(four_layers, "cuda")  # the device's own dtype (fp16)
    gpu.allocate(1, 256)
    want = prefill(cpu, FullAttentionMemory(cpu), prompt, 8)
    got = prefill(gpu, FullAttentionMemory(gpu), prompt, 8)
    assert want is not None and got is not None
    assert int(got.float().cpu().argmax()) == int(want.argmax())
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=0.0, atol=5e-2)


@pytest.mark.parametrize("kind", ["full", "cascade"])
@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_speculation_on_cuda_equals_plain_decoding(four_layers: Path, kind: str, wrong: int | None) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode("def main():\n    return 42\n")
    settings = GenerationSettings(max_tokens=40, sampling=GREEDY, ignore_eos=True)
    plain_backend = backend(four_layers, "cuda")
    plain_mem = memory(kind, plain_backend)
    reference = tokens(plain_backend, plain_mem, tok, prompt, settings)
    spec_backend = backend(four_layers, "cuda")
    spec_mem = memory(kind, spec_backend)
    speculator = Speculator(Reference(reference, len(prompt), wrong), Controller(max_k=4, adaptive=False))
    spec_settings = GenerationSettings(**{**vars(settings), "speculative": Speculation.LOOKUP})
    got = [
        e.token
        for e in stream_generate(spec_backend, spec_mem, tok, prompt, spec_settings, speculator=speculator)
        if e.token is not None
    ]
    assert got == reference
    assert spec_mem.tokens == plain_mem.tokens  # no rejected draft kept


def test_beams_on_cuda_equal_the_cpus(four_layers: Path) -> None:
    tok = Tokenizer.from_dir(four_layers)
    prompt = tok.encode("The quick brown fox")
    settings = GenerationSettings(
        max_tokens=12, sampling=GREEDY, ignore_eos=True, beam=BeamSettings(beams=4, returned=4)
    )
    results = []
    for device in ("cpu", "cuda"):
        b = backend(four_layers, device, 256)
        events = list(stream_generate(b, FullAttentionMemory(b), tok, prompt, settings))
        results.append([list(h.tokens) for h in events[-1].beams])
    assert results[0] == results[1]


@pytest.mark.parametrize("kind", ["full", "cascade"])
def test_a_stop_between_layers_on_cuda_takes_the_chunk_back(four_layers: Path, kind: str) -> None:
    ids = list(range(5, 77))
    b = backend(four_layers, "cuda")
    mem = memory(kind, b)
    # one poll before each chunk, then before layers 1..3: stop before layer 2 of the sixth chunk
    assert prefill(b, mem, ids, 8, should_stop=StopAt(5 * 4 + 1 + 2)) is None
    assert mem.tokens == ids[:40]
    rest = prefill(b, mem, ids[40:], 8)  # reading on gives what one uninterrupted read gives
    whole_backend = backend(four_layers, "cuda")
    whole = memory(kind, whole_backend)
    want = prefill(whole_backend, whole, ids, 8)
    assert rest is not None and want is not None
    torch.testing.assert_close(rest.float().cpu(), want.float().cpu(), rtol=0.0, atol=0.0)
    assert mem.tokens == whole.tokens


def test_a_q8_0_table_on_cuda_reads_as_on_the_cpu(tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", heads=2, kv_heads=1)  # head dim 32: one q8_0 block per head row
    tok = Tokenizer.from_dir(d)
    prompt = tok.encode("The quick brown fox jumps over the lazy dog.")
    out = []
    for device in ("cpu", "cuda"):
        b = TorchBackend(d, device, dtype=torch.float32, kv_type=KVType.Q8_0)
        b.allocate(1, 256)
        logits = prefill(b, FullAttentionMemory(b), prompt, 4)
        assert logits is not None
        out.append(logits.float().cpu())
    torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
