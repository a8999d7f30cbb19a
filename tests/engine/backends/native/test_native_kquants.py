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
from engine.backends.native.decoder import NativeBlockEmbedding, NativeBlockLinear
from engine.model.quant import LEVELS, BlockType, k3_scales, k4_scales, k6_quants, tq1_trits
from tests.engine.backends.native.test_native import X86, has_cpu_flags, quantize_activation
from tests.helpers.quant_blocks import random_blocks

F32 = np.float32
TYPES = [t for t in BlockType if t.name not in ("Q8_0", "Q4_0", "Q4_1")]
HALF_SCALED = (BlockType.Q6_K, BlockType.Q3_K, BlockType.Q2_K)  # a scale per 16 weights
WITH_MIN = (BlockType.Q4_K, BlockType.Q5_K, BlockType.Q5_1)  # w = scale * q + mw, mw per block of 32


def _f16(b: np.ndarray) -> np.ndarray:  # (..., 2) uint8 -> (...) float32
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(F32)


def _pairs(qs: np.ndarray) -> np.ndarray:  # (blocks, 64) 2-bit fields -> (blocks, 8, 32): weight 128h + 32s + l
    return ((qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(
        -1, 8, 32
    )


def _bits(qh: np.ndarray) -> np.ndarray:  # (blocks, 32) -> (blocks, 8, 32): bit j of byte e
    return (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1


def block_factors(qtype: BlockType, raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """raw (N, row bytes) -> per block of 32: signed quants (N, nb, 32) int64, dw, mw (N, nb) float32, the halves'
    scales s0, s1 and (Q2_K) mins m0, m1 (N, nb) int64, as the kernels' kq_unpack."""
    n = raw.shape[0]
    b = raw.reshape(-1, qtype.block_bytes)
    per = qtype.elements // 32  # blocks of 32 per block of the format
    zero = np.zeros((len(b), per), np.int64)
    s0, s1, m0, m1 = zero, zero, zero, zero
    mw = np.zeros((len(b), per), F32)
    if qtype in (BlockType.Q5_0, BlockType.Q5_1):
        off = 2 if qtype is BlockType.Q5_0 else 4
        qh = b[:, off : off + 4].copy().view("<u4").astype(np.uint32)
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        q = np.concatenate([b[:, off + 4 :] & 0x0F, b[:, off + 4 :] >> 4], axis=1).astype(np.int64) | hi
        q = q - 16 if qtype is BlockType.Q5_0 else q
        dw = _f16(b[:, 0:2])[:, None]
        if qtype is BlockType.Q5_1:
            mw = _f16(b[:, 2:4])[:, None]
    elif qtype is BlockType.IQ4_NL:
        q = LEVELS[np.concatenate([b[:, 2:] & 0x0F, b[:, 2:] >> 4], axis=1)].astype(np.int64)
        dw = _f16(b[:, 0:2])[:, None]
    elif qtype in (BlockType.Q4_K, BlockType.Q5_K):
        sc, mn = k4_scales(b[:, 4:16])  # (blocks, 8)
        at = 16 if qtype is BlockType.Q4_K else 48
        qs = b[:, at:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(-1, 8, 32).astype(np.int64)
        if qtype is BlockType.Q5_K:
            q = q | (_bits(b[:, 16:48]).astype(np.int64) << 4)
        dw = (_f16(b[:, 0:2])[:, None] * sc.astype(F32)).astype(F32)
        mw = -(_f16(b[:, 2:4])[:, None] * mn.astype(F32)).astype(F32)
    elif qtype is BlockType.Q6_K:
        q = k6_quants(b).astype(np.int64).reshape(-1, 8, 32)
        sc = b[:, 192:208].copy().view(np.int8).astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 208:210])[:, None], 8, axis=1)
        s0, s1 = sc[..., 0], sc[..., 1]
    elif qtype is BlockType.Q3_K:
        q = _pairs(b[:, 32:96]).astype(np.int64) - 4 * (1 - _bits(b[:, :32]).astype(np.int64))
        sc = k3_scales(b[:, 96:108]).astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 108:110])[:, None], 8, axis=1)
        s0, s1 = sc[..., 0], sc[..., 1]
    elif qtype is BlockType.Q2_K:
        q = _pairs(b[:, 16:80]).astype(np.int64)
        sc = b[:, :16].astype(np.int64).reshape(-1, 8, 2)
        dw = np.repeat(_f16(b[:, 80:82])[:, None], 8, axis=1)
        mw = np.repeat(-_f16(b[:, 82:84])[:, None], 8, axis=1)
        s0, s1, m0, m1 = sc[..., 0] & 15, sc[..., 1] & 15, sc[..., 0] >> 4, sc[..., 1] >> 4
    elif qtype is BlockType.IQ4_XS:
        high = (b[:, 2:4].copy().view("<u2").astype(np.int64) >> (2 * np.arange(8))) & 3
        low = (b[:, 4:8].astype(np.int64)[:, :, None] >> np.array([0, 4])).reshape(-1, 8) & 15
        dw = (_f16(b[:, 0:2])[:, None] * ((low | high << 4) - 32).astype(F32)).astype(F32)
        qs = b[:, 8:].reshape(-1, 8, 16)
        q = LEVELS[np.concatenate([qs & 0x0F, qs >> 4], axis=2)].astype(np.int64)
    elif qtype is BlockType.TQ2_0:
        q = _pairs(b[:, :64]).astype(np.int64) - 1
        dw = np.repeat(_f16(b[:, 64:66])[:, None], 8, axis=1)
    else:  # TQ1_0
        q = tq1_trits(b).astype(np.int64).reshape(-1, 8, 32)
        dw = np.repeat(_f16(b[:, 52:54])[:, None], 8, axis=1)
    factors = (dw.astype(F32), mw.astype(F32), s0, s1, m0, m1)
    return (q.reshape(n, -1, 32), *(np.broadcast_to(f, (len(b), per)).reshape(n, -1) for f in factors))


