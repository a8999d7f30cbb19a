"""The ANE lint: static checks of a converted bundle against the Neural Engine rules MLoT Spark relies on.

The ANE does not say why it declines an op; Core ML silently runs it on the CPU or GPU. So the rules known to
matter are checked on the programs themselves, at build time (an error fails the conversion) and by
`python -m coreml check`. Errors:

- fp16:        every float tensor (inputs, outputs, states, op results, weights) is fp16; scalar op parameters
               are exempt (coremltools keeps e.g. rsqrt's epsilon in fp32; Core ML folds them at compile time).
- max-dim:     no dimension exceeds 16384 (larger tensors are not tiled by the ANE; split LM heads instead).
- state-align: a state's last two dimensions (slots, head dim) are multiples of 32.
- static:      with state, every shape is static (flexible shapes send a stateful model to the CPU).
- granularity: per-block quantization (block along the input channels) only when the compute units include
               the GPU; the ANE runs per-channel / per-tensor scales and grouped-channel LUTs.
- cpu-op:      ops that never run on the ANE (gather, integer arithmetic, casts, ...) in a CPU_AND_NE bundle.
- weight-bytes: a program's weights ≤ 1 GB.
- duplicate:   a weight tensor stored twice (within a program's weight file, or across programs).

Warnings (reported, not fatal): likely-CPU op census and the CPU<->ANE switches in program order,
last axis < 64 bytes (the ANE pads the last axis to 64 bytes), and fp16 overflow candidates (a value squared, an
exp of a value not reduced by its max).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from coremltools.proto import MIL_pb2, Model_pb2

from engine.backends.coreml.bundle import Bundle
from engine.backends.coreml.milblob import BlobFile
from engine.backends.coreml.package import Package
from engine.backends.coreml.programs import ANE_MAX_DIM, ANE_STATE_ALIGN, MAX_CHUNK_BYTES, has_gpu

FLOAT_TYPES = {"FLOAT16", "FLOAT32", "FLOAT64", "BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E5M2"}
# Ops the ANE does not execute (Core ML places them on the CPU): lookups, integer/boolean logic, casts, and
# data-dependent shapes. The census counts them per function; in a CPU_AND_NE bundle each is an error.
CPU_OPS = {
    "gather",
    "gather_nd",
    "gather_along_axis",
    "scatter",
    "scatter_nd",
    "scatter_along_axis",
    "cast",
    "select",
    "logical_and",
    "logical_or",
    "logical_not",
    "logical_xor",
    "greater",
    "greater_equal",
    "less",
    "less_equal",
    "equal",
    "not_equal",
    "non_zero",
    "argsort",
    "topk",
    "range_1d",
    "fill_like",
    "shape",
    "while_loop",
    "cond",
}
ANE_LAST_AXIS_BYTES = 64
ELEMENT_BYTES = {"FLOAT16": 2, "FLOAT32": 4, "INT32": 4, "INT8": 1, "UINT8": 1, "BOOL": 1, "INT16": 2, "UINT16": 2}


@dataclass(frozen=True)
class Finding:
    rule: str
    where: str
    detail: str
    error: bool = True

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.detail}"


Violation = Finding  # the name the build and older callers use for an error finding


def _dims(tt: MIL_pb2.TensorType) -> list[int | None]:
    return [int(d.constant.size) if d.WhichOneof("dimension") == "constant" else None for d in tt.dimensions]


def _tensor(vt: MIL_pb2.ValueType) -> MIL_pb2.TensorType | None:
    kind = vt.WhichOneof("type")
    if kind == "tensorType":
        return vt.tensorType
    if kind == "stateType" and vt.stateType.wrappedType.WhichOneof("type") == "tensorType":
        return vt.stateType.wrappedType.tensorType
    return None


def _check_value(
    where: str, vt: MIL_pb2.ValueType, has_state: bool, out: list[Finding], scalar_param: bool = False
) -> None:
    tt = _tensor(vt)
    if tt is None:
        return
    dtype = MIL_pb2.DataType.Name(tt.dataType)
    if dtype in FLOAT_TYPES and dtype != "FLOAT16" and not (scalar_param and tt.rank == 0):
        out.append(Finding("fp16", where, f"is {dtype}"))
    dims = _dims(tt)
    big = [d for d in dims if d is not None and d > ANE_MAX_DIM]
    if big:
        out.append(Finding("max-dim", where, f"has a dimension of {big[0]} > {ANE_MAX_DIM}"))
    if has_state and None in dims:
        out.append(
            Finding("static", where, f"has a shape not known statically {['?' if d is None else d for d in dims]}")
        )


def _ops(fn: MIL_pb2.Function) -> list[MIL_pb2.Operation]:
    return [op for block in fn.block_specializations.values() for op in block.operations]


def _const_shape(ops: dict[str, MIL_pb2.Operation], op: MIL_pb2.Operation, param: str) -> list[int]:
    arg = op.inputs[param].arguments[0]
    vt = arg.value.type if arg.WhichOneof("binding") == "value" else ops[arg.name].outputs[0].type
    return [d or 0 for d in _dims(vt.tensorType)]


def check_spec(spec: Model_pb2.Model, units: str = "CPU_AND_NE") -> list[Finding]:
    """Every rule that one program's spec shows on its own."""
    out: list[Finding] = []
    program = spec.mlProgram
    has_state = any(nv.type.WhichOneof("type") == "stateType" for fn in program.functions.values() for nv in fn.inputs)
    for feature in list(spec.description.input) + list(spec.description.output):
        arr = feature.type.multiArrayType
        if has_state and (arr.WhichOneof("ShapeFlexibility") is not None):
            out.append(Finding("static", feature.name, "has a flexible shape in a stateful model (runs on the CPU)"))
    for fname, fn in program.functions.items():
        for nv in fn.inputs:
            where = f"{fname}:{nv.name}"
            _check_value(where, nv.type, has_state, out)
            if nv.type.WhichOneof("type") == "stateType":
                tt = _tensor(nv.type)
                dims = _dims(tt) if tt is not None else []
                if len(dims) < 2 or any(d is None or d % ANE_STATE_ALIGN for d in dims[-2:]):
                    out.append(
                        Finding(
                            "state-align",
                            where,
                            f"state shape {dims}: the last two dimensions must be multiples of {ANE_STATE_ALIGN}",
                        )
                    )
        ops = _ops(fn)
        by_out = {o.name: op for op in ops for o in op.outputs}
        squares = exps = small = 0
        cpu: dict[str, int] = {}
        switches, on_cpu = 0, False
        for op in ops:
            for o in op.outputs:
                _check_value(f"{fname}:{o.name} ({op.type})", o.type, has_state, out, scalar_param=op.type == "const")
            if op.type == "const" or op.type.startswith("constexpr_"):
                if op.type == "constexpr_blockwise_shift_scale":
                    data, scale = _const_shape(by_out, op, "data"), _const_shape(by_out, op, "scale")
                    if len(data) > 1 and len(scale) > 1 and scale[1] not in (1, data[1]) and not has_gpu(units):
                        out.append(
                            Finding(
                                "granularity",
                                f"{fname}:{op.outputs[0].name}",
                                f"per-block quantization (blocks of {data[1] // max(scale[1], 1)}) runs only on the GPU, not with {units}",
                            )
                        )
                continue
            if op.type in CPU_OPS:
                cpu[op.type] = cpu.get(op.type, 0) + 1
                if units == "CPU_AND_NE":
                    out.append(
                        Finding(
                            "cpu-op", f"{fname}:{op.outputs[0].name}", f"{op.type} does not run on the Neural Engine"
                        )
                    )
            if (op.type in CPU_OPS) != on_cpu:
                switches += 1
                on_cpu = not on_cpu
            if op.type == "mul":
                xs = [a.name for p in ("x", "y") for a in op.inputs[p].arguments]
                squares += len(xs) == 2 and xs[0] == xs[1]
            if op.type == "exp":
                exps += 1
            for o in op.outputs:
                tt = _tensor(o.type)
                if tt is not None and tt.rank >= 2:
                    last = _dims(tt)[-1]
                    if (
                        last is not None
                        and last * ELEMENT_BYTES.get(MIL_pb2.DataType.Name(tt.dataType), 2) < ANE_LAST_AXIS_BYTES
                    ):
                        small += 1
        if cpu:
            census = ", ".join(f"{k} x{v}" for k, v in sorted(cpu.items()))
            out.append(
                Finding(
                    "cpu-census",
                    fname,
                    f"likely-CPU ops {census}; {switches} CPU<->ANE switches in program order",
                    error=False,
                )
            )
        if small:
            out.append(
                Finding(
                    "last-axis",
                    fname,
                    f"{small} values have a last axis under {ANE_LAST_AXIS_BYTES} bytes (padded by the ANE)",
                    error=False,
                )
            )
        if squares or exps:
            out.append(
                Finding(
                    "fp16-overflow",
                    fname,
                    f"{squares} squares and {exps} exps that may overflow fp16 on large activations",
                    error=False,
                )
            )
    return out


