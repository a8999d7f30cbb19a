"""The block formats beyond Q8_0/Q4_0/Q4_1 (Q5_0, Q5_1, the K-quants, IQ4_NL/XS, TQ1_0/TQ2_0): our dequantization equals the gguf package's on
the same bytes, Q5_0's quantizer writes ggml's reference bytes, and a stored tensor's float fields are checked."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from engine.model.quant import BlockType, StoredTensor, check_stored, dequantize, quantize, scales_finite
from tests.helpers.quant_blocks import FLOATS, random_blocks

NEW = [t for t in BlockType if t.name not in ("Q8_0", "Q4_0", "Q4_1")]


@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_package_on_the_same_bytes(qtype: BlockType) -> None:
    n, k = 7, 512
    data = random_blocks(qtype, n, k, seed=qtype.ggml_id)
    want = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, qtype.gguf_name))  # (n, k)
    got = dequantize(data, qtype, (n, k))
    assert got.dtype == np.float32 and got.shape == (n, k)
    assert np.array_equal(got, want)
    assert np.array_equal(dequantize(data[2:5], qtype, (n, k)), want[2:5])  # any rows of a matrix


def test_q5_0_quantizer_writes_ggmls_reference_bytes() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((9, 96)) * rng.uniform(0.01, 2, size=(9, 1))).astype(np.float32)
    w[0, :32] = 0  # an all-zero block: scale 0
    want = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q5_0)
    got = quantize(w, BlockType.Q5_0)
    assert np.array_equal(got, want)
    back = dequantize(got, BlockType.Q5_0, w.shape)
    d = np.abs(w.reshape(-1, 32)).max(axis=1, keepdims=True) / 16  # a step of the block's grid
    # Round to nearest (half a step), except that +16 steps clamps to 15: within one step (plus the fp16 scale's
    # rounding, 2^-11 relative, over 16 steps).
    assert np.all(np.abs(back - w).reshape(-1, 32) <= d * (1 + 16 * 2**-11) + 1e-7)


@pytest.mark.parametrize("qtype", [t for t in NEW if t is not BlockType.Q5_0], ids=lambda t: t.name)
def test_k_quants_have_no_quantizer_and_say_so(qtype: BlockType) -> None:
    assert not qtype.quantizable
    with pytest.raises(ValueError, match="runs only as a GGUF file stores it"):
        quantize(np.zeros((2, 256), np.float32), qtype)


@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_stored_k_quants_check_their_shape_and_float_fields(qtype: BlockType) -> None:
    data = random_blocks(qtype, 3, 256)
    t = StoredTensor(qtype.gguf_name, (3, 256), data.reshape(-1))
    assert check_stored(t) is qtype and scales_finite(t)
    with pytest.raises(ValueError, match="cannot hold"):
        check_stored(StoredTensor(qtype.gguf_name, (3 * 256 // 224, 224) if qtype.elements == 256 else (3, 250), data))
    bad = data.reshape(-1, qtype.block_bytes).copy()
    at = FLOATS.get(qtype.name, (0,))[-1]  # the last float field: a K-quant's dmin
    bad[1, at : at + 2] = np.array([np.inf], np.float16).view(np.uint8)
    assert not scales_finite(StoredTensor(qtype.gguf_name, (3, 256), bad.reshape(-1)))


@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_any_bytes_read_as_the_gguf_package_reads_them(qtype: BlockType) -> None:
    """A hostile file's blocks (NaN and infinite scales included) dequantize to the very values gguf's reader gives."""
    junk = np.random.default_rng(qtype.ggml_id).integers(
        0, 256, (4, 2 * qtype.block_bytes * 256 // qtype.elements), dtype=np.uint8
    )
    with np.errstate(invalid="ignore", over="ignore"):  # junk scales are inf/NaN on purpose, in both readers
        want = gguf.quants.dequantize(junk, getattr(gguf.GGMLQuantizationType, qtype.gguf_name))
        got = dequantize(junk, qtype, (4, 512))
    assert np.array_equal(got, want, equal_nan=True)
