"""The input embedding, looked up on the host from memory-mapped weights (a gather never runs on the ANE).

Untied models: BUNDLE/embed.bin, raw fp16 (V, C). Tied models: the LM head's pieces in head.mlpackage are the
only copy of the matrix; a row is decoded from the mapped blob as Core ML would decode it (fp16 as is, int8/int4
scaled per channel / block, a palette index looked up in its group's LUT). Only the rows asked for are touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from coremltools.proto import MIL_pb2

from engine.backends.coreml.bundle import EMBED_FILE, HEAD, Bundle
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.milblob import (
    SUB_BYTE_BITS,
    BlobFile,
    dtype_name,
    immediate_value,
    tensor_shape,
    unpack_bits,
)
from engine.backends.coreml.programs import strip_var_suffix


@dataclass
class _Source:
    """One stored tensor: a mapped view (rows on axis 0) and how to decode a row."""

    data: np.ndarray  # typed view, or packed bytes of a sub-byte type
    dtype: str
    shape: tuple[int, ...]

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """idx (n,) -> (n, *shape[1:]) decoded values."""
        per_row = int(np.prod(self.shape[1:]))
        if self.dtype in SUB_BYTE_BITS:
            bits, signed = SUB_BYTE_BITS[self.dtype]
            if per_row * bits % 8:
                raise PackageError(
                    "A packed embedding row does not end on a byte boundary; the bundle is not one MLoT Spark writes."
                )
            nbytes = per_row * bits // 8
            packed = self.data.reshape(-1)[: self.shape[0] * nbytes].reshape(self.shape[0], nbytes)
            return np.stack([unpack_bits(packed[i], bits, signed, per_row) for i in idx]).reshape(
                (len(idx), *self.shape[1:])
            )
        return np.asarray(self.data.reshape(self.shape)[idx])


class _Piece:
    """Rows [a, b) of the head matrix as the program stores them (const or constexpr op)."""

    def __init__(
        self, op: MIL_pb2.Operation, consts: dict[str, MIL_pb2.Operation], blobs: BlobFile, bundle: Bundle
    ) -> None:
        self.kind = op.type

        def value(param: str) -> MIL_pb2.Value:
            arg = op.inputs[param].arguments[0]
            if arg.WhichOneof("binding") == "value":
                return arg.value
            src = consts.get(arg.name)
            if src is None:
                raise PackageError("The LM head's weight is not a constant; the bundle is not one MLoT Spark writes.")
            return src.attributes["val"]

        def source(v: MIL_pb2.Value) -> _Source:
            tt = v.type.tensorType
            if v.WhichOneof("value") == "immediateValue":
                return _Source(immediate_value(tt, v.immediateValue.tensor), dtype_name(tt.dataType), tensor_shape(tt))
            path = bundle.package(HEAD).resolve_blob(v.blobFileValue.fileName)
            if path != blobs.path:
                raise PackageError("The LM head names a second weight file; the bundle is not one MLoT Spark writes.")
            return _Source(
                blobs.raw(int(v.blobFileValue.offset), dtype_name(tt.dataType)),
                dtype_name(tt.dataType),
                tensor_shape(tt),
            )

        if op.type == "const":
            self.main = source(op.attributes["val"])
        elif op.type == "constexpr_blockwise_shift_scale":
            if "offset" in op.inputs:
                raise PackageError(
                    "The LM head uses an asymmetric quantization; the bundle is not one MLoT Spark writes."
                )
            self.main, self.scale = source(value("data")), source(value("scale"))
        elif op.type == "constexpr_lut_to_dense":
            self.main, self.lut = source(value("indices")), source(value("lut"))
        else:
            raise PackageError(f"The LM head is stored by a {op.type!r} op, which the host embedding cannot read.")

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """idx (n,) local rows -> (n, C) fp16."""
        if self.kind == "const":
            return self.main.rows(idx).reshape(len(idx), -1).astype(np.float16)
        data = self.main.rows(idx).reshape(len(idx), -1).astype(np.float32)  # (n, C)
        c = data.shape[1]
        if self.kind == "constexpr_blockwise_shift_scale":
            scale = (
                self.scale.rows(idx * self.scale.shape[0] // self.main.shape[0])
                .reshape(len(idx), -1)
                .astype(np.float32)
            )  # (n, blocks)
            if c % scale.shape[1]:
                raise PackageError("The LM head's scales do not tile its rows.")
            return (data * np.repeat(scale, c // scale.shape[1], axis=1)).astype(np.float16)
        lut = self.lut.data.reshape(self.lut.shape)
        group = self.main.shape[0] // lut.shape[0]
        tables = lut.reshape(lut.shape[0], -1)[idx // group]  # (n, palette): grouped-channel, scalar palettes only
        if tables.shape[1] != lut.shape[-2] or data.max(initial=0) >= tables.shape[1]:
            raise PackageError("The LM head's palette does not match its indices.")
        return np.take_along_axis(tables, data.astype(np.int64), axis=1).astype(np.float16)


class HostEmbedding:
    def __init__(self, bundle: Bundle) -> None:
        c = bundle.config
        self.vocab, self.hidden = c.vocab_size, c.hidden_size
        self.pieces = list(bundle.vocab_pieces)
        self._file: np.ndarray | None = None
        self._head: list[_Piece] = []
        if not bundle.tied:
            path = bundle.path / EMBED_FILE
            expected = self.vocab * self.hidden * 2
            if not path.is_file() or path.stat().st_size != expected:
                raise PackageError(
                    f"The bundle's {EMBED_FILE} is missing or not {expected} bytes; convert the model again."
                )
            self._file = np.memmap(path, dtype=np.float16, mode="r", shape=(self.vocab, self.hidden))
            return
        pkg = bundle.package(HEAD)
        blobs = BlobFile(pkg.weights_path)
        fn = pkg.spec.mlProgram.functions.get("decode") or next(iter(pkg.spec.mlProgram.functions.values()))
        ops = list(fn.block_specializations[fn.opset].operations)
        consts = {op.outputs[0].name: op for op in ops if op.type == "const"}
        by_name = {
            strip_var_suffix(op.outputs[0].name): op
            for op in ops
            if op.type == "const" or op.type.startswith("constexpr_")
        }
        for i, (a, b) in enumerate(self.pieces):
            op = by_name.get(f"lm_head_{i}")
            if op is None:
                raise PackageError(f"The bundle's head program lacks lm_head_{i}; convert the model again.")
            piece = _Piece(op, consts, blobs, bundle)
            if piece.main.shape[0] != b - a:
                raise PackageError(f"lm_head_{i} has {piece.main.shape[0]} rows, not {b - a}.")
            self._head.append(piece)

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """ids (T,) -> (T, C) fp16."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab):
            raise ValueError(f"token id outside the vocabulary of {self.vocab}")
        if self._file is not None:
            return np.asarray(self._file[ids])
        out = np.empty((ids.size, self.hidden), np.float16)
        for (a, b), piece in zip(self.pieces, self._head, strict=True):
            sel = np.nonzero((ids >= a) & (ids < b))[0]
            if sel.size:
                out[sel] = piece.rows(ids[sel] - a)
        return out
