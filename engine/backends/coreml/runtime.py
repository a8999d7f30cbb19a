"""The macOS runtime backend: a converted bundle run by Core ML (on the Neural Engine by default).

Importable everywhere (the engine's registry imports it only on a Mac); everything that needs the Core ML
framework is imported inside functions. Exercised by the tests marked `mac`, and off-Mac through a fake loader
that enforces the coremltools bridge's rules (tests/helpers/fake_coreml.py).

- The bundle comes from the app (shipped, compiled, by `make app`) or the conversion cache (engine.backends.coreml.
  cache), for the slot count the memory asks for. The runtime converts nothing itself: the converter (`coreml/`)
  sits above the engine, so a caller that may use it passes it in (`convert`); without one a missing bundle is
  refused in one sentence naming `python -m coreml convert`, and `auto` moves on to the next backend.
- Each program is compiled once to `<name>.mlmodelc` beside its package and loaded with `CompiledMLModel`
  once per function (no recompilation per function or per launch).
- Each row of the slot table holds one MLState per layer chunk, shared by the chunk's functions (they declare
  identical states). Predictions on one backend's states are serialised by a lock.
- read_kv / write_kv use MLState.read_state / write_state. The bridge converts only int32, int8, float32 and
  float64 arrays (write_state casts nothing; only predict() casts fp16 inputs), so KV crosses it as float32:
  exact for fp16 values.
"""

from __future__ import annotations

import copy
import os
import platform
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.backends.base import BackendProbe
from engine.backends.coreml.bundle import HEAD, Bundle
from engine.backends.coreml.cache import Geometry, cache_key, cached, default_cache_root
from engine.backends.coreml.errors import CoreMLError, PackageError
from engine.backends.coreml.host import PackageBackend
from engine.backends.coreml.programs import ANE_MAX_SLOTS, COMPUTE_UNITS, DEFAULT_UNITS, resolve
from engine.backends.coreml.vision_runtime import (
    EncoderConverter,
    EncoderLoader,
    ProgramTower,
    core_ml_encoder_loader,
    encoder_tower,
)
from engine.backends.coreml.watchdog import Watchdog
from engine.errors import BackendUnavailable
from engine.fileio import atomic_dir
from engine.loading.model_files import read_config
from engine.vision.siglip import Tower

UNITS_ENV = "MLOT_SPARK_COREML_UNITS"
QUANT_ENV = "MLOT_SPARK_COREML_QUANTIZE"
MIN_MACOS = (15, 0)
# dtypes coremltools' MLState.write_state accepts (its bridge converts these numpy types only)
BRIDGE_STATE_DTYPES = (np.dtype(np.int32), np.dtype(np.int8), np.dtype(np.float32), np.dtype(np.float64))


def probe() -> BackendProbe:
    """Available only on macOS 15+ on Apple Silicon with a coremltools that can load models."""
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return BackendProbe(
            "coreml",
            False,
            f"Core ML needs macOS 15+ on Apple Silicon; this is {platform.system()} {platform.machine()}.",
        )
    release = platform.mac_ver()[0]
    try:
        version = tuple(int(p) for p in release.split(".")[:2])
    except ValueError:
        version = (0, 0)
    if version < MIN_MACOS:
        return BackendProbe(
            "coreml",
            False,
            f"Core ML stateful models need macOS 15 or later; this Mac runs {release or 'an unknown version'}.",
        )
    try:
        import coremltools as ct
        from coremltools.models.model import MLState  # noqa: F401  (stateful prediction support)
    except ImportError as exc:
        return BackendProbe("coreml", False, f"coremltools is not importable ({exc}).")
    try:
        from coremltools import libcoremlpython  # noqa: F401  (the native bridge to Core ML)
    except ImportError:
        return BackendProbe(
            "coreml", False, f"coremltools {ct.__version__} lacks its Core ML bridge (libcoremlpython); reinstall it."
        )
    return BackendProbe("coreml", True, f"Core ML via coremltools {ct.__version__} on macOS {release}")


def compute_units_name(requested: str | None) -> str:
    name = (requested or os.environ.get(UNITS_ENV) or DEFAULT_UNITS).upper()
    if name not in COMPUTE_UNITS:
        raise BackendUnavailable(f"Unknown Core ML compute units {name!r}; choose one of {', '.join(COMPUTE_UNITS)}.")
    return name


class State(Protocol):
    """One program's KV state for one row, as coremltools' MLState exposes it."""

    def read_state(self, name: str) -> np.ndarray: ...

    def write_state(self, name: str, value: np.ndarray) -> None: ...


class Program(Protocol):
    """One function of one compiled program, as coremltools' CompiledMLModel exposes it."""

    def predict(self, data: dict[str, np.ndarray], state: State | None = None) -> dict[str, np.ndarray]: ...

    def make_state(self) -> State: ...


