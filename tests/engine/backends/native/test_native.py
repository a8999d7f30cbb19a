"""The native CPU kernels (engine/backends/native): they build here, every instruction-set variant computes the block
products bit for bit as the integer reference below, prefill rows equal one-row decodes, the thread pool changes no
bit and creates no thread per call, the one-call decoding step equals the PyTorch path over the same weights (and
keeps the slot table's read copies exact), and without a compiler the engine says why and runs PyTorch."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from engine.backends.blocks import BlockEmbedding, BlockWeights
from engine.backends.native import (
    DISABLE_ENV,
    NativeKernels,
    activation_numerics,
    activation_parts,
    bind,
    build_library,
    load_kernels,
)
from engine.backends.native.decoder import NativeBlockEmbedding, NativeBlockLinear
from engine.backends.torch_backend import TorchBackend
from engine.errors import BackendUnavailable
from engine.generation.loop import decode_step, prefill
from engine.memory.base import FullAttentionMemory
from engine.memory.cascade.config import CascadeConfig
from engine.memory.cascade.core import CascadeMemory
from engine.model.quant import BlockType, quantize
from tests.helpers.native_refs import (
    F32,
    LEGACY,
    X86,
    block_linear,
    legacy_reference,
    lin_weights,
)
from tests.helpers.timers import NativeStepCounter
from tests.helpers.tiny import make_tiny_model


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("native-qwen"), "qwen2", tie=True)  # q/k/v biases, tied head


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("native-llama"), "llama")  # untied head, no biases


def test_the_integer_reference_takes_the_products_it_claims() -> None:
    """The reference's block sums, with fp32 rounding taken out, are the plain product of the dequantized
    matrices (guards the reference itself against a mixed-up nibble or sign)."""
    torch.manual_seed(0)
    for qtype in LEGACY:
        w = torch.randn(5, 64)
        bw = BlockWeights(qtype, (5, 64), torch.from_numpy(quantize(w.numpy(), qtype)))
        x = np.random.default_rng(0).standard_normal(64).astype(F32)
        want = bw.dequantized().double().numpy() @ x.astype(np.float64)
        assert np.allclose(legacy_reference(bw, None, x, 2), want, rtol=1e-4, atol=1e-4)  # int16: ~16 bits


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 128, 160, 576])  # one block, whole groups of 4, a group and a tail, SmolLM's width
def test_block_products_equal_the_integer_reference_bit_for_bit(
    kernels: NativeKernels, qtype: BlockType, k: int, parts: int
) -> None:
    lin = block_linear(kernels, qtype, 37, k, parts, seed=k)
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(1))
    x[3] = 0  # an all-zero row quantizes to zeros with scale 0: just the bias
    x[4, :32] *= 1e4  # an outlier block
    many = lin(x)  # (15, 37): the prefill path, rows in a group of 12 and a remainder of 3
    assert torch.equal(lin(x[:7]), many[:7])  # a group of 7
    for i in range(15):
        want = legacy_reference(lin_weights(lin), lin.bias.numpy(), x[i].numpy(), parts)
        assert np.array_equal(many[i].numpy(), want), i
        assert torch.equal(lin(x[i : i + 1]), many[i : i + 1])  # one row (decode) = the same row of a prefill
    assert torch.equal(many[3], lin.bias)
    assert torch.equal(lin(x.view(5, 3, k)), many.view(5, 3, 37))  # leading dims fold into rows


def test_q8_0_decoding_products_hold_at_the_extreme_quants(kernels: NativeKernels) -> None:
    """A decoding step's Q8_0 product splits each int16 activation into two bytes and offsets the weights by 128
    (block_lanes_split): every weight byte from -128 (a file may hold it; our quantizer never writes it) to 127
    against activations at +-32767 and at the split's byte boundaries gives the integer reference's bits."""
    n, k = 41, 256  # odd: the range's last row takes the one-row route
    lin = block_linear(kernels, BlockType.Q8_0, n, k, 2, seed=5)
    raw = lin.blocks.numpy().reshape(n, k // 32, BlockType.Q8_0.block_bytes)
    raw[:, :, 2:] = (np.arange(n * k).reshape(n, k // 32, 32) % 256).astype(np.uint8)  # every byte, -128 included
    raw[0, :, 2:] = 0x80  # a row of -128 only
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(6))
    x[1, ::2] = -x[1, ::2].abs().max()  # a block's extremes both ways: -32767 and +32767
    # quants exactly these (each block's first is 32767, so the scale is 1): the split's byte boundaries both ways
    edges = [32767, -32767, 255, -255, 256, -256, 511, -1, 0, 1, 127, -128, 128, -129, 32512, -32513]
    x[2] = torch.tensor([edges[i % 16] if i % 32 else 32767 for i in range(k)], dtype=torch.float32)
    x[3] = -x[2]
    for i in range(4):
        want = legacy_reference(lin_weights(lin), lin.bias.numpy(), x[i].numpy(), 2)
        assert np.array_equal(lin(x[i : i + 1])[0].numpy(), want), i


@pytest.mark.skipif(not X86, reason="instruction-set variants of x86")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "portable"])
def test_every_instruction_set_variant_computes_the_same_products(
    kernels: NativeKernels, tmp_path: Path, flags: tuple[str, ...]
) -> None:
    variant = bind(build_library(tmp_path, extra_flags=flags))
    assert variant.isa == {"-mno-avx2": "portable"}.get(flags[-1], "avx2")
    x = torch.randn(5, 224, generator=torch.Generator().manual_seed(2))
    for qtype in LEGACY:
        for parts in (1, 2):
            ours = block_linear(kernels, qtype, 48, 224, parts)
            theirs = NativeBlockLinear(variant, lin_weights(ours), ours.bias, parts)
            assert torch.equal(ours(x), theirs(x)), (qtype, parts)
            assert torch.equal(ours(x[:1]), theirs(x[:1])), (qtype, parts)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads through /proc")
def test_the_thread_pool_changes_no_bit_and_creates_no_thread_per_call(kernels: NativeKernels, llama_dir: Path) -> None:
    lin = block_linear(kernels, BlockType.Q4_1, 300, 576, 2)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3))
    kernels.use_threads(1)
    one = lin(x)
    before = native_threads()
    assert kernels.use_threads(3) == 3 and native_threads() == before + 2  # the workers, made once
    torch.set_num_threads(3)  # what the layer follows (the hardware policy's count)
    try:
        for _ in range(20):
            assert torch.equal(lin(x), one)
        assert native_threads() == before + 2  # no thread created per call
        b = TorchBackend(llama_dir, "cpu", quantize="q8_0")
        ids = [3 + (i * 7) % 200 for i in range(30)]
        threaded = run_conversation(b, "full", ids)
        settled = native_threads()  # PyTorch's own pool may have started its threads too
        assert torch.equal(run_conversation(b, "full", ids), threaded)
        assert native_threads() == settled  # 20 more decoding steps, no new thread
    finally:
        torch.set_num_threads(1)
    assert kernels.use_threads(1) == 1 and native_threads() == settled - 2  # the workers end when the pool shrinks
    assert torch.equal(run_conversation(b, "full", ids), threaded)  # one thread or three: the same bits


def test_an_idle_pool_costs_no_cpu(kernels: NativeKernels) -> None:
    """The workers wait spinning for a few milliseconds after a product (a prefill's next one comes after PyTorch's
    attention), then sleep: an engine left idle costs no CPU."""
    lin = block_linear(kernels, BlockType.Q8_0, 64, 576, 2)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(4))
    kernels.use_threads(3)
    torch.set_num_threads(3)
    try:
        lin(x)
        time.sleep(0.2)  # well past the linger
        start = time.process_time()  # every thread of the process
        time.sleep(0.3)
        idle = time.process_time() - start
    finally:
        torch.set_num_threads(1)
        kernels.use_threads(1)
    assert idle < 0.03  # two workers still spinning would have used ~0.3 s each


def test_backend_uses_native_kernels_and_stays_close_to_fp32(qwen_dir: Path) -> None:
    b = TorchBackend(qwen_dir, "cpu", quantize="q8_0")
    assert b.native_isa is not None and b.decoder is not None
    assert isinstance(b.model.lm_head, NativeBlockLinear) and not any(
        isinstance(m, nn.Linear) for m in b.model.modules()
    )
    assert b.numerics == "torch-cpu-float32-wq8_0native-a16i-kvfloat16-r3"
    ids = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    outs = []
    for backend in (b, TorchBackend(qwen_dir, "cpu", quantize="none")):
        backend.allocate(1, 64)
        mem = FullAttentionMemory(backend)
        outs.append(
            torch.stack([prefill(backend, mem, ids[:30], chunk=16)] + [decode_step(backend, mem, t) for t in ids[30:]])
        )
    native, fp32 = outs
    rel = (native - fp32).norm(dim=-1) / fp32.norm(dim=-1)
    assert rel.max() < 0.05, rel
    # Tied head: the embedding reads the head's blocks, one copy of the vocabulary matrix.
    assert b.model.model.embed_tokens.blocks.data_ptr() == b.model.lm_head.blocks.data_ptr()


def run_conversation(b: TorchBackend, memory: str, ids: list[int]) -> torch.Tensor:
    if memory == "full":
        b.allocate(1, 64)
        mem = FullAttentionMemory(b)
    else:  # a sliding window with rotation frames, sinks and paged-in blocks
        # No retrieval gate: its threshold comparisons would turn the paths' one-ulp key differences into different
        # routing, and this compares the steps' arithmetic over the same memory.
        cfg = CascadeConfig(sink_tokens=4, window=16, block_size=4, retrieval_blocks=1, gate_rank=0)
        mem = CascadeMemory(b, cfg)
    return torch.stack([prefill(b, mem, ids[:10], chunk=10)] + [decode_step(b, mem, t) for t in ids[10:]])  # (n, V)


@pytest.fixture(scope="module")
def head64_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head dim 64 and three query heads per KV head, as SmolLM2's: the attention's compiled-per-run route."""
    return make_tiny_model(tmp_path_factory.mktemp("native-head64"), "llama", hidden=192, heads=3, kv_heads=1)


