"""`python -m coreml check PKG`: is this package sound? Structure, provenance, ANE rules, a reference smoke run,
and on a Mac Core ML's compute plan. Each check yields a line; the package is sound only if none failed."""

from __future__ import annotations

import json
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coreml import ane_rules
from coreml.convert import INPUT_NAMES, REQUIRED_PROVENANCE, STATE_NAMES
from coreml.errors import CoreMLError
from coreml.package import Package

SMOKE_DECODE_STEPS = 3


@dataclass(frozen=True)
class CheckLine:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.detail}"


def _structure(pkg: Package) -> CheckLine:
    prov = pkg.provenance
    functions = json.loads(prov["functions"])
    missing = [f for f in functions if f not in pkg.function_names]
    if missing:
        return CheckLine("structure", False, f"function {missing[0]!r} is missing")
    shapes = set()
    for fname, fn in pkg.spec.mlProgram.functions.items():
        names = {nv.name for nv in fn.inputs}
        lacking = [n for n in (*INPUT_NAMES, *STATE_NAMES) if n not in names]
        if lacking:
            return CheckLine("structure", False, f"function {fname!r} lacks {lacking[0]!r}")
        for nv in fn.inputs:
            if nv.name in STATE_NAMES:
                shapes.add(tuple(d.constant.size for d in nv.type.stateType.wrappedType.tensorType.dimensions))
    if len(shapes) != 1:
        return CheckLine("structure", False, f"the functions declare different state shapes {sorted(shapes)}")
    if not pkg.weights_path.is_file():
        return CheckLine("structure", False, "weights/weight.bin is missing")
    return CheckLine("structure", True, f"functions {', '.join(pkg.function_names)}; state {shapes.pop()}")


def _smoke(pkg: Package) -> CheckLine:
    from coreml.reference import InterpreterBackend
    from engine.memory import FullAttentionMemory

    backend = InterpreterBackend(pkg)
    memory = FullAttentionMemory(backend)
    n = min(backend.num_slots - SMOKE_DECODE_STEPS, max(backend.functions.values()) + 9)  # every function runs
    ids = [i % backend.config.vocab_size for i in range(1, n + 1)]
    logits = backend.forward(torch.tensor([ids]), memory.plan(ids).as_batch(), last_only=True)
    for _ in range(SMOKE_DECODE_STEPS):
        token = int(logits[0, -1].argmax())
        logits = backend.forward(torch.tensor([[token]]), memory.plan([token]).as_batch(), last_only=True)
    if not np.isfinite(logits.numpy()).all():
        return CheckLine("reference run", False, "the logits are not finite")
    return CheckLine("reference run", True, f"prefill {n} tokens + {SMOKE_DECODE_STEPS} decode steps, finite logits")


def run_checks(path: str | Path) -> Iterator[CheckLine]:
    try:
        pkg = Package.open(path)
    except CoreMLError as exc:
        yield CheckLine("package", False, str(exc))
        return
    prov = pkg.provenance
    missing = [k for k in REQUIRED_PROVENANCE if k not in prov]
    if missing:
        yield CheckLine("provenance", False, f"missing {', '.join(missing)}; convert with `python -m coreml convert`")
        return
    yield CheckLine(
        "provenance", True,
        f"{prov['architecture']} {prov['fingerprint'][:12]}, {prov['slots']} slots, quantize {prov['quantize']}, "
        f"coremltools {prov['coremltools']}, torch {prov['torch']}",
    )
    line = _structure(pkg)
    yield line
    if not line.ok:
        return
    violations = ane_rules.check_package(pkg)
    yield CheckLine("ANE rules", not violations, "all hold" if not violations else f"{violations[0]} ({len(violations)} in all)")
    try:
        yield _smoke(pkg)
    except CoreMLError as exc:
        yield CheckLine("reference run", False, str(exc))
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        from coreml.runtime import compute_plan_summary

        for fname, counts in compute_plan_summary(pkg.path).items():
            yield CheckLine(f"compute plan {fname}", True, ", ".join(f"{d}: {c}" for d, c in sorted(counts.items())))