def integer_reference(qtype: BlockType, raw: np.ndarray, bias: np.ndarray, x: np.ndarray, parts: int) -> np.ndarray:
    """One activation row x (K,) through raw (N, row bytes): exact integer half-block sums, then the float terms of
    the kernels in their fixed order (block b into partial sum b % 8, then a fixed tree)."""
    q, dw, mw, s0, s1, m0, m1 = block_factors(qtype, raw)
    n, nb = dw.shape
    xq, d = quantize_activation(x.reshape(nb, 32).astype(F32), parts)
    h0 = (q[:, :, :16] * xq[None, :, :16]).sum(axis=2)  # (N, nb) exact
    h1 = (q[:, :, 16:] * xq[None, :, 16:]).sum(axis=2)
    assert max(np.abs(h0).max(), np.abs(h1).max()) < 2**31  # what the kernel's int32 lanes hold
    scale = (dw * d[None]).astype(F32)
    if qtype is BlockType.Q2_K:  # one int32 sum of the halves' products, and the mins against the halves' sums
        x0, x1 = xq[:, :16].sum(axis=1), xq[:, 16:].sum(axis=1)  # (nb,)
        term = (scale * (s0 * h0 + s1 * h1).astype(F32)).astype(F32)
        term = (term + (mw * d[None]).astype(F32) * (m0 * x0[None] + m1 * x1[None]).astype(F32)).astype(F32)
    elif qtype in HALF_SCALED:
        halves = ((s0 * h0).astype(F32) + (s1 * h1).astype(F32)).astype(F32)  # each product an exact int32
        term = (scale * halves).astype(F32)
    else:
        term = (scale * (h0 + h1).astype(F32)).astype(F32)
    if qtype in WITH_MIN:
        ds = (d * xq.sum(axis=1).astype(F32)).astype(F32)
        term = (term + mw * ds[None]).astype(F32)
    acc = np.zeros((n, 8), F32)
    for b in range(nb):
        acc[:, b % 8] = (acc[:, b % 8] + term[:, b]).astype(F32)
    y = ((acc[:, 0] + acc[:, 4]) + (acc[:, 1] + acc[:, 5])) + ((acc[:, 2] + acc[:, 6]) + (acc[:, 3] + acc[:, 7]))
    out: np.ndarray = (y + bias).astype(F32)
    return out


def kquant_linear(kernels: NativeKernels, qtype: BlockType, n: int, k: int, parts: int) -> NativeBlockLinear:
    raw = random_blocks(qtype, n, k, seed=k + qtype.ggml_id)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(k))
    return NativeBlockLinear(kernels, BlockWeights(qtype, (n, k), torch.from_numpy(raw)), bias, parts)


def bias_of(lin: NativeBlockLinear) -> np.ndarray:
    assert lin.bias is not None
    return lin.bias.numpy()


def activations(k: int) -> torch.Tensor:
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(1))  # (6, K)
    x[3] = 0  # an all-zero row quantizes to zeros with scale 0: just the bias
    x[4, :32] *= 1e4  # an outlier block
    return x


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_the_integer_reference_takes_the_products_it_claims(qtype: BlockType) -> None:
    """With fp32 rounding taken out, the reference is the plain product of the dequantized matrix (guards the
    reference itself against a mixed-up nibble, bit or scale)."""
    raw = random_blocks(qtype, 5, 512, seed=7)
    bw = BlockWeights(qtype, (5, 512), torch.from_numpy(raw))
    x = np.random.default_rng(0).standard_normal(512).astype(F32)
    want = bw.dequantized().double().numpy() @ x.astype(np.float64)
    got = integer_reference(qtype, raw, np.zeros(5, F32), x, 2)
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
        want = integer_reference(qtype, raw, bias_of(lin), x[i].numpy(), parts)
        assert np.array_equal(many[i].numpy(), want), i
        assert torch.equal(lin(x[i : i + 1]), many[i : i + 1])  # one row (decode) = the same row of a prefill
    assert torch.equal(many[3], torch.from_numpy(bias_of(lin)))


@pytest.mark.parametrize("qtype", [BlockType.Q5_0, BlockType.Q5_1, BlockType.IQ4_NL], ids=lambda t: t.name)
def test_blocks_of_32_run_at_widths_of_any_multiple_of_32(kernels: NativeKernels, qtype: BlockType) -> None:
    lin = kquant_linear(kernels, qtype, 11, 576, 2)  # SmolLM's hidden size: 18 blocks, a tail of 2
    x = activations(576)
    many = lin(x)
    for i in range(6):
        want = integer_reference(qtype, lin.blocks.numpy(), bias_of(lin), x[i].numpy(), 2)
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