Loader = Callable[[Bundle, str, str, str], Program]  # (bundle, program, function, compute units) -> Program


class Converter(Protocol):
    """Makes the bundle for a model into the conversion cache and returns its path (coreml.convert.cached_bundle)."""

    def __call__(self, model_dir: Path, *, slots: int, quantize: str, units: str, cache_dir: Path | None) -> Path: ...


def compile_program(bundle: Bundle, name: str) -> Path:
    """`<name>.mlmodelc` beside the package, compiled once (atomically: a half-written one is never found)."""
    import coremltools as ct

    compiled = bundle.compiled_path(name)
    if compiled.is_dir():
        return compiled
    made = Path(ct.models.utils.compile_model(str(bundle.package_path(name))))
    try:
        with atomic_dir(compiled) as tmp:  # durable like every file we write; another process's equal copy is replaced
            shutil.move(str(made), tmp)
    finally:
        shutil.rmtree(made, ignore_errors=True)
    return compiled


def core_ml_loader(bundle: Bundle, name: str, function: str, units: str) -> Program:
    import coremltools as ct

    try:
        program: Program = ct.models.CompiledMLModel(
            str(compile_program(bundle, name)), getattr(ct.ComputeUnit, units), function_name=function
        )
    except Exception as exc:
        raise BackendUnavailable(
            f"Core ML could not load the converted model ({str(exc).splitlines()[0][:200]})."
        ) from None
    return program


def shipped_root() -> Path:
    """Where `make app` puts the default model's compiled bundle inside the app."""
    from engine.paths import resources_dir

    return resources_dir() / "coreml"


