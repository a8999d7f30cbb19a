"""A prefill's lane routes of x86/quants.c: on AVX-512 16 tokens in the lanes of a vector,
weight rows in pairs, for every block type; on AVX2 8 weight rows in the lanes and the tokens broadcast, for Q8_0,
Q4_0 and Q4_1 (the tests below run the route of the machine's build). At token counts across group boundaries and
widths with a partial group of 8 blocks, every output equals the integer reference bit for bit and the same row
decoded alone; on AVX-512, the AVX2 build computes the same bits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.backends.native import NativeKernels, bind, build_library
from engine.backends.native.decoder import NativeBlockLinear
from engine.model.quant import BlockType
from tests.helpers.native_refs import (
    LEGACY,
    X86,
    bias_of,
    block_linear,
    has_cpu_flags,
    kquant_linear,
    kquant_reference,
    legacy_reference,
    lin_weights,
)
from tests.helpers.native_refs import TYPES as KQUANTS

TOKENS = 40  # two whole groups of 16 and a partial one; five of 8


def activations(k: int) -> torch.Tensor:
    x = torch.randn(TOKENS, k, generator=torch.Generator().manual_seed(k))  # (TOKENS, K)
    x[16] = 0  # an all-zero row (a group's first): scale 0, just the bias
    x[17, :32] *= 1e4  # an outlier block
    x[39, -32:] *= 1e-4  # a tiny one, in the last (partial) group
    return x


def test_this_machine_builds_the_512_bit_route(kernels: NativeKernels) -> None:
    """Where the CPU has AVX-512 BW and VNNI the native build is the AVX-512 one, so the tests below run the
    token-lane route (elsewhere they check the build's own route)."""
    if not (X86 and has_cpu_flags("avx512bw", "avx512vl", "avx512_vnni")):
        pytest.skip("no AVX-512 VNNI on this machine")
    assert kernels.isa == "avx512-vnni"


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [32, 160, 576, 1536])  # 1, 5, 18 (SmolLM's hidden) and 48 (its MLP) blocks
def test_prefill_across_token_groups_equals_the_integer_reference(
    kernels: NativeKernels, qtype: BlockType, k: int
) -> None:
    lin = block_linear(kernels, qtype, 37, k, 2, seed=k + 1)  # 18 row pairs and a single row
    x = activations(k)
    many = lin(x)  # (TOKENS, 37)
    w, bias = lin_weights(lin), bias_of(lin)
    for i in range(TOKENS):
        assert np.array_equal(many[i].numpy(), legacy_reference(w, bias, x[i].numpy(), 2)), i
        assert torch.equal(lin(x[i : i + 1]), many[i : i + 1]), i  # a decoding step = the same prefill row
    for m in (2, 5, 7, 8, 13, 15, 16, 17, 20, 24, 33):  # by rows; a group, whole or partial; groups and rows after
        assert torch.equal(lin(x[:m]), many[:m]), m
        assert torch.equal(lin(x[TOKENS - m :]), many[TOKENS - m :]), m  # the same tokens in other lanes


def test_a_single_output_row_and_odd_thread_splits_change_no_bit(kernels: NativeKernels) -> None:
    x = activations(576)
    for qtype in LEGACY:
        one = block_linear(kernels, qtype, 1, 576, 2, seed=5)  # no pair at all
        want = legacy_reference(lin_weights(one), bias_of(one), x[5].numpy(), 2)
        assert np.array_equal(one(x)[5].numpy(), want)
        lin = block_linear(kernels, qtype, 45, 576, 2, seed=6)
        single = lin(x)
        kernels.use_threads(3)  # 15 rows a thread: pairs and a single row in each share
        torch.set_num_threads(3)
        try:
            assert torch.equal(lin(x), single), qtype
        finally:
            torch.set_num_threads(1)
            kernels.use_threads(1)


@pytest.mark.skipif(not X86, reason="x86 instruction-set variants")
def test_the_avx2_build_computes_the_same_bits(kernels: NativeKernels, tmp_path: Path) -> None:
    """Both builds' prefill routes: 37 rows (a partial group of 8 on AVX2), token counts with a partial group or rows
    after the groups, and 3 threads splitting the rows off the groups."""
    avx2 = bind(build_library(tmp_path, extra_flags=("-mno-avx512f",)))
    assert avx2.isa == "avx2"
    x = activations(576)
    for qtype in LEGACY:
        ours = block_linear(kernels, qtype, 37, 576, 2, seed=9)
        theirs = NativeBlockLinear(avx2, lin_weights(ours), ours.bias, 2)
        for m in (6, 13, 15, 16, 40):
            assert torch.equal(ours(x[:m]), theirs(x[:m])), (qtype, m)
        avx2.use_threads(3)
        torch.set_num_threads(3)
        try:
            assert torch.equal(ours(x), theirs(x)), qtype
        finally:
            torch.set_num_threads(1)
            avx2.use_threads(1)