@pytest.mark.parametrize("memory", ["full", "cascade"])
@pytest.mark.parametrize("kv", [torch.float16, torch.float32])
@pytest.mark.parametrize("model", ["llama_dir", "head64_dir"])
def test_native_decode_step_equals_the_pytorch_path_over_the_same_weights(
    request: pytest.FixtureRequest, model: str, memory: str, kv: torch.dtype
) -> None:
    llama_dir: Path = request.getfixturevalue(model)
    ids = [3 + (i * 7) % 200 for i in range(50)]
    native = TorchBackend(llama_dir, "cpu", quantize="q4_1", kv_dtype=kv)
    steps = NativeStepCounter()
    with native.timed_parts(steps):
        outs = [run_conversation(native, memory, ids)]
    # Every step ran natively, page-ins and re-routes included: the 10-token prefill in one call, then each token.
    assert steps.native_steps == len(ids) - 10 + 1
    stepwise = TorchBackend(llama_dir, "cpu", quantize="q4_1", kv_dtype=kv, native_steps=False)
    assert stepwise.decoder is None  # the same NativeBlockLinear weights, every step through PyTorch
    outs.append(run_conversation(stepwise, memory, ids))
    # Only float summation order differs (attention, norms): logits agree closely. Such a difference can move a
    # stored fp16 key or value by one ulp or an activation by one int16 step, which scales with the logits, hence a
    # bound relative to the largest (measured on AVX2: 0.5e-4 to 1.2e-4 of it over these steps). Both paths
    # rotate keys in fp32 (the PyTorch path's read copies of keys are fp32, the native attention rotates on read) ...
    worst = (outs[0] - outs[1]).abs().max()
    assert worst <= 2.5e-4 * outs[1].abs().max(), worst
    # ... the stored keys and values differ only by that rounding, and the native table keeps no read copies.
    a, b = native.cache, stepwise.cache
    held = (b.read_slots >= 0).nonzero().squeeze(1)
    slots = b.read_slots[held]
    torch.testing.assert_close(a.k[:, :, :, slots], b.k[:, :, :, slots], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(a.v[:, :, :, slots], b.v[:, :, :, slots], atol=2e-3, rtol=2e-3)
    assert not a.reads_in_use and a.k_read.numel() == 0 and b.reads_in_use


def test_native_steps_and_chunks_keep_no_read_copies(llama_dir: Path) -> None:
    b = TorchBackend(llama_dir, "cpu", quantize="q8_0", native_chunks=False)
    steps = NativeStepCounter()
    b.allocate(1, 32)
    mem = FullAttentionMemory(b)
    with b.timed_parts(steps):
        prefill(b, mem, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], chunk=10)
        for t in [20, 21, 22, 23]:
            decode_step(b, mem, t)
    assert steps.native_steps == 4 and not b.cache.reads_in_use and b.cache.k_read.numel() == 0
    # Without native chunks, a chunk of two tokens runs in PyTorch and rotates the live slots as it reads them:
    # copies of the whole table for one step would cost more than the table.
    prefill(b, mem, [30, 31], chunk=2)
    assert not b.cache.reads_in_use and b.cache.k_read.numel() == 0
    with b.timed_parts(steps):
        decode_step(b, mem, 24)  # native again
    assert steps.native_steps == 5 and not b.cache.reads_in_use


