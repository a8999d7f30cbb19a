"""A stand-in for coremltools' Core ML bridge that enforces its rules, so the runtime backend's host code runs
on Linux and the class of bug "works in the interpreter, fails in the bridge" fails here too.

Rules enforced (coremltools 9, macOS 15):
- `MLState.write_state(name, value)` converts only numpy int32 / int8 / float32 / float64 arrays (it casts
  nothing: an fp16 array is refused), of the state's exact shape; the state itself is fp16.
- `MLState.read_state(name)` returns a new array (here float32, so a caller that relies on fp16 fails).
- `predict(data, state=...)` takes fp16 / fp32 / int32 inputs of the declared shapes; a stateful function needs a
  state made by a function of the same program.
"""

from __future__ import annotations

import threading

import numpy as np

from coreml.interpreter import Interpreter
from engine.backends.coreml.bundle import Bundle
from engine.backends.coreml.runtime import BRIDGE_STATE_DTYPES


class BridgeError(RuntimeError):
    pass


class FakeMLState:
    def __init__(self, program: str, values: dict[str, np.ndarray]) -> None:
        self.program = program
        self.values = values  # name -> fp16, as Core ML keeps the state

    def read_state(self, name: str) -> np.ndarray:
        if name not in self.values:
            raise BridgeError(f"no state named {name}")
        return self.values[name].astype(np.float32)

    def write_state(self, name: str, value: np.ndarray) -> None:
        if name not in self.values:
            raise BridgeError(f"no state named {name}")
        if not isinstance(value, np.ndarray) or value.dtype not in BRIDGE_STATE_DTYPES:
            raise BridgeError(
                f"write_state converts int32, int8, float32 and float64 arrays only, not {getattr(value, 'dtype', type(value))}"
            )
        if value.shape != self.values[name].shape:
            raise BridgeError(f"write_state of shape {value.shape} into a state of shape {self.values[name].shape}")
        self.values[name] = value.astype(np.float16)


class FakeProgram:
    def __init__(self, interpreter: Interpreter, program: str, function: str) -> None:
        self.interpreter, self.program, self.function = interpreter, program, function
        self.calls = 0

    def make_state(self) -> FakeMLState:
        return FakeMLState(self.program, self.interpreter.new_state(self.function))

    def predict(self, data: dict[str, np.ndarray], state: FakeMLState | None = None) -> dict[str, np.ndarray]:
        fn = self.interpreter.functions[self.function]
        for name, value in data.items():
            if value.dtype not in (np.float16, np.float32, np.int32):
                raise BridgeError(f"input {name} has dtype {value.dtype}")
        if fn.states and (state is None or state.program != self.program):
            raise BridgeError("a stateful function needs a state made by its own program")
        self.calls += 1
        return self.interpreter.run(self.function, data, state.values if state is not None else {})


class FakeLoader:
    """loader(bundle, program, function, units) -> FakeProgram; one interpreter per program (shared weights)."""

    def __init__(self) -> None:
        self.interpreters: dict[str, Interpreter] = {}
        self.loaded: list[tuple[str, str, str]] = []

    def __call__(self, bundle: Bundle, program: str, function: str, units: str) -> FakeProgram:
        if program not in self.interpreters:
            self.interpreters[program] = Interpreter(bundle.package(program))
        self.loaded.append((program, function, units))
        return FakeProgram(self.interpreters[program], program, function)


class HangingLoader(FakeLoader):
    """A runtime that never answers (Core ML's `CPU_AND_NE` deadlock of the Neural Engine daemon): loads, or
    predictions once `hang_predict` is set, block until `release` is set (the test sets it when it is done, so no
    thread outlives it)."""

    def __init__(self, hang_load: bool = True) -> None:
        super().__init__()
        self.hang_load = hang_load
        self.hang_predict = False
        self.release = threading.Event()

    def __call__(self, bundle: Bundle, program: str, function: str, units: str) -> FakeProgram:
        if self.hang_load:
            self.release.wait()
        program_ = super().__call__(bundle, program, function, units)
        real = program_.predict

        def predict(data: dict[str, np.ndarray], state: FakeMLState | None = None) -> dict[str, np.ndarray]:
            if self.hang_predict:
                self.release.wait()
            return real(data, state)

        program_.predict = predict  # type: ignore[method-assign]
        return program_