def _blob_digests(pkg: Package) -> list[tuple[str, int]]:
    """(sha256, bytes) of each weight blob the program references (each offset once), over all its functions."""
    blobs = BlobFile(pkg.weights_path) if pkg.weights_path.is_file() else None
    seen: dict[int, tuple[str, int]] = {}
    for fn in pkg.spec.mlProgram.functions.values():
        for op in _ops(fn):
            values = (
                [op.attributes["val"]]
                if op.type == "const"
                else [a.value for arg in op.inputs.values() for a in arg.arguments if a.HasField("value")]
            )
            for v in values:
                if v.HasField("blobFileValue") and blobs is not None:
                    off = int(v.blobFileValue.offset)
                    if off not in seen:
                        raw = blobs.raw(off, MIL_pb2.DataType.Name(v.type.tensorType.dataType))
                        seen[off] = (hashlib.sha256(raw.tobytes()).hexdigest(), raw.nbytes)
    return list(seen.values())


def lint_bundle(bundle: Bundle, max_program_bytes: int = MAX_CHUNK_BYTES) -> list[Finding]:
    out: list[Finding] = []
    owner: dict[str, str] = {}
    for name in bundle.program_names:
        pkg = bundle.package(name)
        out += [Finding(f.rule, f"{name}:{f.where}", f.detail, f.error) for f in check_spec(pkg.spec, bundle.units)]
        blobs = _blob_digests(pkg)
        nbytes = sum(n for _, n in blobs)
        for digest, n in blobs:
            if n < 1024:  # small constants (e.g. two equal scales) may coincide legitimately
                continue
            if digest in owner:
                where = "its own weight file" if owner[digest] == name else owner[digest]
                out.append(Finding("duplicate", name, f"a {n}-byte weight is stored twice (also in {where})"))
            owner.setdefault(digest, name)
        if nbytes > max_program_bytes:
            out.append(
                Finding(
                    "weight-bytes",
                    name,
                    f"holds {nbytes / 1e6:.1f} MB of weights, over the {max_program_bytes / 1e6:.1f} MB a Neural Engine program may hold",
                )
            )
    return out


def check_package(pkg: Package, units: str = "CPU_AND_NE") -> list[Finding]:
    """The errors of one program (the build and tests of single programs)."""
    return [f for f in check_spec(pkg.spec, units) if f.error]
