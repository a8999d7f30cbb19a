"""The ANE lint passes our conversions and catches deliberately broken programs; the build refuses geometries
and compressions that would break a rule."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from coremltools.proto import MIL_pb2

from coreml import ane_rules
from coreml.__main__ import main
from coreml.convert import check_geometry
from engine.backends.coreml.bundle import MANIFEST, Bundle
from engine.backends.coreml.cache import Geometry
from engine.backends.coreml.errors import ConversionError
from engine.model.config import ModelConfig
from tests.helpers.coreml_bundles import op_types


def broken_copy(src: Path, dst: Path) -> Bundle:
    shutil.copytree(src, dst)
    return Bundle.open(dst)


def rules(bundle: Bundle) -> set[str]:
    return {f.rule for f in ane_rules.lint_bundle(bundle) if f.error}


@pytest.mark.parametrize("variant", ["none", "int8", "int4", "lut6"])
def test_converted_bundles_lint_clean(variant: str, coreml_bundle: Callable[[str], Path]) -> None:
    assert rules(Bundle.open(coreml_bundle(variant))) == set()


def test_default_neural_engine_bundle_has_no_cpu_ops_and_no_per_block_weights(default_bundle: Path) -> None:
    bundle = Bundle.open(default_bundle)
    assert bundle.units == "CPU_AND_NE"
    ops = op_types(bundle)
    assert not ops.keys() & {"gather", "constexpr_blockwise_shift_scale", "cast", "select"}
    assert not ops.keys() & ane_rules.CPU_OPS
    warnings = [f for f in ane_rules.lint_bundle(bundle) if not f.error]
    assert not [f for f in warnings if f.rule in ("cpu-census", "fp16-overflow")]


def test_big_vocabulary_bundle_lints_clean(coreml_big_vocab) -> None:
    assert rules(Bundle.open(coreml_big_vocab[1])) == set()


def test_catches_fp32_oversized_misaligned_and_dynamic(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> None:
    bundle = broken_copy(coreml_bundle("none"), tmp_path / "broken")
    pkg = bundle.package("chunk_0")
    fn = pkg.spec.mlProgram.functions["decode"]
    ops = list(fn.block_specializations[fn.opset].operations)
    next(op for op in ops if op.type == "softmax").outputs[0].type.tensorType.dataType = MIL_pb2.DataType.Value(
        "FLOAT32"
    )
    next(op for op in ops if op.type == "conv").outputs[0].type.tensorType.dimensions[1].constant.size = 20000
    state = next(nv for nv in fn.inputs if nv.name == "k_cache")
    state.type.stateType.wrappedType.tensorType.dimensions[2].constant.size = 100
    next(op for op in ops if op.type == "matmul").outputs[0].type.tensorType.dimensions[3].unknown.variadic = False
    pkg.spec_path.write_bytes(pkg.spec.SerializeToString())
    assert rules(bundle) == {"fp16", "max-dim", "state-align", "static"}
    assert main(["check", str(bundle.path)]) == 1


def test_catches_cpu_ops_squares_and_oversized_programs(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> None:
    bundle = broken_copy(coreml_bundle("none"), tmp_path / "broken")
    pkg = bundle.package("chunk_0")
    fn = pkg.spec.mlProgram.functions["decode"]
    ops = list(fn.block_specializations[fn.opset].operations)
    next(op for op in ops if op.type == "tile").type = "gather"  # a lookup that never runs on the ANE
    mul = next(op for op in ops if op.type == "mul" and op.inputs["x"].arguments[0].name)
    mul.inputs["y"].arguments[0].name = mul.inputs["x"].arguments[0].name  # x * x
    pkg.spec_path.write_bytes(pkg.spec.SerializeToString())
    findings = ane_rules.lint_bundle(bundle, max_program_bytes=100_000)
    errors = {f.rule for f in findings if f.error}
    assert errors == {"cpu-op", "weight-bytes"}
    census = next(f for f in findings if f.rule == "cpu-census")
    assert "gather x1" in census.detail and "2 CPU<->ANE switches" in census.detail
    assert any(f.rule == "fp16-overflow" and "1 squares" in f.detail for f in findings)


def test_catches_a_tensor_stored_twice(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> None:
    bundle = broken_copy(coreml_bundle("none"), tmp_path / "twice")
    shutil.rmtree(bundle.package_path("chunk_1"))
    shutil.copytree(bundle.package_path("chunk_0"), bundle.package_path("chunk_1"))  # layer 0's weights again
    assert "duplicate" in rules(bundle)


def test_per_block_weights_are_an_error_without_the_gpu(coreml_bundle: Callable[[str], Path], tmp_path: Path) -> None:
    bundle = broken_copy(coreml_bundle("int4"), tmp_path / "int4-ane")
    assert rules(bundle) == set()  # made for CPU_AND_GPU
    manifest = json.loads((bundle.path / MANIFEST).read_text())
    (bundle.path / MANIFEST).write_text(json.dumps({**manifest, "units": "CPU_AND_NE"}))
    assert rules(Bundle.open(bundle.path)) == {"granularity"}


def test_build_refuses_geometries_that_break_a_rule(coreml_tiny_dir: Path) -> None:
    config = ModelConfig.from_file(coreml_tiny_dir / "config.json")
    with pytest.raises(ConversionError, match="multiple of 32"):
        check_geometry(config, Geometry(100))
    odd = ModelConfig.from_dict({**config.raw, "hidden_size": 64, "num_attention_heads": 4})  # head dim 16
    with pytest.raises(ConversionError, match="head dimension 16"):
        check_geometry(odd, Geometry(128))
