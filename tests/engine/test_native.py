"""The native CPU kernels (engine/native): they build here, every instruction-set variant computes the exact int8
products, the one-call decoding step equals the PyTorch path over the same weights (and keeps the slot table's
read copies exact), and without a compiler the engine says why and runs PyTorch's kernels."""

from __future__ import annotations

import platform
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.backends.int8 import Int8Linear, quantize_rows
from engine.backends.torch_backend import TorchBackend
from engine.cascade.config import CascadeConfig
from engine.cascade.memory import CascadeMemory
from engine.errors import BackendUnavailable
from engine.generate import decode_step, prefill
from engine.memory import FullAttentionMemory
from engine.native import DISABLE_ENV, NativeKernels, bind, build_library, load_kernels
from engine.native.decoder import NativeInt8Linear
from tests.engine.test_slot_reads import assert_read_copies_exact
from tests.tiny import make_tiny_model

X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    status = load_kernels()
    # CI and every developer machine has a C compiler: the kernels must build there, not silently fall back.
    assert shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    assert status.kernels is not None, status.reason
    return status.kernels


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("native-qwen"), "qwen2", tie=True)  # q/k/v biases, tied head


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("native-llama"), "llama")  # untied head, no biases


def integer_reference(lin: NativeInt8Linear, x: torch.Tensor) -> torch.Tensor:
    """What the kernel must compute, in exact integer arithmetic: x (M, K) -> (M, N)."""
    amax = x.abs().amax(1, keepdim=True)
    xq = torch.round(x * torch.where(amax > 0, 127.0 / amax, 0.0)).to(torch.int64)
    acc = xq @ lin.q.to(torch.int64).t()
    y = acc.float() * ((amax / 127.0) * lin.scales)
    return y if lin.bias is None else y + lin.bias


@pytest.mark.parametrize("k", [64, 576, 50, 200])  # whole vector blocks, and tails the vector loops leave over
def test_one_row_and_many_rows_compute_the_exact_int8_product(kernels: NativeKernels, k: int) -> None:
    torch.manual_seed(k)
    lin = NativeInt8Linear.from_linear(kernels, nn.Linear(k, 37))
    x = torch.randn(5, k)
    x[3] = 0  # an all-zero row quantizes to zeros with scale 0: just the bias
    many = lin(x)  # (5, 37) PyTorch's int8 GEMM
    one_at_a_time = torch.cat([lin(x[i : i + 1]) for i in range(5)])  # the native row kernel
    assert torch.equal(one_at_a_time, many)
    assert torch.allclose(many, integer_reference(lin, x), rtol=1e-6, atol=1e-6)
    assert torch.equal(many[3], lin.bias)
    assert torch.allclose(lin(x.view(5, 1, k)), many.view(5, 1, 37))  # leading dims fold into rows


@pytest.mark.skipif(not X86, reason="instruction-set variants of x86")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "portable"])
def test_every_instruction_set_variant_computes_the_same_products(kernels: NativeKernels, tmp_path: Path, flags: tuple[str, ...]) -> None:
    variant = bind(build_library(tmp_path, extra_flags=flags))
    assert variant.isa == {"-mno-avx2": "portable"}.get(flags[-1], "avx2")
    torch.manual_seed(1)
    w = nn.Linear(200, 48)
    x = torch.randn(1, 200)
    ours, theirs = NativeInt8Linear.from_linear(kernels, w), NativeInt8Linear.from_linear(variant, w)
    assert torch.equal(ours(x), theirs(x))


def test_backend_uses_native_kernels_and_stays_close_to_fp32(qwen_dir: Path) -> None:
    b = TorchBackend(qwen_dir, "cpu", quantize="int8")
    assert b.native_isa is not None and b.model.native_decoder is not None
    assert isinstance(b.model.lm_head, NativeInt8Linear) and not any(isinstance(m, (nn.Linear, Int8Linear)) for m in b.model.modules())
    assert b.numerics == "torch-cpu-float32-wint8native-kvfloat16"
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for backend in (b, TorchBackend(qwen_dir, "cpu", quantize="none")):
        backend.allocate(1, 64)
        mem = FullAttentionMemory(backend)
        outs.append(torch.stack([prefill(backend, mem, ids[:30], chunk=16)] + [decode_step(backend, mem, t) for t in ids[30:]]))
    native, fp32 = outs
    rel = (native - fp32).norm(dim=-1) / fp32.norm(dim=-1)
    assert rel.max() < 0.05, rel
    # Tied head: the embedding shares the head's int8 matrix, which the memory figure counts once.
    q, _ = quantize_rows(TorchBackend(qwen_dir, "cpu", quantize="none").model.lm_head.weight_t.t())
    assert torch.equal(b.model.model.embed_tokens.q, q) and b.model.model.embed_tokens.q.data_ptr() == b.model.lm_head.q.data_ptr()


def run_conversation(b: TorchBackend, memory: str, ids: list[int]) -> torch.Tensor:
    if memory == "full":
        b.allocate(1, 64)
        mem = FullAttentionMemory(b)
    else:  # a sliding window with rotation frames, sinks and paged-in blocks
        mem = CascadeMemory(b, CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1))
    return torch.stack([prefill(b, mem, ids[:10], chunk=10)] + [decode_step(b, mem, t) for t in ids[10:]])  # (n, V)


