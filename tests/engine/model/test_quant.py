"""GGUF block formats (engine.model.quant, engine.backends.blocks, engine.loading.gguf): our quantizer writes ggml's bytes,
our dequantizer reads them as the gguf package does, a GGUF's tensors run as stored (equal to quantizing the same
fp32 weights at load), the logits stay within a bound derived from each type's own rounding error, and the real
model answers the capital of France."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.backends import QUANTIZE_CHOICES, resolve_quantize
from engine.backends.blocks import BlockEmbedding, plan_blocks
from engine.backends.native.decoder import NativeBlockLinear
from engine.backends.torch_backend import TorchBackend
from engine.bench.gguf_export import export_gguf
from engine.errors import BackendUnavailable
from engine.generation.loop import GenerationSettings
from engine.generation.sampling import SamplingSettings
from engine.loading.gguf import unpermute_rows
from engine.loading.model_files import gguf_model
from engine.model.quant import BlockType, StoredTensor, check_stored, dequantize, quantize
from engine.session.engine import Engine
from tests.helpers.quant_blocks import IDS, logits_of
from tests.helpers.real_model import real_gguf, real_model_dir
from tests.helpers.tiny import make_tiny_model

TYPES = [t for t in BlockType if t.quantizable]  # the K-quants run only as a file stores them


def awkward_weights(seed: int = 0) -> np.ndarray:
    """(48, 256) float32 with the cases quantizers get wrong: zero and constant blocks, a negative extreme, exact
    rounding ties, outliers, tiny and huge magnitudes."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((48, 256)) * rng.exponential(1.0, (48, 1))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = 0.75
    w[2, 5] = -40.0
    w[3, :32] = np.linspace(-127, 127, 32) / 127  # q8 ties at .5
    w[4, :32] = np.arange(32) - 16.0  # q4 ties
    w[5] *= 1e-6
    w[6] *= 1e4
    return w


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantize_writes_ggml_reference_bytes_and_dequantize_reads_them_as_gguf_does(qtype: BlockType) -> None:
    g = getattr(gguf.GGMLQuantizationType, qtype.name)
    w = awkward_weights()
    ours = quantize(w, qtype)
    assert ours.shape == (48, 256 // 32 * qtype.block_bytes)
    assert np.array_equal(ours, gguf.quants.quantize(w, g))
    assert np.array_equal(dequantize(ours, qtype, w.shape), gguf.quants.dequantize(ours, g))
    # Any bytes (a hostile file: NaN/inf scales included) read the same way.
    junk = np.random.default_rng(1).integers(0, 256, ours.shape, dtype=np.uint8)
    with np.errstate(invalid="ignore"):  # junk scales are inf/NaN on purpose: both readers must give the same NaNs
        assert np.array_equal(dequantize(junk, qtype, w.shape), gguf.quants.dequantize(junk, g), equal_nan=True)


def test_stored_tensors_are_checked_in_one_sentence() -> None:
    good = StoredTensor("Q8_0", (4, 64), np.zeros(4 * 68, np.uint8))
    assert check_stored(good) is BlockType.Q8_0
    with pytest.raises(ValueError, match="holds 10 bytes, not the 272"):
        check_stored(StoredTensor("Q8_0", (4, 64), np.zeros(10, np.uint8)), "w")
    with pytest.raises(ValueError, match="multiple of 32"):
        check_stored(StoredTensor("Q4_0", (4, 50), np.zeros(4 * 18, np.uint8)), "w")
    with pytest.raises(ValueError, match="not a block format here"):
        check_stored(StoredTensor("IQ2_XXS", (4, 256), np.zeros(4 * 66, np.uint8)), "w")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant-llama"), "llama")  # untied head


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant-qwen"), "qwen2", tie=True)  # q/k/v biases, tied head


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant-tied"), "llama", tie=True)


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_gguf_runs_as_stored_exactly_as_the_same_weights_quantized_at_load(
    llama_dir: Path, tied_dir: Path, tmp_path: Path, qtype: BlockType, tie: bool
) -> None:
    model_dir = tied_dir if tie else llama_dir
    path = export_gguf(model_dir, tmp_path / "m.gguf", qtype.name.lower())  # gguf.GGUFWriter, llama.cpp's row order
    stored = gguf_model(path).stored_tensors()
    assert len(stored) == 2 * 7 + (1 if tie else 2)  # every layer's seven matrices, the embedding (, the head)
    assert {t.qtype for t in stored.values()} == {qtype.name}
    from_file = TorchBackend(model_dir, "cpu", quantize="auto", stored=stored)
    at_load = TorchBackend(model_dir, "cpu", quantize=qtype.name.lower())
    assert from_file.quantize == at_load.quantize == qtype.name.lower()
    for (name, a), (_, b) in zip(from_file.model.named_modules(), at_load.model.named_modules(), strict=True):
        if isinstance(a, NativeBlockLinear):
            assert torch.equal(a.blocks, b.blocks), name  # the file's bytes (q/k un-permuted) = our quantizer's
    assert isinstance(from_file.model.model.embed_tokens, BlockEmbedding)  # read from the file's blocks
    if tie:  # both read the embedding from the head's blocks
        assert torch.equal(logits_of(from_file, IDS), logits_of(at_load, IDS))
    else:  # an HF folder keeps its own untied embedding in fp32; the file's is its blocks, dequantized
        emb = from_file.model.model.embed_tokens(torch.tensor([IDS]))[0]
        t = stored["model.embed_tokens.weight"]
        assert torch.equal(
            emb,
            torch.from_numpy(
                gguf.quants.dequantize(np.asarray(t.data)[IDS], getattr(gguf.GGMLQuantizationType, t.qtype))
            ),
        )


def test_unpermuting_rows_restores_hugging_face_order(llama_dir: Path, tmp_path: Path) -> None:
    from engine.bench.gguf_export import permute_for_gguf

    rows = np.arange(4 * 16 * 3).reshape(4 * 16, 3)
    assert np.array_equal(unpermute_rows(permute_for_gguf(rows, 4), 4), rows)
    stored = gguf_model(export_gguf(llama_dir, tmp_path / "m.gguf", "q8_0")).stored_tensors()
    fp32 = TorchBackend(llama_dir, "cpu", quantize="none").model
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    want = fp32.model.layers[0].self_attn.qkv_proj.weight_t.t()[: q.shape[0]]  # (H*D, C) HF order
    got = torch.from_numpy(dequantize(q.data, BlockType.Q8_0, q.shape))
    assert (got - want).abs().max() < want.abs().max() / 100  # Q8_0 rounding, not a row mix-up


def weight_error(model_dir: Path, qtype: BlockType) -> float:
    """The largest relative (Frobenius) rounding error that `qtype` puts on any matrix of the model."""
    from engine.loading.weights import load_model
    from engine.model.network import fuse_projections

    fp32 = load_model(model_dir, dtype=torch.float32).model
    fuse_projections(fp32)
    worst = 0.0
    for path, w in plan_blocks(fp32, qtype).items():
        ref = fp32.get_submodule(path).weight.detach()  # (N, K)
        worst = max(worst, float((w.dequantized() - ref).norm() / ref.norm()))
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_logits_stay_within_the_bound_the_type_implies(
    llama_dir: Path, qwen_dir: Path, arch: str, qtype: BlockType
) -> None:
    """Bound, to first order: each weight product perturbs what it feeds by at most its matrix's relative rounding
    error e (measured on these very weights), and the errors of the 4 products per layer on the residual path (2
    layers) and of the head add at most linearly: 9e relative on the logits, plus 1% for the activations' two int8
    parts and the fp16 KV. (Measured on these models: 3.3e to 5e at the worst token.)"""
    model_dir = llama_dir if arch == "llama" else qwen_dir
    bound = (4 * 2 + 1) * weight_error(model_dir, qtype) + 0.01
    fp32 = logits_of(TorchBackend(model_dir, "cpu", quantize="none"), IDS)
    quant = logits_of(TorchBackend(model_dir, "cpu", quantize=qtype.name.lower()), IDS)
    rel = ((quant - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max().item()
    assert rel < bound, (rel, bound)
    assert (
        bound < {BlockType.Q8_0: 0.07, BlockType.Q4_0: 0.9, BlockType.Q4_1: 0.9, BlockType.Q5_0: 0.45}[qtype]
    )  # the bound means something


def test_quantize_choices_and_their_errors(qwen_dir: Path, tmp_path: Path) -> None:
    assert QUANTIZE_CHOICES == ("auto", "none", "q8_0", "q5_0", "q4_0", "q4_1", "int8")
    assert resolve_quantize("cpu", "auto") == "auto" and resolve_quantize("mps", "auto") == "none"
    assert TorchBackend(qwen_dir, "cpu", quantize="auto").quantize == "q8_0"  # an HF folder: the faithful type
    with pytest.raises(BackendUnavailable, match="int8 weights are a Core ML conversion"):
        TorchBackend(qwen_dir, "cpu", quantize="int8")
    with pytest.raises(BackendUnavailable, match="Unknown weight quantization 'iq2_xxs'"):
        TorchBackend(qwen_dir, "cpu", quantize="iq2_xxs")
    with pytest.raises(BackendUnavailable, match="there is no Q2_K quantizer here"):
        TorchBackend(qwen_dir, "cpu", quantize="q2_k")
    with pytest.raises(BackendUnavailable, match="there is no Q4_K quantizer here"):  # runs only as a file stores it
        TorchBackend(qwen_dir, "cpu", quantize="q4_k")


def test_input_sizes_that_are_no_multiple_of_32_run_with_zero_columns(tmp_path: Path) -> None:
    """An HF folder's widths need not be multiples of 32 (the bundled spark-mini's MLP is 688 wide): zero weight
    columns pad each row to whole blocks, zero activations meet them, and the products are unchanged."""
    odd = make_tiny_model(tmp_path / "odd", "llama", hidden=48, heads=4, kv_heads=2, intermediate=88, tie=True)
    b = TorchBackend(odd, "cpu", quantize="auto")
    assert b.quantize == "q8_0" and b.native_isa is not None
    head = b.model.lm_head
    assert (head.in_features, head.padded) == (48, 64)
    assert b.model.model.embed_tokens(torch.tensor([[5, 6]])).shape == (1, 2, 48)
    fp32 = logits_of(TorchBackend(odd, "cpu", quantize="none"), IDS)
    quant = logits_of(b, IDS)  # prefill (padded rows) and the native decoding step (padded blocks)
    bound = (4 * 2 + 1) * weight_error(odd, BlockType.Q8_0) + 0.01
    assert ((quant - fp32).norm(dim=-1) / fp32.norm(dim=-1)).max().item() < bound
    stepwise = TorchBackend(
        odd, "cpu", quantize="auto", native_steps=False
    )  # the same layers, every step through PyTorch
    # The prompt's chunk runs natively on `b` too (one call for up to 16 tokens) and through PyTorch here: fp32
    # attention and norms in two implementations; a padding column that counted would be off by far more.
    assert torch.allclose(logits_of(stepwise, IDS), quant, atol=1e-3, rtol=1e-3)


def test_a_stored_file_runs_as_stored_or_says_why(llama_dir: Path, tmp_path: Path) -> None:
    stored = gguf_model(export_gguf(llama_dir, tmp_path / "m.gguf", "q4_1")).stored_tensors()
    with pytest.raises(BackendUnavailable, match="stores Q4_1 weights, which run as stored: choose --quantize auto"):
        TorchBackend(llama_dir, "cpu", quantize="q8_0", stored=stored)
    # A format without a block kernel (IQ2_XXS): auto runs the model's fp32 weights and says why.
    kq = dict(stored)
    kq["model.layers.0.mlp.down_proj.weight"] = StoredTensor("IQ2_XXS", (64, 128), np.zeros(64 * 33, np.uint8))
    b = TorchBackend(llama_dir, "cpu", quantize="auto", stored=kq)
    assert b.quantize == "none" and "IQ2_XXS" in b.kernels_note and "no block kernel" in b.kernels_note
    with pytest.raises(BackendUnavailable, match=r"cannot run as q4_1: .*IQ2_XXS"):
        TorchBackend(llama_dir, "cpu", quantize="q4_1", stored=kq)


def chat_answer(engine: Engine, question: str) -> str:
    settings = GenerationSettings(max_tokens=24, sampling=SamplingSettings(greedy=True))
    return "".join(e.text for e in engine.new_session().chat(question, settings))


def test_the_real_model_with_the_default_weights_knows_the_capital_of_france() -> None:
    from engine.bench.decode import full_attention_memory

    memory = full_attention_memory(256)
    # The shipped GGUF runs its own Q4_1 blocks (what users get by default).
    shipped = Engine.load(real_gguf(), "cpu", memory_factory=memory, quantize="auto")
    assert shipped.backend.quantize == "q4_1"
    assert "Paris" in chat_answer(shipped, "What is the capital of France?")
    # An HF folder of the same model is quantized at load to the most faithful fast type.
    folder = Engine.load(real_model_dir(), "cpu", memory_factory=memory, quantize="auto")
    assert folder.backend.quantize == "q8_0"
    assert "Paris" in chat_answer(folder, "What is the capital of France?")