def test_without_native_kernels_the_engine_says_why_and_runs_pytorch(
    qwen_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from engine.backends.torch_backend import KMajorLinear

    monkeypatch.setenv(DISABLE_ENV, "1")
    status = load_kernels()
    assert status.kernels is None and DISABLE_ENV in status.reason
    b = TorchBackend(qwen_dir, "cpu", quantize="q8_0")  # auto kernels: falls back to the dequantized blocks
    assert b.native_isa is None and isinstance(b.model.lm_head, KMajorLinear) and DISABLE_ENV in b.kernels_note
    assert b.numerics == "torch-cpu-float32-wq8_0-kvfloat16-r2"
    with pytest.raises(BackendUnavailable, match=r"native CPU kernels are unavailable.*turned off"):
        TorchBackend(qwen_dir, "cpu", quantize="q8_0", kernels="native")
    monkeypatch.delenv(DISABLE_ENV)
    torch_kernels = TorchBackend(qwen_dir, "cpu", quantize="q8_0", kernels="torch")
    native = TorchBackend(qwen_dir, "cpu", quantize="q8_0")
    assert isinstance(torch_kernels.model.lm_head, KMajorLinear)
    # The same blocks: the dequantized weights are exactly what the native kernels hold.
    head = native.model.lm_head
    assert torch.equal(torch_kernels.model.lm_head.weight_t.t(), lin_weights(head).dequantized())
    with pytest.raises(BackendUnavailable, match="Unknown CPU kernels"):
        TorchBackend(qwen_dir, "cpu", quantize="q8_0", kernels="fast")
    # No compiler: one sentence saying what to install.
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C compiler was found; install"):
        build_library(tmp_path)


def test_a_failing_build_names_the_compiler_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"did not compile with .*error"):
        build_library(tmp_path, extra_flags=("-include", "/nonexistent/header.h"))
    assert not list((tmp_path / "native").glob("*"))  # nothing half-built is left behind


