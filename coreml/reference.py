"""`InterpreterBackend`: the engine's Backend protocol over the reference interpreter.

It drives a converted bundle exactly as CoreMLBackend drives Core ML (same host code, engine.backends.coreml.host), but executes
the programs with coreml.interpreter, so the cascade, generation and sessions can run against the converted
programs on any OS. Used by the parity tests and by `python -m coreml check`'s smoke run.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from coreml.interpreter import Interpreter
from engine.backends.coreml.bundle import HEAD, Bundle
from engine.backends.coreml.errors import PackageError
from engine.backends.coreml.host import PackageBackend


class InterpreterBackend(PackageBackend):
    name = "coreml-reference"

    def __init__(self, bundle: str | Path | Bundle, accumulate: str = "fp32") -> None:
        b = bundle if isinstance(bundle, Bundle) else Bundle.open(bundle)
        self._setup_host(b)
        self.accumulate = accumulate
        self.interpreters = {name: Interpreter(b.package(name), accumulate) for name in b.program_names}
        for name, interp in self.interpreters.items():
            missing = [f for f in self.functions if f not in interp.functions]
            if missing:
                raise PackageError(f"The program {name} lacks its {missing[0]!r} function; the bundle is incomplete.")
        self.weight_bytes = b.total_bytes()
        self.quantize = b.quantize
        self.states: list[dict[str, dict[str, np.ndarray]]] = []
        self.allocate(1, self.slots)

    @property
    def numerics(self) -> str:
        # Not Core ML's arithmetic, so never shares L3 entries with it.
        return f"coreml-reference-{self.accumulate}-fp16-{self.quantize}"

    @property
    def batch(self) -> int:
        return len(self.states)

    def _new_row(self) -> dict[str, dict[str, np.ndarray]]:
        return {c: self.interpreters[c].new_state("decode") for c in self.chunks}

    def allocate(self, batch: int, num_slots: int) -> None:
        if num_slots != self.slots:
            raise PackageError(
                f"This bundle was converted for {self.slots} slots, not {num_slots}; convert it again with --slots {num_slots}."
            )
        self.states = [self._new_row() for _ in range(batch)]

    def fork(self) -> InterpreterBackend:
        twin = copy.copy(self)  # shares the interpreters (the loaded weights)
        twin.states = [self._new_row() for _ in range(self.batch)]
        return twin

    def _predict(self, row: int, program: str, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.interpreters[program].run(function, inputs, {} if program == HEAD else self.states[row][program])

    def _read_state(self, row: int, program: str, name: str) -> np.ndarray:
        return self.states[row][program][name]

    def _write_state(self, row: int, program: str, name: str, value: np.ndarray) -> None:
        self.states[row][program][name] = value.astype(np.float16)