@pytest.mark.parametrize("qtype", KQUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 1536])  # one super-block (8 blocks of 32); SmolLM's MLP width (48)
def test_k_quant_prefill_across_token_groups_equals_the_integer_reference(
    kernels: NativeKernels, qtype: BlockType, k: int
) -> None:
    lin = kquant_linear(kernels, qtype, 37, k, 2)
    x = activations(k)
    many = lin(x)  # (TOKENS, 37)
    raw, bias = lin.blocks.numpy(), bias_of(lin)
    for i in range(TOKENS):
        assert np.array_equal(many[i].numpy(), kquant_reference(qtype, raw, bias, x[i].numpy(), 2)), i
        assert torch.equal(lin(x[i : i + 1]), many[i : i + 1]), i
    for m in (2, 17, 33):
        assert torch.equal(lin(x[:m]), many[:m]), m
        assert torch.equal(lin(x[TOKENS - m :]), many[TOKENS - m :]), m


def test_q5_0_prefill_with_a_partial_block_group_equals_the_reference(kernels: NativeKernels) -> None:
    lin = kquant_linear(kernels, BlockType.Q5_0, 12, 576, 2)  # 18 blocks: two groups of 8 and a partial one
    x = activations(576)
    many = lin(x)
    for i in range(TOKENS):
        assert np.array_equal(
            many[i].numpy(), kquant_reference(BlockType.Q5_0, lin.blocks.numpy(), bias_of(lin), x[i].numpy(), 2)
        )


@pytest.mark.skipif(not X86, reason="x86 instruction-set variants")
def test_the_avx2_build_computes_the_same_k_quant_bits(kernels: NativeKernels, tmp_path: Path) -> None:
    avx2 = bind(build_library(tmp_path, extra_flags=("-mno-avx512f",)))
    x = activations(512)
    for qtype in KQUANTS:
        here, there = kquant_linear(kernels, qtype, 21, 512, 2), kquant_linear(avx2, qtype, 21, 512, 2)
        assert torch.equal(here(x), there(x)), qtype


@pytest.mark.skipif(not X86, reason="x86 instruction-set variants")
def test_activations_quantize_as_the_scalar_loop_even_when_hostile(kernels: NativeKernels, tmp_path: Path) -> None:
    """The AVX-512 build quantizes activation blocks 16 lanes at a time, the AVX2 build with the scalar loop: NaN,
    infinities, denormals (whose scale overflows) and huge values give the same bits, one row or many, int8 or
    int16 activations."""
    avx2 = bind(build_library(tmp_path, extra_flags=("-mno-avx512f",)))
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[1, 41] = -float("inf")
    x[2, 64:96] = torch.tensor(1e-40) * torch.arange(32)  # denormals: 32767 / amax is infinite
    x[3, :32] = 3e38
    x[4, 96:] = -0.0
    for qtype in LEGACY:
        for parts in (1, 2):
            ours = block_linear(kernels, qtype, 10, 128, parts, seed=3)
            theirs = NativeBlockLinear(avx2, lin_weights(ours), ours.bias, parts)
            for rows in (x, x[1:2], x[2:3]):
                assert torch.equal(ours(rows).view(torch.int32), theirs(rows).view(torch.int32)), (qtype, parts)


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_amx_tiles_compute_the_lane_routes_bits(kernels: NativeKernels, qtype: BlockType) -> None:
    """Where the CPU has AMX, a verify's or a prefill's products of int16 rows run on its tiles (16 weight rows by up
    to 16 tokens a block); switched off, the lane and row routes run: every output the same bits, whatever the
    token count, with a partial group of weight rows and a thread split inside one."""
    if not (X86 and has_cpu_flags("amx_tile", "amx_int8", "avx512_vnni")):
        pytest.skip("no AMX on this machine")
    lin = block_linear(kernels, qtype, 37, 576, 2, seed=11)
    x = activations(576)
    assert kernels.use_amx(True)
    try:
        tiles = {m: lin(x[:m]) for m in (2, 3, 7, 16, 17, 40)}
        kernels.use_threads(2)  # 18 and 19 rows: each thread's range ends inside a group of 16
        torch.set_num_threads(2)
        split = lin(x)
        assert not kernels.use_amx(False)
        for m, y in tiles.items():
            assert torch.equal(y, lin(x[:m])), m
        assert torch.equal(split, lin(x))
    finally:
        kernels.use_amx(True)
        kernels.use_threads(1)
        torch.set_num_threads(1)
