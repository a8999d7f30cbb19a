"""The reference interpreter itself: it reads weights exactly as coremltools wrote them, it implements exactly the
ops our conversions emit (no more, no fewer), and it refuses anything else loudly."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from coremltools import libmilstoragepython

from coreml.__main__ import main
from coreml.errors import UnsupportedOp
from coreml.interpreter import OPS, Interpreter
from engine.backends.coreml.bundle import Bundle
from engine.backends.coreml.milblob import BlobFile, dtype_name, tensor_shape
from engine.backends.coreml.package import Package
from engine.model.network import Transformer
from tests.helpers.coreml_bundles import op_types
from tests.helpers.coreml_fixtures import VARIANTS

# Ops only another family's bundle emits (Gemma 3's tanh-GELU gating): tests/coreml/test_families.py checks them.
FAMILY_OPS = {"gelu"}

READERS = {
    "FLOAT16": "read_fp16_data",
    "FLOAT32": "read_float_data",
    "INT8": "read_int8_data",
    "UINT8": "read_uint8_data",
    "INT4": "read_int4_data",
    "UINT4": "read_uint4_data",
    "UINT6": "read_uint6_data",
    "INT16": "read_int16_data",
    "UINT16": "read_uint16_data",
    "INT32": "read_int32_data",
    "UINT32": "read_uint32_data",
}


def blob_values(pkg: Package):
    for fn in pkg.spec.mlProgram.functions.values():
        for block in fn.block_specializations.values():
            for op in block.operations:
                values = (
                    [op.attributes["val"]]
                    if op.type == "const"
                    else [a.value for arg in op.inputs.values() for a in arg.arguments if a.HasField("value")]
                )
                for v in values:
                    if v.HasField("blobFileValue"):
                        yield v


@pytest.mark.parametrize("variant", [*VARIANTS, "default"])
def test_blob_reader_matches_coremltools(
    variant: str, coreml_bundle: Callable[[str], Path], default_bundle: Path
) -> None:
    bundle = Bundle.open(default_bundle if variant == "default" else coreml_bundle(variant))
    seen = set()
    for name in bundle.program_names:
        pkg = bundle.package(name)
        ours = BlobFile(pkg.weights_path)
        theirs = libmilstoragepython._BlobStorageReader(str(pkg.weights_path))
        for v in blob_values(pkg):
            dtype = dtype_name(v.type.tensorType.dataType)
            got = ours.read(v.blobFileValue.offset, dtype, tensor_shape(v.type.tensorType))
            want = np.asarray(getattr(theirs, READERS[dtype])(v.blobFileValue.offset))
            if dtype == "FLOAT16":
                want = want.view(np.float16)  # coremltools returns fp16 as its raw uint16 bits
            np.testing.assert_array_equal(got.ravel(), want.ravel()[: got.size])
            seen.add(dtype)
    quantize = bundle.quantize
    expected = {
        "none": {"FLOAT16"},
        "int8": {"INT8"},
        "int4": {"INT4"},
        "lut4": {"UINT4"},
        "lut6": {"UINT6"},
        "lut8": {"UINT8"},
    }[quantize]
    assert expected <= seen


def test_every_emitted_op_is_implemented_and_every_implemented_op_is_emitted(
    coreml_bundle: Callable[[str], Path], default_bundle: Path, coreml_big_vocab: tuple[Transformer, Path]
) -> None:
    used = op_types(Bundle.open(default_bundle)) + op_types(Bundle.open(coreml_big_vocab[1]))
    for variant in VARIANTS:
        used += op_types(Bundle.open(coreml_bundle(variant)))
    used.pop("const")
    ops = set(OPS) - FAMILY_OPS
    assert set(used) == ops, f"unimplemented: {set(used) - ops}; never emitted: {ops - set(used)}"


def _broken(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> tuple[Bundle, Package]:
    shutil.copytree(coreml_bundle("none"), tmp_path / "broken")
    bundle = Bundle.open(tmp_path / "broken")
    return bundle, bundle.package("chunk_0")


def test_an_unknown_op_fails_loudly(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> None:
    bundle, pkg = _broken(coreml_bundle, tmp_path)
    fn = pkg.spec.mlProgram.functions["decode"]
    op = next(op for op in fn.block_specializations[fn.opset].operations if op.type == "silu")
    op.type = "gelu_tanh_custom"
    pkg.spec_path.write_bytes(pkg.spec.SerializeToString())
    with pytest.raises(UnsupportedOp, match="gelu_tanh_custom"):
        Interpreter(pkg.path)
    assert main(["check", str(bundle.path)]) == 1


def test_an_unsupported_variant_of_a_known_op_fails_loudly(
    coreml_bundle: Callable[[str], Path], tmp_path: Path
) -> None:
    _, pkg = _broken(coreml_bundle, tmp_path)
    fn = pkg.spec.mlProgram.functions["decode"]
    ops = list(fn.block_specializations[fn.opset].operations)
    concat = next(op for op in ops if op.type == "concat")
    flag = concat.inputs["interleave"].arguments[0].name
    const = next(op for op in ops if op.type == "const" and op.outputs[0].name == flag)
    const.attributes["val"].immediateValue.tensor.bools.values[0] = True
    pkg.spec_path.write_bytes(pkg.spec.SerializeToString())
    interp = Interpreter(pkg.path)
    inputs = {n: np.zeros(t.shape, np.float16) for n, t in interp.functions["decode"].inputs.items()}
    with pytest.raises(UnsupportedOp, match="interleaved concat"):
        interp.run("decode", inputs, interp.new_state())


def test_fp16_overflow_is_recorded(coreml_bundle: Callable[[str], Path]) -> None:
    """A finite result that does not fit fp16 is recorded (check's smoke run fails on it), never silently inf."""
    interp = Interpreter(Bundle.open(coreml_bundle("none")).package("chunk_0"))
    fn = interp.functions["decode"]
    inputs = {n: np.zeros(t.shape, np.float16) for n, t in fn.inputs.items()}
    interp.run("decode", inputs, interp.new_state())
    assert interp.overflows == []
    state = interp.new_state()
    state["k_cache"] = np.full_like(state["k_cache"], 6e4)
    inputs["keep"] = np.full(fn.inputs["keep"].shape, 2, np.float16)  # cache * keep = 1.2e5 > 65504
    interp.run("decode", inputs, state)
    assert interp.overflows and all(isinstance(o, str) for o in interp.overflows)
