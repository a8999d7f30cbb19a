"""The native kernels of spark_kquants.h's formats (Q5_0, Q5_1, the K-quants, IQ4_NL/XS, TQ1_0/TQ2_0: every GGUF format but
the legacy three): every instruction-set
variant computes each product bit for bit as the integer reference below, a prefill's rows equal one-row decodes,
and the reference itself is the plain product of the dequantized weights. The Arm builds (NEON dot product and
portable) run a C checker with its own reference under qemu, and must hash every output as this machine does."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.blocks import BlockEmbedding, BlockWeights
from engine.backends.native import NATIVE_DIR, SOURCES, NativeKernels, _compiler, bind, build_library, compile_flags
from engine.backends.native.decoder import NativeBlockEmbedding
from engine.model.quant import BlockType
from tests.helpers.native_refs import (
    TYPES,
    X86,
    activations,
    bias_of,
    has_cpu_flags,
    kquant_linear,
    kquant_reference,
)
from tests.helpers.quant_blocks import random_blocks

F32 = np.float32


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_integer_reference_takes_the_products_it_claims(qtype: BlockType) -> None:
    """With fp32 rounding taken out, the reference is the plain product of the dequantized matrix (guards the
    reference itself against a mixed-up nibble, bit or scale)."""
    raw = random_blocks(qtype, 5, 512, seed=7)
    bw = BlockWeights(qtype, (5, 512), torch.from_numpy(raw))
    x = np.random.default_rng(0).standard_normal(512).astype(F32)
    want = bw.dequantized().double().numpy() @ x.astype(np.float64)
    got = kquant_reference(qtype, raw, np.zeros(5, F32), x, 2)
    assert np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())  # int16 activations: ~16 bits


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 1536])  # one super-block; SmolLM's MLP width (6 super-blocks, 48 blocks of 32)
def test_products_equal_the_integer_reference_bit_for_bit(
    kernels: NativeKernels,
    qtype: BlockType,
    k: int,
    parts: int,
) -> None:
    lin = kquant_linear(kernels, qtype, 37, k, parts)
    x = activations(k)
    many = lin(x)  # (6, 37): the prefill path, rows in groups of 4 and a remainder
    raw = lin.blocks.numpy()
    for i in range(6):
        want = kquant_reference(qtype, raw, bias_of(lin), x[i].numpy(), parts)
        assert np.array_equal(many[i].numpy(), want), i
        assert torch.equal(lin(x[i : i + 1]), many[i : i + 1])  # one row (decode) = the same row of a prefill
    assert torch.equal(many[3], torch.from_numpy(bias_of(lin)))


@pytest.mark.parametrize("qtype", [BlockType.Q5_0, BlockType.Q5_1, BlockType.IQ4_NL], ids=lambda t: t.name)
def test_blocks_of_32_run_at_widths_of_any_multiple_of_32(kernels: NativeKernels, qtype: BlockType) -> None:
    lin = kquant_linear(kernels, qtype, 11, 576, 2)  # SmolLM's hidden size: 18 blocks, a tail of 2
    x = activations(576)
    many = lin(x)
    for i in range(6):
        want = kquant_reference(qtype, lin.blocks.numpy(), bias_of(lin), x[i].numpy(), 2)
        assert np.array_equal(many[i].numpy(), want), i


@pytest.mark.parametrize("qtype", [BlockType.Q4_K, BlockType.Q6_K], ids=lambda t: t.name)
def test_the_kernels_give_k_quant_embedding_rows_as_python_dequantizes_them(
    kernels: NativeKernels, qtype: BlockType
) -> None:
    """A tied head of Q4_K or Q6_K (most K-quant files' is Q6_K) serves the next token's embedding from the kernels,
    not Python's dequantization, with the same bits."""
    head = kquant_linear(kernels, qtype, 40, 512, 2)
    ids = torch.tensor([[0, 39, 7], [7, 1, 20]])
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), 512)
    assert kernels.lib.spark_dequant_rows(ctypes.byref(head.desc), flat.data_ptr(), flat.numel(), out.data_ptr()) == 1
    python = BlockEmbedding(BlockWeights(qtype, (40, 512), head.blocks, 512))
    assert torch.equal(out.reshape(2, 3, 512), python(ids))
    assert torch.equal(NativeBlockEmbedding(kernels, head)(ids), python(ids))


