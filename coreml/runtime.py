"""The macOS runtime backend: a converted package run by Core ML (on the Neural Engine by default).

Importable everywhere (the engine's registry imports it only on a Mac); everything that needs the Core ML
framework is imported inside functions. Exercised by the tests marked `mac`.

- `CoreMLBackend(model_dir)`: the package comes from the conversion cache (coreml.convert.cached_package),
  converted on first use for the slot count the memory asks for in `allocate`, then loaded once per function
  (`function_name=`), with compute units from the argument or MLOT_SPARK_COREML_UNITS (default CPU_AND_NE).
- Every row of the slot table is one MLState, shared by the package's functions (they declare identical
  states). Predictions on one backend's states are serialised by a lock: an MLState must not be used by two
  predictions at once.
- read_kv / write_kv use MLState.read_state / write_state (coremltools >= 8, macOS 15).
- A warm-up prediction per function at load, on a throwaway state, so the first user token does not pay for
  Core ML's device specialisation.
"""

from __future__ import annotations

import copy
import os
import platform
import threading
from pathlib import Path

import numpy as np

from coreml.convert import DEFAULT_SLOTS, Progress, cached_package
from coreml.errors import PackageError
from coreml.host import PackageBackend
from coreml.package import Package
from engine.backends.base import BackendProbe
from engine.model_files import read_config
from engine.errors import BackendUnavailable

UNITS_ENV = "MLOT_SPARK_COREML_UNITS"
QUANT_ENV = "MLOT_SPARK_COREML_QUANTIZE"
COMPUTE_UNITS = ("CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY", "ALL")
MIN_MACOS = (15, 0)


def probe() -> BackendProbe:
    """Available only on macOS 15+ on Apple Silicon with a coremltools that can load models."""
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return BackendProbe("coreml", False, f"Core ML needs macOS 15+ on Apple Silicon; this is {platform.system()} {platform.machine()}.")
    release = platform.mac_ver()[0]
    try:
        version = tuple(int(p) for p in release.split(".")[:2])
    except ValueError:
        version = (0, 0)
    if version < MIN_MACOS:
        return BackendProbe("coreml", False, f"Core ML stateful models need macOS 15 or later; this Mac runs {release or 'an unknown version'}.")
    try:
        import coremltools as ct
        from coremltools.models.model import MLState  # noqa: F401  (stateful prediction support)
    except ImportError as exc:
        return BackendProbe("coreml", False, f"coremltools is not importable ({exc}).")
    try:
        from coremltools import libcoremlpython  # noqa: F401  (the native bridge to Core ML)
    except ImportError:
        return BackendProbe("coreml", False, f"coremltools {ct.__version__} lacks its Core ML bridge (libcoremlpython); reinstall it.")
    return BackendProbe("coreml", True, f"Core ML via coremltools {ct.__version__} on macOS {release}")


def compute_units_name(requested: str | None) -> str:
    name = (requested or os.environ.get(UNITS_ENV) or "CPU_AND_NE").upper()
    if name not in COMPUTE_UNITS:
        raise BackendUnavailable(f"Unknown Core ML compute units {name!r}; choose one of {', '.join(COMPUTE_UNITS)}.")
    return name


