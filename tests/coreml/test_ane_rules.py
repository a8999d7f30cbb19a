"""The static ANE-rules check passes our conversions and catches deliberately broken programs; the build refuses
geometries that would break a rule."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from coremltools.proto import MIL_pb2

from coreml import ane_rules
from coreml.__main__ import main
from coreml.convert import Geometry, check_geometry
from coreml.errors import ConversionError
from coreml.package import Package
from engine.config import ModelConfig


def broken_copy(src: Path, dst: Path) -> Package:
    shutil.copytree(src, dst)
    return Package.open(dst)


@pytest.mark.parametrize("quantize", ["none", "int4", "lut6"])
def test_converted_packages_follow_the_rules(quantize: str, package: Callable[[str], Path]) -> None:
    assert ane_rules.check_package(Package.open(package(quantize))) == []


def test_big_vocabulary_package_follows_the_rules(big_vocab) -> None:
    assert ane_rules.check_package(Package.open(big_vocab[1])) == []


def test_catches_fp32_oversized_misaligned_and_dynamic(package: Callable[[str], Path], tmp_path: Path) -> None:
    pkg = broken_copy(package("none"), tmp_path / "broken.mlpackage")
    fn = pkg.spec.mlProgram.functions["decode"]
    ops = list(fn.block_specializations[fn.opset].operations)
    softmax = next(op for op in ops if op.type == "softmax")
    softmax.outputs[0].type.tensorType.dataType = MIL_pb2.DataType.Value("FLOAT32")
    conv = next(op for op in ops if op.type == "conv")
    conv.outputs[0].type.tensorType.dimensions[1].constant.size = 20000
    state = next(nv for nv in fn.inputs if nv.name == "k_cache")
    state.type.stateType.wrappedType.tensorType.dimensions[2].constant.size = 100
    matmul = next(op for op in ops if op.type == "matmul")
    matmul.outputs[0].type.tensorType.dimensions[3].unknown.variadic = False
    rules = {v.rule for v in ane_rules.check_spec(pkg.spec)}
    assert rules == {"fp16", "max-dim", "state-align", "static"}
    pkg.spec_path.write_bytes(pkg.spec.SerializeToString())
    assert main(["check", str(pkg.path)]) == 1


def test_build_refuses_geometries_that_break_a_rule(tiny_dir: Path) -> None:
    config = ModelConfig.from_file(tiny_dir / "config.json")
    with pytest.raises(ConversionError, match="multiple of 32"):
        check_geometry(config, Geometry(100))
    odd = ModelConfig.from_dict({**config.raw, "hidden_size": 64, "num_attention_heads": 4})  # head dim 16
    with pytest.raises(ConversionError, match="head dimension 16"):
        check_geometry(odd, Geometry(128))