@pytest.mark.parametrize("memory", ["full", "cascade"])
@pytest.mark.parametrize("kv", [torch.float16, torch.float32])
def test_native_decode_step_equals_the_pytorch_path_over_the_same_weights(llama_dir: Path, memory: str, kv: torch.dtype) -> None:
    ids = [3 + (i * 7) % 200 for i in range(50)]
    native = TorchBackend(llama_dir, "cpu", quantize="int8", kv_dtype=kv)
    calls = count_native_steps(native)
    outs = [run_conversation(native, memory, ids)]
    assert calls["n"] >= 30  # most decoding steps ran natively (the rest re-derive stale copies in PyTorch)
    stepwise = TorchBackend(llama_dir, "cpu", quantize="int8", kv_dtype=kv)
    stepwise.model.native_decoder = None  # the same NativeInt8Linear weights, every step through PyTorch
    outs.append(run_conversation(stepwise, memory, ids))
    # Only float summation order differs (attention, norms); the slot tables are identical.
    assert torch.allclose(outs[0], outs[1], atol=2e-4, rtol=1e-4), (outs[0] - outs[1]).abs().max()


def count_native_steps(b: TorchBackend) -> dict[str, int]:
    decoder = b.model.native_decoder
    assert decoder is not None
    calls = {"n": 0}
    real = decoder.decode

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*args, **kwargs)

    decoder.decode = counted  # type: ignore[method-assign]
    return calls


def test_native_steps_keep_the_read_copies_exact(llama_dir: Path) -> None:
    b = TorchBackend(llama_dir, "cpu", quantize="int8")
    calls = count_native_steps(b)
    b.allocate(1, 32)
    mem = FullAttentionMemory(b)
    prefill(b, mem, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], chunk=10)
    for t in [20, 21, 22, 23]:
        decode_step(b, mem, t)
    assert calls["n"] == 3  # the first step after a prefill derives every read copy, in PyTorch
    assert assert_read_copies_exact(b, torch.arange(32)[None]) == 14


def test_without_native_kernels_the_engine_says_why_and_runs_pytorch(qwen_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(DISABLE_ENV, "1")
    status = load_kernels()
    assert status.kernels is None and DISABLE_ENV in status.reason
    b = TorchBackend(qwen_dir, "cpu", quantize="int8")  # auto: falls back
    assert b.native_isa is None and isinstance(b.model.lm_head, Int8Linear)
    assert b.numerics == "torch-cpu-float32-wint8-kvfloat16"
    with pytest.raises(BackendUnavailable, match="native CPU kernels are unavailable.*turned off"):
        TorchBackend(qwen_dir, "cpu", quantize="int8", kernels="native")
    monkeypatch.delenv(DISABLE_ENV)
    assert isinstance(TorchBackend(qwen_dir, "cpu", quantize="int8", kernels="torch").model.lm_head, Int8Linear)
    with pytest.raises(BackendUnavailable, match="Unknown CPU kernels"):
        TorchBackend(qwen_dir, "cpu", quantize="int8", kernels="fast")
    # No compiler: one sentence saying what to install.
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C compiler was found; install"):
        build_library(tmp_path)


def test_a_failing_build_names_the_compiler_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="did not compile with .*error"):
        build_library(tmp_path, extra_flags=("-include", "/nonexistent/header.h"))
    assert not list((tmp_path / "native").glob("*"))  # nothing half-built is left behind


ARM_CC, QEMU_ARM = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(not (ARM_CC and QEMU_ARM), reason="needs an aarch64 cross compiler and qemu-user (Debian: gcc-aarch64-linux-gnu qemu-user)")
@pytest.mark.parametrize("arch,isa", [("armv8.2-a+dotprod", "neon-dotprod"), ("armv8-a", "portable")])
def test_arm_kernels_compute_the_exact_int8_product(tmp_path: Path, arch: str, isa: str) -> None:
    """Apple Silicon runs the NEON dot-product kernel: compiled for Arm, run under emulation, checked exactly."""
    import subprocess

    from engine.native import SOURCE

    exe = tmp_path / f"arm-check-{isa}"
    check = Path(__file__).with_name("native") / "arm_check.c"
    build = [str(ARM_CC), "-O3", "-std=gnu11", "-ffp-contract=off", f"-march={arch}", "-static", f"-I{SOURCE.parent}", str(check), "-o", str(exe), "-lm"]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    out = subprocess.run([str(QEMU_ARM), str(exe)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.splitlines() == [f"isa {isa}", "0 mismatches"], out.stdout


def test_models_the_native_step_cannot_run_are_named(qwen_dir: Path, kernels: NativeKernels) -> None:
    import dataclasses

    from engine.backends.torch_backend import native_unfit
    from engine.native import NativeStatus

    status = NativeStatus(kernels, "ok")
    cfg = TorchBackend(qwen_dir, "cpu", quantize="none").config
    assert native_unfit(status, cfg, torch.float32) is None
    assert native_unfit(status, cfg, torch.bfloat16) == "they compute in float32, not bfloat16"
    wide = dataclasses.replace(cfg, head_dim=kernels.max_head_dim * 2)
    assert native_unfit(status, wide, torch.float32) == f"head dim {kernels.max_head_dim * 2} exceeds their {kernels.max_head_dim}"
    assert native_unfit(NativeStatus(None, "no C compiler was found"), cfg, torch.float32) == "no C compiler was found"