class CoreMLBackend(PackageBackend):
    name = "coreml"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        compute_units: str | None = None,
        quantize: str | None = None,
        cache_dir: str | Path | None = None,
        progress: Progress | None = None,
    ) -> None:
        from engine.weights import fingerprint, read_safetensors_header, weight_files

        self.model_dir = Path(model_dir).expanduser()
        self.units = compute_units_name(compute_units)
        self.quantize = quantize or os.environ.get(QUANT_ENV) or "none"
        self.cache_dir = cache_dir
        self.progress = progress
        # Identity without loading the weights: the package is what runs.
        self.config = read_config(self.model_dir)
        files = weight_files(self.model_dir)
        tables = [read_safetensors_header(f) for f in files]
        self.fingerprint = fingerprint(self.config, files, tables)
        self.weight_bytes = sum(t.end - t.start for table in tables for t in table)
        self.slots = DEFAULT_SLOTS
        self.models: dict[str, object] = {}  # function name -> ct.models.MLModel
        self.states: list[object] = []  # one MLState per row
        self.lock = threading.Lock()
        self.package: Path | None = None

    @property
    def numerics(self) -> str:
        return f"coreml-{self.units.lower()}-fp16-{self.quantize}"

    @property
    def batch(self) -> int:
        return len(self.states) or 1

    def _load(self, slots: int) -> None:
        import coremltools as ct

        kwargs = {"progress": self.progress} if self.progress else {}
        path = cached_package(self.model_dir, slots=slots, quantize=self.quantize, cache_dir=self.cache_dir, **kwargs)
        pkg = Package.open(path)
        if pkg.provenance.get("fingerprint") != self.fingerprint:
            raise PackageError(f"The cached Core ML package {path.name} was converted from other weights; delete it and retry.")
        self._setup_host(pkg.provenance)
        units = getattr(ct.ComputeUnit, self.units)
        try:
            self.models = {f: ct.models.MLModel(str(path), compute_units=units, function_name=f) for f in self.functions}
        except Exception as exc:  # Core ML reports load failures as generic exceptions with its own text
            raise BackendUnavailable(f"Core ML could not load the converted model ({str(exc).splitlines()[0][:200]}).") from None
        self.package = path
        self.weight_bytes = pkg.weights_path.stat().st_size
        self._warm_up()

    def _warm_up(self) -> None:
        """One prediction per function on a throwaway state: Core ML specialises the program for the device."""
        state = self._new_state()
        s, d = self.slots, self.config.head_dim
        for f, t in self.functions.items():
            inputs = {
                "input_ids": np.zeros((1, t), np.int32),
                "q_cos": np.ones((1, 1, t, d), np.float16),
                "q_sin": np.zeros((1, 1, t, d), np.float16),
                "k_cos": np.ones((1, 1, s, d), np.float16),
                "k_sin": np.zeros((1, 1, s, d), np.float16),
                "mask": np.zeros((1, 1, t, s), np.float16),
                "write_start": np.zeros((1,), np.int32),
            }
            self.models[f].predict(inputs, state=state)

    def _new_state(self) -> object:
        # All functions declare the same states; a state made by one is used by all (see module doc).
        return self.models["decode"].make_state()

    def allocate(self, batch: int, num_slots: int) -> None:
        with self.lock:
            if self.package is None or num_slots != self.slots:
                self._load(num_slots)
            self.states = [self._new_state() for _ in range(batch)]

    def fork(self) -> "CoreMLBackend":
        with self.lock:
            if self.package is None:
                self._load(self.slots)
            twin = copy.copy(self)  # shares the loaded MLModels (weights)
            twin.lock = threading.Lock()
            twin.states = [self._new_state() for _ in range(self.batch)]
            return twin

    def _ensure_loaded(self) -> None:
        if not self.states:
            self.allocate(1, self.slots)

    def _predict(self, row: int, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._ensure_loaded()
        with self.lock:
            return self.models[function].predict(inputs, state=self.states[row])

    def _read_state(self, row: int, name: str) -> np.ndarray:
        self._ensure_loaded()
        with self.lock:
            return np.asarray(self.states[row].read_state(name), dtype=np.float16)

    def _write_state(self, row: int, name: str, value: np.ndarray) -> None:
        self._ensure_loaded()
        with self.lock:
            self.states[row].write_state(name, np.ascontiguousarray(value, dtype=np.float16))


def compute_plan_summary(package: str | Path, units: str = "CPU_AND_NE") -> dict[str, dict[str, int]]:
    """function -> {device: op count} from Core ML's compute plan (macOS only): which ops land on ANE/GPU/CPU."""
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    summary: dict[str, dict[str, int]] = {}
    model = ct.models.MLModel(str(package), compute_units=getattr(ct.ComputeUnit, units), function_name="decode")
    plan = MLComputePlan.load_from_path(model.get_compiled_model_path(), compute_units=getattr(ct.ComputeUnit, units))
    program = plan.model_structure.program
    if program is None:
        raise PackageError("The compute plan has no ML Program; the package is not an ML Program.")
    for fname, fn in program.functions.items():
        counts: dict[str, int] = {}
        for op in fn.block.operations:
            if op.operator_name == "const":
                continue
            usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
            device = type(usage.preferred_compute_device).__name__ if usage else "none"
            counts[device] = counts.get(device, 0) + 1
        summary[fname] = counts
    return summary