@pytest.mark.skipif(not X86, reason="x86 instruction-set variants")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "portable"])
def test_every_instruction_set_variant_computes_the_same_bits(
    kernels: NativeKernels,
    tmp_path: Path,
    flags: tuple[str, ...],
) -> None:
    variant = bind(build_library(tmp_path, extra_flags=flags))
    assert variant.isa == {"-mno-avx2": "portable"}.get(flags[-1], "avx2")
    for qtype in TYPES:
        for parts in (1, 2):
            here, there = kquant_linear(kernels, qtype, 19, 512, parts), kquant_linear(variant, qtype, 19, 512, parts)
            x = activations(512)
            assert torch.equal(here(x), there(x)), (qtype, parts)


ARM_CC, QEMU_ARM = shutil.which("aarch64-linux-gnu-gcc"), shutil.which("qemu-aarch64")
CHECKER = Path(__file__).with_name("kquant_check.c")


def run_checker(cc: str, flags: list[str], exe: Path, runner: list[str]) -> list[str]:
    """Build kquant_check.c with the kernels' sources and run it: its lines 'isa X', 'N mismatches', 'hash H'."""
    build = [cc, "-O3", "-std=gnu11", "-pthread", "-ffp-contract=off", *flags, f"-I{NATIVE_DIR}", str(CHECKER)]
    build += map(str, SOURCES)
    subprocess.run([*build, "-o", str(exe), "-lm"], check=True, capture_output=True, timeout=300)
    out = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.splitlines()


@pytest.fixture(scope="module")
def native_check(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    cc = _compiler()
    assert cc is not None
    tune = [f for f in compile_flags() if f.startswith("-m")]
    return run_checker(cc, tune, tmp_path_factory.mktemp("kq-check") / "check", [])


def test_the_c_checker_agrees_with_its_reference_here(native_check: list[str], kernels: NativeKernels) -> None:
    assert native_check[:2] == [f"isa {kernels.isa}", "0 mismatches"]


def test_avx512_without_gfni_computes_the_same_bits(
    native_check: list[str], kernels: NativeKernels, tmp_path: Path
) -> None:
    """AVX-512 CPUs without GFNI (Cascade Lake) pick a decoding step's Q4_K and Q6_K quants by shifts instead of
    affine byte products: exact against the reference, and every output's bits as this machine's."""
    if kernels.isa != "avx512-vnni" or not has_cpu_flags("gfni"):
        pytest.skip("needs an AVX-512 VNNI CPU with GFNI, to build without it")
    cc = _compiler()
    assert cc is not None
    tune = [f for f in compile_flags() if f.startswith("-m")]
    assert run_checker(cc, [*tune, "-mno-gfni"], tmp_path / "check", []) == native_check


@pytest.mark.skipif(
    not (ARM_CC and QEMU_ARM),
    reason="needs an aarch64 cross compiler and qemu-user (Debian: gcc-aarch64-linux-gnu qemu-user)",
)
@pytest.mark.parametrize("arch,isa", [("armv8.2-a+dotprod", "neon-dotprod"), ("armv8-a", "portable")])
def test_arm_kernels_compute_the_same_bits_under_emulation(
    tmp_path: Path, native_check: list[str], arch: str, isa: str
) -> None:
    """Apple Silicon's NEON dot-product build (and Arm's portable one): exact against the reference, and every
    output's bits hash as on this machine."""
    assert ARM_CC and QEMU_ARM
    lines = run_checker(ARM_CC, [f"-march={arch}", "-static"], tmp_path / f"check-{isa}", [QEMU_ARM])
    assert lines == [f"isa {isa}", "0 mismatches", native_check[2]]
