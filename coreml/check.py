"""`python -m coreml check BUNDLE`: is this converted model sound? Manifest, structure, the ANE lint, a reference
smoke run, and on a Mac Core ML's compute plan. Each check yields a line; the bundle is sound only if none failed
(lint warnings are printed but do not fail)."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coreml import ane_rules
from coreml.convert import chunk_inputs, expected_bytes
from engine.backends.coreml.bundle import HEAD, Bundle
from engine.backends.coreml.errors import CoreMLError
from engine.backends.coreml.programs import STATE_NAMES

SMOKE_DECODE_STEPS = 3
SIZE_TOLERANCE = 1.05  # a bundle may exceed its weights' bytes at its compression by at most 5 %


@dataclass(frozen=True)
class CheckLine:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def _structure(bundle: Bundle) -> CheckLine:
    shapes = set()
    for name in bundle.program_names:
        pkg = bundle.package(name)
        missing = [f for f in bundle.functions if f not in pkg.function_names]
        if missing:
            return CheckLine("structure", False, f"{name} lacks the function {missing[0]!r}")
        if not pkg.weights_path.is_file():
            return CheckLine("structure", False, f"{name} lacks weights/weight.bin")
        needed = ("hidden",) if name == HEAD else (*chunk_inputs(bundle.config), *STATE_NAMES)
        for fname, fn in pkg.spec.mlProgram.functions.items():
            names = {nv.name for nv in fn.inputs}
            lacking = [n for n in needed if n not in names]
            if lacking:
                return CheckLine("structure", False, f"{name}:{fname} lacks {lacking[0]!r}")
            for nv in fn.inputs:
                if nv.name in STATE_NAMES:
                    shapes.add(
                        (name, tuple(d.constant.size for d in nv.type.stateType.wrappedType.tensorType.dimensions))
                    )
    per_program = {n for n, _ in shapes}
    if len(shapes) != len(per_program):
        return CheckLine("structure", False, "a chunk's functions declare different state shapes")
    return CheckLine(
        "structure",
        True,
        f"{len(bundle.chunks)} layer chunk(s) {list(bundle.chunks)} + head; functions {', '.join(bundle.functions)}",
    )


def _size(bundle: Bundle) -> CheckLine:
    """Weight files against the weights' bytes at the bundle's compression (each tensor once, no padding); the
    whole bundle (program specs included) is reported beside it."""
    weights, want = bundle.weight_bytes(), expected_bytes(bundle.config, bundle.quantize)
    ratio = weights / want
    return CheckLine(
        "size",
        ratio <= SIZE_TOLERANCE,
        f"weights {weights / 1e6:.2f} MB = {ratio:.3f} x the {want / 1e6:.2f} MB expected at {bundle.quantize}; "
        f"bundle {bundle.total_bytes() / 1e6:.2f} MB",
    )


def _smoke(bundle: Bundle) -> CheckLine:
    from coreml.reference import InterpreterBackend
    from engine.memory.base import FullAttentionMemory

    backend = InterpreterBackend(bundle)
    memory = FullAttentionMemory(backend)
    n = min(backend.num_slots - SMOKE_DECODE_STEPS, max(backend.functions.values()) + 9)  # every function runs
    ids = [i % backend.config.vocab_size for i in range(1, n + 1)]
    logits = backend.forward(torch.tensor([ids]), memory.plan(ids).as_batch(), last_only=True)
    memory.after_forward()
    for _ in range(SMOKE_DECODE_STEPS):
        token = int(logits[0, -1].argmax())
        logits = backend.forward(torch.tensor([[token]]), memory.plan([token]).as_batch(), last_only=True)
        memory.after_forward()
    if not np.isfinite(logits.numpy()).all():
        return CheckLine("reference run", False, "the logits are not finite")
    overflows = [o for interp in backend.interpreters.values() for o in interp.overflows]
    if overflows:
        return CheckLine("reference run", False, f"{len(overflows)} fp16 overflow(s), first in {overflows[0]}")
    return CheckLine(
        "reference run",
        True,
        f"prefill {n} tokens + {SMOKE_DECODE_STEPS} decode steps, finite logits, no fp16 overflow",
    )


def run_checks(path: str | Path, smoke: bool = True) -> Iterator[CheckLine]:
    try:
        bundle = Bundle.open(path)
    except CoreMLError as exc:
        yield CheckLine("bundle", False, str(exc))
        return
    prov = bundle.provenance
    yield CheckLine(
        "provenance",
        True,
        f"{prov['architecture']} {str(prov['fingerprint'])[:12]}, {bundle.slots} slots, quantize {bundle.quantize}, units {bundle.units}, "
        f"coremltools {prov['coremltools']}, torch {prov['torch']}",
    )
    try:
        line = _structure(bundle)
    except CoreMLError as exc:
        line = CheckLine("structure", False, str(exc))
    yield line
    if not line.ok:
        return
    yield _size(bundle)
    findings = ane_rules.lint_bundle(bundle)
    errors = [f for f in findings if f.error]
    yield CheckLine(
        "ANE lint", not errors, "no errors" if not errors else f"{errors[0]} ({len(errors)} error(s) in all)"
    )
    for f in findings:
        if not f.error:
            yield CheckLine("ANE lint warning", True, str(f))
    if smoke:
        try:
            yield _smoke(bundle)
        except CoreMLError as exc:
            yield CheckLine("reference run", False, str(exc))
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        from engine.backends.coreml.runtime import compute_plan_share

        for where, share in compute_plan_share(bundle.path, bundle.units).items():
            yield CheckLine(f"compute plan {where}", True, ", ".join(f"{d}: {s:.1%}" for d, s in sorted(share.items())))
