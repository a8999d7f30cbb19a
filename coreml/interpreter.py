"""A reference interpreter for the ML Programs our conversion emits, in numpy, from the package's protobuf.

It is how the conversion is proven right off-Mac: it executes the very program Core ML would load (the
model.mlmodel spec plus weights/weight.bin), op by op, in fp16, with state. Only the ops (and op variants) that
coreml.convert emits are implemented; anything else raises `UnsupportedOp` when the function is loaded, so the
interpreter can never silently skip or approximate an op it does not know.

Numerics: every value is stored in its declared dtype (fp16 for all float tensors). By default each float op
computes in fp32 and rounds its result to fp16 (fp16 storage, wider accumulation). `accumulate="fp16"` is the
ANE-pessimistic mode: sums in conv, matmul, reductions, softmax and layer_norm are accumulated in fp16, one
rounding per ACC_BLOCK products, so the drift it shows bounds what an fp16-accumulating engine could do.
Every result is checked against the shape and dtype the spec declares for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from coremltools.proto import MIL_pb2

from coreml.errors import UnsupportedOp
from coreml.mil_ops import OPS, Op, VarType, execute
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.milblob import (
    NUMPY_DTYPES,
    BlobFile,
    dtype_name,
    immediate_value,
    tensor_shape,
)
from engine.backends.coreml.package import Package

ACCUMULATIONS = ("fp32", "fp16")


@dataclass
class Function:
    name: str
    inputs: dict[str, VarType]
    states: dict[str, VarType]
    outputs: list[str]
    ops: list[Op]
    consts: dict[str, np.ndarray]  # values of const and constexpr_* ops, computed once at load


def _var_type(vt: MIL_pb2.ValueType) -> VarType:
    kind = vt.WhichOneof("type")
    if kind == "tensorType":
        return VarType(dtype_name(vt.tensorType.dataType), tensor_shape(vt.tensorType))
    if kind == "stateType":
        inner = vt.stateType.wrappedType
        if inner.WhichOneof("type") != "tensorType":
            raise UnsupportedOp(
                "The program has a state that is not a tensor; the interpreter supports tensor states only."
            )
        return VarType(dtype_name(inner.tensorType.dataType), tensor_shape(inner.tensorType))
    raise UnsupportedOp(f"The program uses a {kind} value; the interpreter supports tensors and tensor states only.")


class Interpreter:
    """Load a package once; run any of its functions against a state dict (name -> fp16 array)."""

    def __init__(self, package: Package | str | Path, accumulate: str = "fp32") -> None:
        if accumulate not in ACCUMULATIONS:
            raise ValueError(f"accumulate must be one of {ACCUMULATIONS}")
        self.fp16_acc = accumulate == "fp16"
        self.overflows: list[str] = []  # ops whose finite result overflowed its fp16 type (e.g. x*x > 65504)
        self.package = package if isinstance(package, Package) else Package.open(package)
        self._blobs: dict[Path, BlobFile] = {}
        self._blob_cache: dict[tuple[Path, int], np.ndarray] = {}  # functions share weights: read each blob once
        self.functions: dict[str, Function] = {
            name: self._load_function(name, fn) for name, fn in self.package.spec.mlProgram.functions.items()
        }

    # ---------------------------------------------------------------- loading
    def _value(self, v: MIL_pb2.Value) -> np.ndarray:
        kind = v.WhichOneof("value")
        tt = v.type.tensorType
        if kind == "immediateValue":
            if v.immediateValue.WhichOneof("value") != "tensor":
                raise UnsupportedOp("The program has a non-tensor inline value; the interpreter supports tensors only.")
            return immediate_value(tt, v.immediateValue.tensor)
        if kind == "blobFileValue":
            path = self.package.resolve_blob(v.blobFileValue.fileName)
            key = (path, int(v.blobFileValue.offset))
            if key not in self._blob_cache:
                if path not in self._blobs:
                    self._blobs[path] = BlobFile(path)
                self._blob_cache[key] = self._blobs[path].read(key[1], dtype_name(tt.dataType), tensor_shape(tt))
            return self._blob_cache[key]
        raise PackageError("A value in the program has neither inline data nor a weight reference.")

    def _load_function(self, name: str, fn: MIL_pb2.Function) -> Function:
        block = fn.block_specializations.get(fn.opset)
        if block is None:
            raise PackageError(f"Function {name!r} has no block for its opset {fn.opset}.")
        inputs: dict[str, VarType] = {}
        states: dict[str, VarType] = {}
        for nv in fn.inputs:
            (states if nv.type.WhichOneof("type") == "stateType" else inputs)[nv.name] = _var_type(nv.type)
        ops: list[Op] = []
        consts: dict[str, np.ndarray] = {}
        for op in block.operations:
            if op.type not in OPS and op.type != "const":
                raise UnsupportedOp(
                    f"The program uses the op {op.type!r}, which the reference interpreter does not implement."
                )
            if op.blocks:
                raise UnsupportedOp(
                    f"The op {op.type!r} has nested blocks, which the reference interpreter does not implement."
                )
            outputs = [(o.name, _var_type(o.type)) for o in op.outputs]
            if op.type == "const":
                consts[outputs[0][0]] = self._value(op.attributes["val"])
                continue
            bindings: dict[str, list[str | np.ndarray]] = {}
            for param, arg in op.inputs.items():
                bindings[param] = [
                    b.name if b.WhichOneof("binding") == "name" else self._value(b.value) for b in arg.arguments
                ]
            label = (
                op.attributes["name"].immediateValue.tensor.strings.values[0] if "name" in op.attributes else op.type
            )
            parsed = Op(op.type, bindings, outputs, label)
            if op.type.startswith("constexpr_"):
                # Weights are decompressed once, exactly as Core ML materialises constexpr ops at load.
                env = dict(consts)
                (value,) = execute(parsed, env, {})
                consts[outputs[0][0]] = value
                continue
            ops.append(parsed)
        return Function(name, inputs, states, list(block.outputs), ops, consts)

    # ---------------------------------------------------------------- running
    def new_state(self, function: str | None = None) -> dict[str, np.ndarray]:
        fn = self.functions[function or next(iter(self.functions))]
        return {n: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for n, t in fn.states.items()}

    def run(self, function: str, inputs: dict[str, np.ndarray], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute `function`; `state` is updated in place (its entries are replaced, never mutated)."""
        fn = self.functions.get(function)
        if fn is None:
            raise PackageError(f"The package has no function {function!r} (it has {', '.join(self.functions)}).")
        env: dict[str, np.ndarray] = dict(fn.consts)
        for n, t in fn.inputs.items():
            if n not in inputs:
                raise PackageError(f"Function {function!r} needs the input {n!r}.")
            v = np.asarray(inputs[n])
            if v.shape != t.shape:
                raise PackageError(f"Input {n!r} of {function!r} has shape {v.shape}, the program expects {t.shape}.")
            env[n] = v.astype(NUMPY_DTYPES[t.dtype], copy=False)
        for n, t in fn.states.items():
            if n not in state or state[n].shape != t.shape:
                raise PackageError(f"State {n!r} is missing or not shaped {t.shape}.")
        # The device propagates inf/NaN silently; the interpreter records fp16 overflows itself (self.overflows), so
        # numpy's warnings about what follows one (inf * 0) say nothing more.
        with np.errstate(over="ignore", invalid="ignore"):
            for op in fn.ops:
                results = execute(op, env, state, fn.states, self.fp16_acc, self.overflows)
                for (name, _), value in zip(op.outputs, results, strict=True):
                    env[name] = value
        return {n: env[n] for n in fn.outputs}