def test_the_library_is_built_from_every_source_and_keyed_by_every_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every C file beside the kernels (each instruction-set family's too) is compiled, and a change to any source
    or header (ref/rows.h, a family's vec.h) gives the library another name in the cache, so a stale one is never
    loaded."""
    from engine.backends import native

    assert set(native.SOURCES) == {p for p in native.source_files() if p.suffix == ".c"}
    assert {p.relative_to(native.NATIVE_DIR).parts[0] for p in native.SOURCES} >= {"ref", "x86", "arm"}
    copy = tmp_path / "native"
    shutil.copytree(native.NATIVE_DIR, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    monkeypatch.setattr(native, "NATIVE_DIR", copy)
    cc = native._compiler()
    assert cc is not None
    names = {native.library_path(tmp_path, cc, ["-O3"]).name}
    for header in ("spark_kernels.h", "ref/rows.h", "x86/vec.h"):
        with (copy / header).open("a") as f:
            f.write("\n")
        names.add(native.library_path(tmp_path, cc, ["-O3"]).name)
    assert len(names) == 4


def test_a_struct_mirror_of_another_size_fails_the_load_in_one_sentence(
    kernels: NativeKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bind() compares each ABI struct's size in the library (spark_sizeof_*) with its ctypes mirror: the mirrors
    agree here, and one with a field the library lacks is refused before any call could misread it."""
    import ctypes

    from engine.backends import native

    native.check_mirrors(kernels.lib)  # every mirror agrees with the built library

    class LongerStep(ctypes.Structure):
        _fields_ = [*native.StepDesc._fields_, ("extra", ctypes.c_int64)]

    mirrors = tuple((name, LongerStep if name == "step" else m) for name, m in native.MIRRORS)
    monkeypatch.setattr(native, "MIRRORS", mirrors)
    with pytest.raises(
        RuntimeError, match=r"^the native kernels' spark_step is \d+ bytes but its ctypes mirror LongerStep is \d+: "
    ) as err:
        native.check_mirrors(kernels.lib)
    assert "\n" not in str(err.value)


ARM_CC, QEMU_ARM = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")


@pytest.mark.skipif(
    not (ARM_CC and QEMU_ARM),
    reason="needs an aarch64 cross compiler and qemu-user (Debian: gcc-aarch64-linux-gnu qemu-user)",
)
@pytest.mark.parametrize("arch,isa", [("armv8.2-a+dotprod", "neon-dotprod"), ("armv8-a", "portable")])
def test_arm_kernels_compute_the_exact_block_products(tmp_path: Path, arch: str, isa: str) -> None:
    """Apple Silicon runs the NEON dot-product kernel: compiled for Arm, run under emulation, checked exactly (the
    decoding attention within float rounding)."""
    import subprocess

    from engine.backends.native import NATIVE_DIR, SOURCES

    exe = tmp_path / f"arm-check-{isa}"
    check = Path(__file__).with_name("arm_check.c")
    build = [
        str(ARM_CC),
        "-O3",
        "-std=gnu11",
        "-pthread",
        "-ffp-contract=off",
        f"-march={arch}",
        "-static",
        f"-I{NATIVE_DIR}",
        str(check),
        *map(str, SOURCES),
        "-o",
        str(exe),
        "-lm",
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    out = subprocess.run(
        [str(QEMU_ARM), str(exe)], capture_output=True, text=True, timeout=300, check=False
    )  # the assert below shows its output
    assert out.returncode == 0 and out.stdout.splitlines() == [f"isa {isa}", "0 mismatches"], out.stdout


@pytest.mark.skipif(not X86, reason="the x86 build of the Arm checker")
def test_the_arm_checker_itself_passes_on_this_machine(tmp_path: Path, kernels: NativeKernels) -> None:
    """The checker the Arm test runs under qemu, built for this CPU: its C reference agrees with the kernels here,
    so a mismatch under qemu points at the Arm kernel, not at the checker."""
    import subprocess

    from engine.backends.native import NATIVE_DIR, SOURCES, _compiler, compile_flags

    exe = tmp_path / "check"
    tune = [f for f in compile_flags() if f.startswith("-m")]
    build = [
        str(_compiler()),
        "-O3",
        "-std=gnu11",
        "-pthread",
        "-ffp-contract=off",
        *tune,
        f"-I{NATIVE_DIR}",
        str(Path(__file__).with_name("arm_check.c")),
        *map(str, SOURCES),
        "-o",
        str(exe),
        "-lm",
    ]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    out = subprocess.run(
        [str(exe)], capture_output=True, text=True, timeout=300, check=False
    )  # the assert below shows its output
    assert out.returncode == 0 and out.stdout.splitlines() == [f"isa {kernels.isa}", "0 mismatches"], out.stdout


def test_models_the_native_step_cannot_run_are_named(qwen_dir: Path, kernels: NativeKernels) -> None:
    import dataclasses

    from engine.backends.native import NativeStatus
    from engine.backends.torch_backend import native_unfit

    status = NativeStatus(kernels, "ok")
    cfg = TorchBackend(qwen_dir, "cpu", quantize="none").config
    assert native_unfit(status, cfg, torch.float32) is None
    assert native_unfit(status, cfg, torch.bfloat16) == "they compute in float32, not bfloat16"
    wide = dataclasses.replace(cfg, head_dim=kernels.max_head_dim * 2)
    assert (
        native_unfit(status, wide, torch.float32)
        == f"head dim {kernels.max_head_dim * 2} exceeds their {kernels.max_head_dim}"
    )
    assert native_unfit(NativeStatus(None, "no C compiler was found"), cfg, torch.float32) == "no C compiler was found"


@pytest.mark.parametrize(
    "qtype", [t for t in BlockType if t.quantizable], ids=lambda t: t.name
)  # a tiny matrix of each
def test_the_native_embedding_rows_equal_the_python_dequantization(kernels: NativeKernels, qtype: BlockType) -> None:
    """The tied embedding's rows from the kernels are engine.model.quant.dequantize's bit for bit; an id outside the
    vocabulary is refused with nothing read."""
    head = block_linear(kernels, qtype, 40, 160, 2, seed=3)
    native, python = NativeBlockEmbedding(kernels, head), BlockEmbedding(lin_weights(head))
    ids = torch.tensor([[0, 39, 7], [7, 1, 20]])
    assert torch.equal(native(ids), python(ids))
    assert native(ids).shape == (2, 3, 160)
    for bad in (40, -1):
        with pytest.raises(IndexError):
            native(torch.tensor([[1, bad]]))


def test_q4_k_and_q6_k_take_int8_activations_only_where_their_byte_routes_are_built() -> None:
    q4_k, q6_k, q8_0, q5_k = 12, 14, 8, 13
    assert activation_parts([q4_k], "avx512-vnni") == 1
    assert activation_parts([q4_k, q6_k], "avx512-vnni") == 1  # a fused q/k/v of both: one int8 row
    assert activation_parts([q4_k, q8_0], "avx512-vnni") == 2  # a part of another format: int16 for all
    assert activation_parts([q5_k], "avx512-vnni") == 2
    for isa in ("avx2", "neon-dotprod", "portable"):  # their int8 routes for these go block by block
        assert activation_parts([q4_k], isa) == 2
    assert [activation_numerics(f) for f in ({1}, {2}, {1, 2})] == ["a8", "a16i", "a16ik8"]
