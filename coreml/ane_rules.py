"""Static checks of a converted program against the Neural Engine rules MLoT Spark relies on.

The ANE does not report why it declines an op; Core ML silently runs it on the CPU or GPU instead. So the rules
that are known to matter are checked on the program itself, at build time (convert fails) and by
`python -m coreml check`:

- fp16:        every float tensor (inputs, outputs, states, every op result and weight) is fp16; the ANE computes
               in fp16 only, and an fp32 tensor forces that part of the graph off the ANE. Scalar op parameters
               are exempt: coremltools keeps e.g. rsqrt's epsilon (1e-12, below fp16's range) in fp32, and
               Core ML folds such parameters into the op at compile time.
- max-dim:     no dimension exceeds 16384 (larger tensors are not tiled by the ANE; split LM heads instead).
- state-align: a state's last two dimensions (slots, head dim) are multiples of 32, so cache updates and reads
               tile without padding.
- static:      with state, every shape is static: flexible input shapes make a stateful model fall back to the
               CPU, and a value whose shape Core ML cannot infer statically is a dynamic op the ANE cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

from coremltools.proto import MIL_pb2, Model_pb2

from coreml.package import Package
from coreml.wrapper import ANE_MAX_DIM, ANE_STATE_ALIGN

FLOAT_TYPES = {"FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E5M2"}


@dataclass(frozen=True)
class Violation:
    rule: str  # fp16 | max-dim | state-align | static
    where: str  # function / value name
    detail: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.detail}"


def _dims(tt: MIL_pb2.TensorType) -> list[int | None]:
    return [int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None for d in tt.dimensions]


def _tensor(vt: MIL_pb2.ValueType) -> MIL_pb2.TensorType | None:
    kind = vt.WhichOneof("type")
    if kind == "tensorType":
        return vt.tensorType
    if kind == "stateType" and vt.stateType.wrappedType.WhichOneof("type") == "tensorType":
        return vt.stateType.wrappedType.tensorType
    return None


def _check_value(where: str, vt: MIL_pb2.ValueType, has_state: bool, out: list[Violation], scalar_param: bool = False) -> None:
    tt = _tensor(vt)
    if tt is None:
        return
    dtype = MIL_pb2.DataType.Name(tt.dataType)
    if dtype in FLOAT_TYPES and dtype != "FLOAT16" and not (scalar_param and tt.rank == 0):
        out.append(Violation("fp16", where, f"is {dtype}"))
    dims = _dims(tt)
    big = [d for d in dims if d is not None and d > ANE_MAX_DIM]
    if big:
        out.append(Violation("max-dim", where, f"has a dimension of {big[0]} > {ANE_MAX_DIM}"))
    if has_state and None in dims:
        out.append(Violation("static", where, f"has a shape not known statically {['?' if d is None else d for d in dims]}"))


def check_spec(spec: Model_pb2.Model) -> list[Violation]:
    out: list[Violation] = []
    program = spec.mlProgram
    has_state = any(nv.type.WhichOneof("type") == "stateType" for fn in program.functions.values() for nv in fn.inputs)
    for feature in list(spec.description.input) + list(spec.description.output):
        arr = feature.type.multiArrayType
        if has_state and (arr.WhichOneof("ShapeFlexibility") is not None):
            out.append(Violation("static", feature.name, "has a flexible shape in a stateful model (runs on the CPU)"))
    for fname, fn in program.functions.items():
        for nv in fn.inputs:
            where = f"{fname}:{nv.name}"
            _check_value(where, nv.type, has_state, out)
            if nv.type.WhichOneof("type") == "stateType":
                tt = _tensor(nv.type)
                dims = _dims(tt) if tt is not None else []
                if len(dims) < 2 or any(d is None or d % ANE_STATE_ALIGN for d in dims[-2:]):
                    out.append(Violation("state-align", where, f"state shape {dims}: the last two dimensions must be multiples of {ANE_STATE_ALIGN}"))
        for block in fn.block_specializations.values():
            for op in block.operations:
                for o in op.outputs:
                    _check_value(f"{fname}:{o.name} ({op.type})", o.type, has_state, out, scalar_param=op.type == "const")
    return out


def check_package(pkg: Package) -> list[Violation]:
    return check_spec(pkg.spec)
