"""The native decoding attention (spark_attention.c) equals PyTorch's over the same fp16 table: keys rotated on read
at each slot's position, a rotation frame's split, slots with gaps, at window lengths on both sides of its tile (16
keys) and chunk (64 keys) edges, on one thread and on two (chunks merged by their maxima)."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import pytest
import torch

from engine.backends.native import AttnDesc, NativeKernels, bind, build_library, load_kernels
from engine.model.attention import apply_rope


@pytest.fixture(scope="module")
def kernels() -> NativeKernels:
    status = load_kernels()
    assert status.kernels is not None, status.reason
    return status.kernels


def reference(
    q_new: torch.Tensor,
    q_plain: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    split: int,
) -> torch.Tensor:
    """q_* (H, D); k, v (Hkv, C, D) fp16; slots, positions (m,) -> (H, D): what engine.model.slots computes."""
    h, d = q_new.shape
    hkv = k.shape[0]
    keys = apply_rope(k[:, slots].float()[None], cos[positions][None, None], sin[positions][None, None])[0]
    values = v[:, slots].float()  # (Hkv, m, D)
    qn, qp = q_new.view(hkv, h // hkv, d), q_plain.view(hkv, h // hkv, d)
    scores = torch.cat((qp @ keys[:, :split].transpose(1, 2), qn @ keys[:, split:].transpose(1, 2)), -1)
    return ((scores * d**-0.5).softmax(-1) @ values).reshape(h, d)


def native(
    kernels: NativeKernels,
    q_new: torch.Tensor,
    q_plain: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    split: int,
) -> torch.Tensor:
    h, d = q_new.shape
    width = slots.numel()
    partial = torch.empty(int(kernels.lib.spark_attend_floats(h, d, width)))
    out = torch.empty(h, d)
    desc = AttnDesc(
        k.data_ptr(),
        v.data_ptr(),
        k.shape[1],
        1,
        slots.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        width,
        split,
        q_new.data_ptr(),
        q_plain.data_ptr(),
        h,
        k.shape[0],
        d,
        d**-0.5,
        0,
        partial.data_ptr(),
        out.data_ptr(),
    )
    kernels.lib.spark_attend(ctypes.byref(desc))
    return out


def check_against_pytorch(kernels: NativeKernels, threads: int, width: int, d: int) -> None:
    g = torch.Generator().manual_seed(width * 7 + d)
    h, hkv, capacity = 6, 2, 1100 + width
    k = (torch.randn(hkv, capacity, d, generator=g) * 2).half()  # (Hkv, C, D) unrotated, as the table holds them
    v = torch.randn(hkv, capacity, d, generator=g).half()
    slots = torch.randperm(capacity, generator=g)[:width].sort().values  # (m,) in slot order, with gaps
    positions = torch.randint(0, 4000, (width,), generator=g)  # (m,) each key's rotation position
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(4096).float(), inv)
    cos = torch.cat((angles, angles), -1).cos()  # (P, D)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)  # signed, as RotaryTable stores it
    q_new, q_plain = torch.randn(h, d, generator=g), torch.randn(h, d, generator=g)
    split = width // 3
    ref = reference(q_new, q_plain, k, v, slots, positions, cos, sin, split)
    kernels.use_threads(threads)
    try:
        ours = native(kernels, q_new, q_plain, k, v, slots, positions, cos, sin, split)
    finally:
        kernels.use_threads(torch.get_num_threads())
    # fp32 throughout on both sides, summed in other orders: far inside an fp16 rounding of the values.
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 63, 64, 65, 129, 300, 1031])
# d: the compiled-for-64 route, the general one, vector tails, a head narrower than one vector
@pytest.mark.parametrize("d", [64, 32, 40, 12])
def test_native_attention_equals_pytorch_over_the_fp16_table(
    kernels: NativeKernels, threads: int, width: int, d: int
) -> None:
    check_against_pytorch(kernels, threads, width, d)


X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.mark.skipif(not X86, reason="instruction-set variants of x86")
@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "portable"])
def test_every_instruction_set_variant_attends_as_pytorch(tmp_path: Path, flags: tuple[str, ...]) -> None:
    """The 8-lane (AVX2) and one-lane (portable) routes of the attention; NEON's runs under qemu (arm_check.c)."""
    variant = bind(build_library(tmp_path, extra_flags=flags))
    for width, d in ((17, 64), (300, 64), (65, 40)):
        check_against_pytorch(variant, 1, width, d)
