"""`InterpreterBackend`: the engine's Backend protocol over the reference interpreter.

It drives a converted package exactly as CoreMLBackend drives Core ML (same host code, coreml.host), but executes
the program with coreml.interpreter, so the cascade, generation and sessions can run against the converted
program on any OS. Used by the parity tests and by `python -m coreml check`'s smoke run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from coreml.errors import PackageError
from coreml.host import PackageBackend
from coreml.interpreter import Interpreter
from coreml.package import Package


class InterpreterBackend(PackageBackend):
    name = "coreml-reference"

    def __init__(self, package: str | Path | Package) -> None:
        pkg = package if isinstance(package, Package) else Package.open(package)
        self._setup_host(pkg.provenance)
        missing = [f for f in self.functions if f not in pkg.function_names]
        if missing:
            raise PackageError(f"The package lacks its {missing[0]!r} function; it is incomplete.")
        self.interpreter = Interpreter(pkg)
        self.weight_bytes = pkg.weights_path.stat().st_size
        self.quantize = pkg.provenance["quantize"]
        self.states: list[dict[str, np.ndarray]] = []
        self.allocate(1, self.slots)

    @property
    def numerics(self) -> str:
        # Not Core ML's arithmetic (fp32 accumulation everywhere), so never shares L3 entries with it.
        return f"coreml-reference-fp16-{self.quantize}"

    @property
    def batch(self) -> int:
        return len(self.states)

    def allocate(self, batch: int, num_slots: int) -> None:
        if num_slots != self.slots:
            raise PackageError(f"This package was converted for {self.slots} slots, not {num_slots}; convert it again with --slots {num_slots}.")
        self.states = [self.interpreter.new_state("decode") for _ in range(batch)]

    def fork(self) -> "InterpreterBackend":
        twin = copy.copy(self)  # shares the interpreter (the loaded weights)
        twin.states = [self.interpreter.new_state("decode") for _ in range(self.batch)]
        return twin

    def _predict(self, row: int, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.interpreter.run(function, inputs, self.states[row])

    def _read_state(self, row: int, name: str) -> np.ndarray:
        return self.states[row][name]

    def _write_state(self, row: int, name: str, value: np.ndarray) -> None:
        self.states[row][name] = value.astype(np.float16)
