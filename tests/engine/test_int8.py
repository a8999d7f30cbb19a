"""Int8 CPU weights: the kernels compute what the int8 matrix says, the model stays close to fp32, and the
registry/CLI plumbing picks int8 only where it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.backends import QUANTIZE_CHOICES, open_backend, resolve_quantize
from engine.backends.int8 import Int8Embedding, Int8Linear, quantize_rows
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable
from engine.generate import decode_step, prefill
from engine.memory import FullAttentionMemory
from tests.tiny import make_tiny_model


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tied"), "qwen2", tie=True)  # q/k/v biases and a tied head


def test_quantize_rows_is_symmetric_per_row_and_survives_zero_rows() -> None:
    w = torch.randn(5, 32)
    w[2] = 0
    q, scales = quantize_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q[2], torch.zeros(32, dtype=torch.int8)) and torch.isfinite(scales).all()
    assert ((q.float() * scales[:, None]) - w).abs().max() <= scales.max() / 2 + 1e-6  # round to nearest
    assert torch.equal(q.abs().amax(1)[[0, 1, 3, 4]], torch.full((4,), 127, dtype=torch.int8))


@pytest.mark.parametrize("engine", [e for e in ("x86", "qnnpack") if e in torch.backends.quantized.supported_engines])
def test_int8_linear_matches_its_dequantized_matrix(engine: str) -> None:
    """x86 (FBGEMM) is what Intel/AMD machines run, QNNPACK what Apple Silicon's CPU fallback runs."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        _check_int8_linear()
    finally:
        torch.backends.quantized.engine = before


def _check_int8_linear() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    x = torch.randn(3, 7, 96)
    q, scales = quantize_rows(lin.weight)
    exact = x @ (q.float() * scales[:, None]).t() + lin.bias  # what the int8 matrix means, activations unquantized
    got = Int8Linear.from_linear(lin)(x)
    assert got.shape == (3, 7, 40)
    # Only the per-row activation quantization (7 or 8 bits) separates the two.
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_tied_int8_head_and_embedding_share_one_int8_matrix(tied_dir: Path) -> None:
    b = TorchBackend(tied_dir, "cpu", quantize="int8", kernels="torch")  # PyTorch's quantized library
    emb, head = b.model.model.embed_tokens, b.model.lm_head
    assert isinstance(emb, Int8Embedding) and isinstance(head, Int8Linear)
    assert not any(isinstance(m, nn.Linear) for m in b.model.modules())
    ref = TorchBackend(tied_dir, "cpu")
    ids = torch.tensor([[3, 17, 99]])
    q, scales = quantize_rows(ref.model.lm_head.weight_t.t())
    assert torch.equal(emb(ids)[0], q[ids[0]].float() * scales[ids[0], None])
    assert b.numerics == "torch-cpu-float32-wint8-kvfloat16" and ref.numerics == "torch-cpu-float32-kvfloat16"
    # The memory panel is told what int8 storage really holds: matrices at a byte per weight (the tied vocabulary
    # matrix twice: packed for the head, plain for the embedding), not the fp32 the checkpoint came in.
    cfg = b.config
    per_layer = cfg.hidden_size * (cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_dim) + cfg.hidden_size**2 + 3 * cfg.hidden_size * cfg.intermediate_size
    matrices = cfg.num_hidden_layers * per_layer + 2 * cfg.vocab_size * cfg.hidden_size
    assert matrices < b.weight_bytes < matrices * 1.2 and b.weight_bytes < ref.weight_bytes / 2


def test_int8_model_stays_close_to_fp32(tied_dir: Path) -> None:
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for quantize in ("none", "int8"):
        b = TorchBackend(tied_dir, "cpu", quantize=quantize, kernels="torch")  # PyTorch's quantized library (native: test_native)
        b.allocate(1, 64)
        mem = FullAttentionMemory(b)
        steps = [prefill(b, mem, ids[:30], chunk=16)] + [decode_step(b, mem, t) for t in ids[30:]]
        outs.append(torch.stack(steps))  # (11, V)
    fp32, int8 = outs
    rel = (int8 - fp32).norm(dim=-1) / fp32.norm(dim=-1)
    assert rel.max() < 0.05, rel
    assert not torch.equal(int8, fp32)  # it really ran the int8 weights


def test_quantize_resolution_and_refusals(tied_dir: Path) -> None:
    assert QUANTIZE_CHOICES == ("auto", "none", "int8")
    assert resolve_quantize("cpu", "auto") == "int8" and resolve_quantize("mps", "auto") == "none"
    assert resolve_quantize("cpu", "none") == "none"
    choice = open_backend(tied_dir, "cpu", "auto")
    assert choice.backend.quantize == "int8"  # type: ignore[attr-defined]
    assert choice.explain() == f"cpu, int8 weights, native {choice.backend.native_isa} kernels"  # type: ignore[attr-defined]
    assert open_backend(tied_dir, "cpu", "none").explain() == "cpu"
    with pytest.raises(BackendUnavailable, match="int4"):
        TorchBackend(tied_dir, "cpu", quantize="int4")
    with pytest.raises(BackendUnavailable, match="cpu backend only"):
        TorchBackend(tied_dir, "cuda", quantize="int8")


def test_cli_generate_quantize_flag(tied_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from engine import cli

    for q in ("none", "int8"):
        args = ["generate", "--model", str(tied_dir), "--prompt", "hello", "--max-tokens", "6", "--greedy", "--no-prefix-cache", "--json", "--quantize", q]
        assert cli.main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["backend"].startswith("cpu") and len(out["tokens"]) == 6
    with pytest.raises(SystemExit) as exc:  # argparse: usage line and exit 2
        cli.main(["generate", "--model", str(tied_dir), "--prompt", "x", "--quantize", "int3"])
    assert exc.value.code == 2 and "int3" in capsys.readouterr().err


def test_bench_decode_reports_the_precisions_it_compared(tmp_path: Path) -> None:
    """The decode benchmark's plumbing on a tiny model: our int8 path, full attention, the peers it could run."""
    import argparse

    from engine.bench import decode as bench

    plain = make_tiny_model(tmp_path / "llama", "llama", tie=True)  # no biases: the GGUF export covers it
    out = bench.run(argparse.Namespace(model=plain, backend="cpu", threads=1, quick=True, json=True, quantize="auto"))
    assert out["quantize"] == "int8" and out["numerics"] == "torch-cpu-float32-wint8native-kvfloat16"
    assert out["ours_decode_tps"] > 0 and out["transformers_dtype"] == "float32" and out["ratio_vs_transformers"] > 0
    if "llamacpp_gguf_type" in out:  # llama-cpp-python installed (the bench extra)
        assert out["llamacpp_gguf_type"] == "q8_0"
    else:
        assert any("llama-cpp-python" in n for n in out["notes"])


def test_bench_decode_runs_llamacpp_on_a_model_with_biases(tied_dir: Path) -> None:
    import argparse

    pytest.importorskip("llama_cpp")
    from engine.bench import decode as bench

    # qwen2: q/k/v biases and a tied head, which the GGUF export writes as llama.cpp's converter does.
    out = bench.run(argparse.Namespace(model=tied_dir, backend="cpu", threads=1, quick=True, json=True, quantize="none"))
    assert "ratio_vs_llamacpp" in out and out["llamacpp_gguf_type"] == "f32", out.get("notes")
    assert out["quantize"] == "none" and out["ours_decode_tps"] > 0