class CoreMLBackend(PackageBackend):
    name = "coreml"
    max_slots = ANE_MAX_SLOTS  # the cascade fits to the slot count `make app` converts for (programs)

    def __init__(
        self,
        model_dir: str | Path,
        *,
        compute_units: str | None = None,
        quantize: str | None = None,
        cache_dir: str | Path | None = None,
        convert: Converter | None = None,
        loader: Loader = core_ml_loader,
        watchdog: Watchdog | None = None,
        convert_encoder: EncoderConverter | None = None,
        encoder_loader: EncoderLoader = core_ml_encoder_loader,
    ) -> None:
        from engine.loading.weights import model_fingerprint, stored_weight_bytes

        self.model_dir = Path(model_dir).expanduser()
        self.units = compute_units_name(compute_units)
        try:
            self.quantize = resolve(quantize or os.environ.get(QUANT_ENV), self.units)
        except CoreMLError as exc:
            raise BackendUnavailable(str(exc)) from None
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.convert = convert
        self.loader = loader
        self.convert_encoder = convert_encoder  # coreml.vision.convert_encoder, from a caller that may convert
        self.encoder_loader = encoder_loader
        self.tower_numerics = ""  # where pictures are encoded: their rows' bits, so the persistent cache's key
        self.watchdog = watchdog or Watchdog()  # loads and predictions that never return are abandoned
        self._plan: dict[str, dict[str, float]] | None = None
        # Identity without loading the weights: the bundle is what runs.
        self.config = read_config(self.model_dir)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.weight_bytes = stored_weight_bytes(self.model_dir)
        self.slots = 0
        self.programs: dict[tuple[str, str], Program] = {}  # (program, function) -> loaded function
        self.states: list[dict[str, State]] = []  # per row: chunk -> MLState
        self.lock = threading.Lock()
        self.path: Path | None = None

    @property
    def numerics(self) -> str:
        return f"coreml-{self.units.lower()}-fp16-{self.quantize}{self.tower_numerics}"

    @property
    def batch(self) -> int:
        return len(self.states) or 1

    def _find(self, slots: int) -> Path:
        key = cache_key(self.fingerprint, Geometry(slots), self.quantize, self.units)
        for path in (shipped_root() / key, (self.cache_dir or default_cache_root()) / key):
            if cached(path):
                return path
        if self.convert is None:
            raise BackendUnavailable(
                f"This model has no Core ML conversion for {slots} slots yet; "
                f"`python -m coreml convert --model {self.model_dir} --slots {slots}` makes one."
            )
        return self.convert(
            self.model_dir, slots=slots, quantize=self.quantize, units=self.units, cache_dir=self.cache_dir
        )

    def _load(self, slots: int) -> None:
        path = self._find(slots)
        bundle = Bundle.open(path)
        if bundle.provenance.get("fingerprint") != self.fingerprint:
            raise PackageError(f"The Core ML bundle {path.name} was converted from other weights; delete it and retry.")
        self._setup_host(bundle)
        load = self.loader
        self.programs = {
            (p, f): self.watchdog.load(lambda p=p, f=f: load(bundle, p, f, self.units))  # type: ignore[misc]
            for p in bundle.program_names
            for f in self.functions
        }
        self.path = path
        self.weight_bytes = bundle.total_bytes()

    def picture_tower(self, tower: Tower) -> tuple[Tower, str]:
        """SmolVLM / Idefics3's tower as its Core ML encoder program, found (or converted, given `convert_encoder`)
        beside the text model's bundles; else the PyTorch tower on the CPU (vision_runtime)."""
        placed, line = encoder_tower(
            tower,
            fingerprint=self.fingerprint,
            units=self.units,
            roots=(shipped_root(), self.cache_dir or default_cache_root()),
            loader=self.encoder_loader,
            watchdog=self.watchdog,
            convert=self.convert_encoder,
        )
        self.tower_numerics = "-vision-program" if isinstance(placed, ProgramTower) else "-vision-torch"
        return placed, line

    def _new_row(self) -> dict[str, State]:
        # All functions of a chunk declare the same states; a state made by one is used by all (see module doc).
        return {c: self.watchdog.predict(self.programs[(c, "decode")].make_state) for c in self.chunks}

    def allocate(self, batch: int, num_slots: int) -> None:
        with self.lock:
            if self.path is None or num_slots != self.slots:
                self._load(num_slots)
            self.states = [self._new_row() for _ in range(batch)]

    def fork(self) -> CoreMLBackend:
        if self.path is None:
            raise BackendUnavailable("The Core ML backend must be allocated before it is forked.")
        with self.lock:
            twin = copy.copy(self)  # shares the loaded programs (weights)
            twin.lock = threading.Lock()
            twin.watchdog = self.watchdog.fork()
            twin.states = [self._new_row() for _ in range(self.batch)]
            return twin

    def _require_states(self) -> None:
        if not self.states:
            raise BackendUnavailable("The Core ML backend has no slot table yet; allocate it first.")

    def _predict(self, row: int, program: str, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._require_states()
        fn = self.programs[(program, function)]
        with self.lock:
            if program == HEAD:
                return self.watchdog.predict(lambda: fn.predict(inputs))
            state = self.states[row][program]
            return self.watchdog.predict(lambda: fn.predict(inputs, state=state))

    def _read_state(self, row: int, program: str, name: str) -> np.ndarray:
        self._require_states()
        state = self.states[row][program]
        with self.lock:
            return np.asarray(self.watchdog.predict(lambda: state.read_state(name))).astype(np.float16)

    def _write_state(self, row: int, program: str, name: str, value: np.ndarray) -> None:
        self._require_states()
        wide = np.ascontiguousarray(value, dtype=np.float32)  # the bridge takes float32, not float16; exact
        state = self.states[row][program]
        with self.lock:
            self.watchdog.predict(lambda: state.write_state(name, wide))

    def compute_devices(self) -> dict[str, dict[str, float]] | None:
        """program:function -> {compute device: share of the estimated cost}, from the compute plan Core ML made
        for the loaded bundle (which units really run it: `ALL` has been seen to leave the Neural Engine idle);
        None where the OS gives no compute plan (before macOS 14.4) or nothing is loaded yet. Read once."""
        if self._plan is None and self.path is not None:
            try:
                self._plan = compute_plan_share(self.path, self.units)
            except (ImportError, AttributeError, OSError, PackageError):
                return None
        return self._plan


def compute_plan_share(bundle_path: str | Path, units: str = "CPU_AND_NE") -> dict[str, dict[str, float]]:
    """program:function -> {device: share of the estimated cost} from Core ML's compute plan (macOS only)."""
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    bundle = Bundle.open(bundle_path)
    out: dict[str, dict[str, float]] = {}
    for name in bundle.program_names:
        plan = MLComputePlan.load_from_path(
            str(compile_program(bundle, name)), compute_units=getattr(ct.ComputeUnit, units)
        )
        program = plan.model_structure.program
        if program is None:
            raise PackageError("The compute plan has no ML Program; the bundle is not made of ML Programs.")
        for fname, fn in program.functions.items():
            cost: dict[str, float] = {}
            for op in fn.block.operations:
                if op.operator_name == "const" or op.operator_name.startswith("constexpr_"):
                    continue
                usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
                device = type(usage.preferred_compute_device).__name__ if usage else "none"
                estimate = plan.get_estimated_cost_for_mlprogram_operation(op)
                cost[device] = cost.get(device, 0.0) + (estimate.weight if estimate else 0.0)
            total = sum(cost.values()) or 1.0
            out[f"{name}:{fname}"] = {d: c / total for d, c in cost.items()}
    return out
