"""The MIL ops the reference interpreter executes (`OPS`), each in numpy on fp16-stored values, and `execute`, which
runs one op and checks its results against the shapes and dtypes the program declares (coreml.interpreter loads
the program and walks its functions).

Why over ~400 lines: one small function per MIL op the conversion emits, sharing the argument reader and the
fp16-accumulation helpers; the table is one unit (tests check it equals the set of ops the conversion emits)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coreml.errors import UnsupportedOp
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.milblob import NUMPY_DTYPES

F32 = np.float32
F16 = np.float16
ACC_BLOCK = 8  # products summed in fp32 before each fp16 rounding in the fp16-accumulation mode


@dataclass(frozen=True)
class VarType:
    dtype: str  # MIL DataType name, e.g. "FLOAT16"
    shape: tuple[int, ...]


@dataclass
class Op:
    type: str
    inputs: dict[str, list[str | np.ndarray]]  # parameter -> bindings: a variable name or an inline value
    outputs: list[tuple[str, VarType]]
    name: str


class _Args:
    """Resolved inputs of one op: `a("x")` one value, `opt("x", default)`, `many("values")`."""

    def __init__(
        self, op: Op, env: dict[str, np.ndarray], state: dict[str, np.ndarray], fp16_acc: bool = False
    ) -> None:
        self.op, self.env, self.state, self.fp16_acc = op, env, state, fp16_acc

    def _get(self, b: str | np.ndarray) -> np.ndarray:
        if isinstance(b, np.ndarray):
            return b
        if b in self.env:
            return self.env[b]
        raise PackageError(f"Op {self.op.name!r} reads {b!r} before it is defined.")

    def a(self, param: str) -> np.ndarray:
        if param not in self.op.inputs:
            raise PackageError(f"Op {self.op.name!r} ({self.op.type}) lacks its input {param!r}.")
        return self._get(self.op.inputs[param][0])

    def opt(self, param: str, default: np.ndarray) -> np.ndarray:
        return self.a(param) if param in self.op.inputs else default

    def many(self, param: str) -> list[np.ndarray]:
        return [self._get(b) for b in self.op.inputs[param]]

    def name(self, param: str) -> str:
        b = self.op.inputs[param][0]
        if not isinstance(b, str):
            raise PackageError(f"Op {self.op.name!r} must name a state in {param!r}.")
        return b

    def only(self, allowed: set[str]) -> None:
        extra = set(self.op.inputs) - allowed
        if extra:
            raise UnsupportedOp(
                f"The op {self.op.type!r} is used with {sorted(extra)}, which the interpreter does not implement."
            )


def execute(
    op: Op,
    env: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
    states: dict[str, VarType] | None = None,
    fp16_acc: bool = False,
    overflows: list[str] | None = None,
) -> list[np.ndarray]:
    args = _Args(op, env, state, fp16_acc)
    results = OPS[op.type](args)
    if states is not None and op.type == "write_state":
        name = args.name("input")
        if results[0].shape != states[name].shape:
            raise PackageError(f"write_state to {name!r} has shape {results[0].shape}, not {states[name].shape}.")
        state[name] = results[0].astype(NUMPY_DTYPES[states[name].dtype])
        return []
    out = []
    for (_name, vt), value in zip(op.outputs, results, strict=True):
        value = np.asarray(value)
        if value.shape != vt.shape:
            raise PackageError(
                f"Op {op.name!r} ({op.type}) produced shape {value.shape}; the program declares {vt.shape}."
            )
        if vt.dtype == "FLOAT16" and value.dtype.kind == "f" and value.dtype != np.float16:
            with np.errstate(over="ignore"):
                stored = value.astype(np.float16)
            if overflows is not None and not np.isfinite(stored).all() and np.isfinite(value).all():
                overflows.append(f"{op.type} {op.name}")
            out.append(stored)
            continue
        out.append(value.astype(NUMPY_DTYPES[vt.dtype], copy=False))
    return out


def _f(x: np.ndarray) -> np.ndarray:
    """Float inputs are widened to fp32 for the arithmetic; integers stay as they are."""
    return x.astype(F32) if x.dtype.kind == "f" else x


def _fp16_sum(x: np.ndarray, axis: int, keepdims: bool = False) -> np.ndarray:
    """Sum along `axis` accumulating in fp16: fp32 partial sums of ACC_BLOCK terms, each added to an fp16 total."""
    x = np.moveaxis(x.astype(F32), axis, -1)
    acc = np.zeros(x.shape[:-1], F16)
    for k in range(0, x.shape[-1], ACC_BLOCK):
        acc = (acc.astype(F32) + x[..., k : k + ACC_BLOCK].sum(axis=-1).astype(F16).astype(F32)).astype(F16)
    out = acc.astype(F32)
    return np.expand_dims(out, axis) if keepdims else out


def _contract(x: np.ndarray, y: np.ndarray, spec: str, k_x: int, k_y: int, fp16_acc: bool) -> np.ndarray:
    """einsum(spec, x, y) over the shared axis (x's axis k_x, y's axis k_y), optionally accumulated in fp16."""
    if not fp16_acc:
        return np.asarray(np.einsum(spec, x, y))
    acc: np.ndarray | None = None
    for k in range(0, x.shape[k_x], ACC_BLOCK):
        part = (
            np.einsum(
                spec,
                np.take(x, range(k, min(k + ACC_BLOCK, x.shape[k_x])), axis=k_x),
                np.take(y, range(k, min(k + ACC_BLOCK, y.shape[k_y])), axis=k_y),
            )
            .astype(F16)
            .astype(F32)
        )
        acc = part if acc is None else (acc + part).astype(F16).astype(F32)
    if acc is None:  # an empty contraction axis
        return np.asarray(np.einsum(spec, x, y), F32)
    return acc


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[_Args], list[np.ndarray]]:
    def run(a: _Args) -> list[np.ndarray]:
        a.only({"x", "y"})
        return [fn(_f(a.a("x")), _f(a.a("y")))]

    return run


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[_Args], list[np.ndarray]]:
    def run(a: _Args) -> list[np.ndarray]:
        a.only({"x"})
        return [fn(_f(a.a("x")))]

    return run


def _axes(a: _Args, rank: int) -> tuple[int, ...]:
    return tuple(int(ax) % rank for ax in np.atleast_1d(a.a("axes")))


def _reduce(fn: Callable[..., np.ndarray]) -> Callable[[_Args], list[np.ndarray]]:
    def run(a: _Args) -> list[np.ndarray]:
        a.only({"x", "axes", "keep_dims"})
        x = _f(a.a("x"))
        keep = bool(a.opt("keep_dims", np.array(False)))
        axes = _axes(a, x.ndim)
        if a.fp16_acc and fn is np.mean and len(axes) == 1:
            return [_fp16_sum(x, axes[0], keepdims=keep) / x.shape[axes[0]]]
        return [fn(x, axis=axes, keepdims=keep)]

    return run


def _slices(a: _Args, shape: tuple[int, ...]) -> tuple[tuple[slice | int, ...], list[int]]:
    """The index tuple of slice_by_index / slice_update, and the axes squeezed away."""
    rank = len(shape)
    begin = np.atleast_1d(a.a("begin")).astype(np.int64)
    end = np.atleast_1d(a.a("end")).astype(np.int64)
    stride = np.atleast_1d(a.opt("stride", np.ones(rank, np.int64))).astype(np.int64)
    begin_mask = np.atleast_1d(a.opt("begin_mask", np.zeros(rank, bool))).astype(bool)
    end_mask = np.atleast_1d(a.opt("end_mask", np.zeros(rank, bool))).astype(bool)
    squeeze = np.atleast_1d(a.opt("squeeze_mask", np.zeros(rank, bool))).astype(bool)
    if np.any(stride != 1):
        raise UnsupportedOp(
            f"The op {a.op.type!r} is used with a stride other than 1, which the interpreter does not implement."
        )
    index: list[slice | int] = []
    for i, dim in enumerate(shape):
        b = 0 if begin_mask[i] else int(begin[i]) + (dim if begin[i] < 0 else 0)
        if squeeze[i]:
            if not 0 <= b < dim:
                raise PackageError(f"Op {a.op.name!r} indexes {b} on an axis of size {dim}.")
            index.append(b)
            continue
        e = dim if end_mask[i] else int(end[i]) + (dim if end[i] < 0 else 0)
        if not 0 <= b <= e <= dim:
            # Core ML's behaviour out of range is unspecified; the cascade never asks for it, so refuse.
            raise PackageError(f"Op {a.op.name!r} slices [{b}:{e}] on an axis of size {dim}.")
        index.append(slice(b, e))
    return tuple(index), [i for i in range(rank) if squeeze[i]]


def _slice_by_index(a: _Args) -> list[np.ndarray]:
    a.only({"x", "begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask"})
    x = a.a("x")
    index, _ = _slices(a, x.shape)
    return [x[index]]


def _slice_update(a: _Args) -> list[np.ndarray]:
    a.only({"x", "update", "begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask"})
    x, update = a.a("x"), a.a("update")
    index, _ = _slices(a, x.shape)
    region = x[index].shape
    if update.size != int(np.prod(region)):
        raise PackageError(f"slice_update {a.op.name!r}: update {update.shape} does not fit the region {region}.")
    out = x.copy()
    out[index] = update.reshape(region).astype(x.dtype)
    return [out]


def _conv(a: _Args) -> list[np.ndarray]:
    a.only({"x", "weight", "bias", "strides", "pad_type", "pad", "dilations", "groups"})
    x, w = _f(a.a("x")), _f(a.a("weight"))
    one_by_one = w.ndim == 4 and w.shape[2:] == (1, 1) and x.ndim == 4
    plain = (
        int(a.opt("groups", np.array(1))) == 1
        and np.all(np.asarray(a.opt("strides", np.ones(2))) == 1)
        and np.all(np.asarray(a.opt("dilations", np.ones(2))) == 1)
        and np.all(np.asarray(a.opt("pad", np.zeros(4))) == 0)
    )
    if not (one_by_one and plain):
        raise UnsupportedOp(
            "The program uses a conv other than a plain 1x1 convolution, which the interpreter does not implement."
        )
    y = _contract(w[:, :, 0, 0], x, "oi,bihw->bohw", 1, 1, a.fp16_acc)  # (B, O, H, W)
    if "bias" in a.op.inputs:
        y = y + _f(a.a("bias"))[None, :, None, None]
    return [y]


def _matmul(a: _Args) -> list[np.ndarray]:
    a.only({"x", "y", "transpose_x", "transpose_y"})
    x, y = _f(a.a("x")), _f(a.a("y"))
    if bool(a.opt("transpose_x", np.array(False))):
        x = np.swapaxes(x, -1, -2)
    if bool(a.opt("transpose_y", np.array(False))):
        y = np.swapaxes(y, -1, -2)
    if x.ndim != 4 or y.ndim != 4:
        raise UnsupportedOp("The program uses a matmul of rank other than 4, which the interpreter does not implement.")
    return [_contract(x, y, "bhmk,bhkn->bhmn", 3, 2, a.fp16_acc)]


def _softmax(a: _Args) -> list[np.ndarray]:
    a.only({"x", "axis"})
    x = _f(a.a("x"))
    axis = int(a.a("axis"))
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    if a.fp16_acc:
        e = e.astype(F16).astype(F32)
        return [e / _fp16_sum(e, axis, keepdims=True)]
    return [e / e.sum(axis=axis, keepdims=True)]


def _layer_norm(a: _Args) -> list[np.ndarray]:
    """MIL layer_norm: (x - mean) / sqrt(var + epsilon) over `axes`, then * gamma + beta."""
    a.only({"x", "axes", "gamma", "beta", "epsilon"})
    x = _f(a.a("x"))
    axes = _axes(a, x.ndim)
    if axes != (x.ndim - 1,):
        raise UnsupportedOp(
            "The program uses a layer_norm over axes other than the last, which the interpreter does not implement."
        )
    eps = F32(a.opt("epsilon", np.array(1e-5, F32)))
    if a.fp16_acc:
        n = x.shape[-1]
        mean = (_fp16_sum(x, -1, keepdims=True) / n).astype(F16).astype(F32)
        d = (x - mean).astype(F16).astype(F32)
        var = (_fp16_sum((d * d).astype(F16).astype(F32), -1, keepdims=True) / n).astype(F16).astype(F32)
    else:
        mean = x.mean(axis=-1, keepdims=True)
        d = x - mean
        var = (d * d).mean(axis=-1, keepdims=True)
    y = d / np.sqrt(var + eps)
    if "gamma" in a.op.inputs:
        y = y * _f(a.a("gamma"))
    if "beta" in a.op.inputs:
        y = y + _f(a.a("beta"))
    return [y]


def _stack(a: _Args) -> list[np.ndarray]:
    a.only({"values", "axis"})
    return [np.stack([_f(v) for v in a.many("values")], axis=int(a.a("axis")))]


def _concat(a: _Args) -> list[np.ndarray]:
    a.only({"values", "axis", "interleave"})
    if bool(a.opt("interleave", np.array(False))):
        raise UnsupportedOp("The program uses an interleaved concat, which the interpreter does not implement.")
    values = a.many("values")
    return [np.concatenate([_f(v) for v in values], axis=int(a.a("axis")))]


def _reshape(a: _Args) -> list[np.ndarray]:
    a.only({"x", "shape"})
    shape = [int(s) for s in np.atleast_1d(a.a("shape"))]
    if 0 in shape:
        raise UnsupportedOp(
            "The program uses reshape with a 0 (copy) dimension, which the interpreter does not implement."
        )
    return [a.a("x").reshape(shape)]


def _squeeze(a: _Args) -> list[np.ndarray]:
    a.only({"x", "axes"})
    x = a.a("x")
    axes = _axes(a, x.ndim) if "axes" in a.op.inputs else None
    return [np.squeeze(x, axis=axes)]


def _expand_dims(a: _Args) -> list[np.ndarray]:
    a.only({"x", "axes"})
    x = a.a("x")
    axes = tuple(int(ax) for ax in np.atleast_1d(a.a("axes")))
    return [np.expand_dims(x, axis=axes)]


def _clip(a: _Args) -> list[np.ndarray]:
    a.only({"x", "alpha", "beta"})
    return [np.minimum(np.maximum(_f(a.a("x")), _f(a.a("alpha"))), _f(a.a("beta")))]


def _with_epsilon(fn: Callable[[np.ndarray], np.ndarray], default: float) -> Callable[[_Args], list[np.ndarray]]:
    """inverse: MIL adds `epsilon` (default per the MIL spec) before the operation."""

    def run(a: _Args) -> list[np.ndarray]:
        a.only({"x", "epsilon"})
        eps = F32(a.opt("epsilon", np.array(default, F32)))
        return [fn(_f(a.a("x")) + eps)]

    return run


def _tile(a: _Args) -> list[np.ndarray]:
    a.only({"x", "reps"})
    return [np.tile(a.a("x"), [int(r) for r in np.atleast_1d(a.a("reps"))])]


def _transpose(a: _Args) -> list[np.ndarray]:
    a.only({"x", "perm"})
    return [np.transpose(a.a("x"), [int(p) for p in np.atleast_1d(a.a("perm"))])]


def _read_state(a: _Args) -> list[np.ndarray]:
    a.only({"input"})
    return [a.state[a.name("input")]]  # never mutated in place (slice_update copies), so no copy needed


def _write_state(a: _Args) -> list[np.ndarray]:
    a.only({"input", "data"})
    return [a.a("data")]  # stored into the state by _execute, which knows the state's declared type


def _block_repeat(small: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """Broadcast per-block parameters (one per block of each axis) to the full tensor shape."""
    if small.ndim != len(shape) or any(s == 0 or n % s for s, n in zip(small.shape, shape, strict=True)):
        raise PackageError(f"The {what} shape {small.shape} does not tile the weight shape {shape}.")
    out = small
    for axis, (s, n) in enumerate(zip(small.shape, shape, strict=True)):
        if s != n:
            out = np.repeat(out, n // s, axis=axis)
    return out


def _blockwise_shift_scale(a: _Args) -> list[np.ndarray]:
    """iOS18 constexpr_blockwise_shift_scale: w = scale * (data - offset), scale/offset per block."""
    a.only({"data", "scale", "offset"})
    data = a.a("data").astype(F32)
    scale = _block_repeat(_f(a.a("scale")), data.shape, "scale")
    offset = _block_repeat(a.a("offset").astype(F32), data.shape, "offset") if "offset" in a.op.inputs else 0.0
    return [scale * (data - offset)]


def _lut_to_dense(a: _Args) -> list[np.ndarray]:
    """iOS18 constexpr_lut_to_dense: lut (*blocks, palette, vector), indices -> lut[block(i), indices[i], 0]."""
    a.only({"indices", "lut", "vector_axis"})
    idx, lut = a.a("indices").astype(np.int64), a.a("lut")
    if lut.ndim != idx.ndim + 2 or lut.shape[-1] != 1:
        raise UnsupportedOp("The program uses vector palettization, which the interpreter does not implement.")
    if any(b == 0 or n % b for b, n in zip(lut.shape[:-2], idx.shape, strict=True)):
        raise PackageError(f"The LUT shape {lut.shape} does not tile the index shape {idx.shape}.")
    if idx.size and idx.max() >= lut.shape[-2]:
        raise PackageError("A palettized weight indexes past the end of its LUT.")
    # Block index of every element along each axis, broadcast against the index tensor (no full-size LUT copy).
    blocks = tuple(
        (np.arange(n) // (n // b)).reshape([-1 if i == axis else 1 for i in range(idx.ndim)])
        for axis, (b, n) in enumerate(zip(lut.shape[:-2], idx.shape, strict=True))
    )
    return [np.asarray(lut[(*blocks, idx, 0)])]


def _silu(x: np.ndarray) -> np.ndarray:
    return np.asarray(x / (1.0 + np.exp(-x)))


def _gelu(a: _Args) -> list[np.ndarray]:
    """MIL gelu: EXACT (erf) or TANH_APPROXIMATION (Gemma 3's gating, torch's approximate="tanh")."""
    a.only({"x", "mode"})
    x = _f(a.a("x"))
    mode = str(a.opt("mode", np.array("EXACT")))
    if mode == "TANH_APPROXIMATION":
        return [0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))]
    if mode == "EXACT":
        return [0.5 * x * (1.0 + np.vectorize(math.erf)(x / np.sqrt(2.0)).astype(F32))]
    raise UnsupportedOp(f"The program uses gelu in mode {mode!r}, which the interpreter does not implement.")


OPS: dict[str, Callable[[_Args], list[np.ndarray]]] = {
    "abs": _unary(np.abs),
    "add": _binary(np.add),
    "clip": _clip,
    "concat": _concat,
    "constexpr_blockwise_shift_scale": _blockwise_shift_scale,
    "constexpr_lut_to_dense": _lut_to_dense,
    "conv": _conv,
    "expand_dims": _expand_dims,
    "gelu": _gelu,
    "inverse": _with_epsilon(lambda x: 1.0 / x, 1e-4),
    "layer_norm": _layer_norm,
    "matmul": _matmul,
    "mul": _binary(np.multiply),
    "read_state": _read_state,
    "real_div": _binary(np.divide),
    "reduce_max": _reduce(np.max),
    "reduce_mean": _reduce(np.mean),
    "reshape": _reshape,
    "silu": _unary(_silu),
    "slice_by_index": _slice_by_index,
    "slice_update": _slice_update,
    "softmax": _softmax,
    "stack": _stack,
    "squeeze": _squeeze,
    "tile": _tile,
    "transpose": _transpose,
    "write_state": _write_state,
}
