"""Backend registry: explicit names, `auto` order coreml -> mlx -> mps -> cuda -> cpu, with the reason each was skipped."""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.backends.base import Backend, BackendProbe
from engine.backends.memo import BackendMemo
from engine.errors import BackendUnavailable
from engine.model.kv_types import KVType
from engine.paths import default_cache_dir

# Why this order: Core ML first where a conversion exists (the Neural Engine); then MLX, which on a Mac holds GGUF's
# Q4/Q8 blocks quantized on the GPU where MPS dequantizes every block weight to fp16 (a 4B model: 8 GB) and launches
# a kernel per operation. MLX's Mac figures are not measured yet (`bench decode --backend mlx --json` on a Mac):
# mlx stays behind coreml until they are. Off a Mac MLX runs on the CPU, a correctness path (CI), so there it comes
# after the CPU backend, whose native kernels are the fast path.
AUTO_ORDER: tuple[str, ...] = (
    ("coreml", "mlx", "mps", "cuda", "cpu")
    if platform.system() == "Darwin"
    else ("coreml", "mps", "cuda", "cpu", "mlx")
)

# Weight storage: "none" runs the backend's own precision; q8_0, q4_0, q4_1 are GGUF block formats on the CPU
# (engine.model.quant); int8 a Core ML conversion. "auto" picks per backend: on the CPU a GGUF's blocks as stored, an HF
# folder's weights as Q8_0 (the backend resolves it, knowing what the file stores).
QUANTIZE_CHOICES: tuple[str, ...] = ("auto", "none", "q8_0", "q5_0", "q4_0", "q4_1", "int8")
AUTO_QUANTIZE: dict[str, str] = {"cpu": "auto", "mlx": "auto"}


def resolve_quantize(backend: str, quantize: str) -> str:
    """The weight storage `backend` runs for a requested `quantize` (resolves "auto")."""
    return AUTO_QUANTIZE.get(backend, "none") if quantize == "auto" else quantize


def _probe_coreml() -> BackendProbe:
    # The Core ML runtime (engine.backends.coreml) is imported only here and only on a Mac: it imports coremltools.
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        return BackendProbe(
            "coreml",
            False,
            f"Core ML needs macOS 15+ on Apple Silicon; this is {platform.system()} {platform.machine()}.",
        )
    try:
        from engine.backends.coreml.runtime import probe
    except ImportError as exc:
        return BackendProbe("coreml", False, f"The Core ML runtime could not be imported ({exc}).")
    return probe()


def _probe_torch(name: str) -> Callable[[], BackendProbe]:
    def probe() -> BackendProbe:
        from engine.backends.torch_backend import probe_torch_device

        return probe_torch_device(name)

    return probe


def _probe_mlx() -> BackendProbe:
    from engine.backends.mlx import probe_mlx

    return probe_mlx()


def _open_mlx(model_dir: Path, quantize: str, on_hang: Callable[[str], None]) -> Backend:
    from engine.backends.mlx.backend import MLXBackend

    return MLXBackend(model_dir, quantize=quantize)


def _open_coreml(model_dir: Path, quantize: str, on_hang: Callable[[str], None]) -> Backend:
    from engine.backends.coreml.runtime import CoreMLBackend
    from engine.backends.coreml.watchdog import Health, Watchdog

    backend = CoreMLBackend(
        model_dir, quantize=None if quantize == "none" else quantize, watchdog=Watchdog(Health(on_hang=on_hang))
    )
    # Loaded now, under the watchdog, so a load that never returns falls back here rather than hanging the first
    # reply; the cascade asks for this slot count (the one `make app` converts for).
    backend.allocate(1, backend.max_slots)
    return backend


def _open_torch(name: str) -> Callable[[Path, str, Callable[[str], None]], Backend]:
    def open_(model_dir: Path, quantize: str, on_hang: Callable[[str], None]) -> Backend:
        from engine.backends.torch_backend import TorchBackend

        return TorchBackend(model_dir, device=name, quantize=quantize)

    return open_


@dataclass(frozen=True)
class BackendEntry:
    probe: Callable[[], BackendProbe]
    # (model folder, weight quantization, what to call when the runtime hangs) -> loaded backend
    open: Callable[[Path, str, Callable[[str], None]], Backend]


REGISTRY: dict[str, BackendEntry] = {
    "coreml": BackendEntry(_probe_coreml, _open_coreml),
    "mlx": BackendEntry(_probe_mlx, _open_mlx),
    "mps": BackendEntry(_probe_torch("mps"), _open_torch("mps")),
    "cuda": BackendEntry(_probe_torch("cuda"), _open_torch("cuda")),
    "cpu": BackendEntry(_probe_torch("cpu"), _open_torch("cpu")),
}


def probe_all() -> dict[str, BackendProbe]:
    return {name: entry.probe() for name, entry in REGISTRY.items()}


@dataclass(frozen=True)
class BackendChoice:
    backend: Backend
    skipped: tuple[BackendProbe, ...]  # earlier backends `auto` passed over, each with its reason

    def explain(self) -> str:
        why = "; ".join(f"{p.name}: {p.reason.rstrip('.')}" for p in self.skipped)
        quantize, note = self.backend.quantize, self.backend.kernels_note
        weights = f", {quantize} weights" if quantize != "none" else ""
        weights += f", {note}" if note else ""
        return f"{self.backend.name}{weights}" + (f" (skipped {why})" if why else "")


def open_backend(
    model_dir: str | Path,
    name: str = "auto",
    quantize: str = "none",
    memo: BackendMemo | None = None,
    registry: Mapping[str, BackendEntry] = REGISTRY,
    kv_type: KVType = KVType.F16,
    passed_over: Mapping[str, str] | None = None,
) -> BackendChoice:
    """Open `name`, or with `auto` the first backend in AUTO_ORDER that probes available and loads.

    `quantize` (QUANTIZE_CHOICES; "int8" runs on Core ML and the CPU) picks the weight storage; a backend that
    cannot run it says so, and the `auto` backend passes over it with that reason. A runtime that hangs (Core ML's
    watchdog, coreml.watchdog) is remembered in `memo` (by default in the app's cache dir) for this model, and
    `auto` passes over it at the next load with the remembered reason. `kv_type` (engine.model.kv_types): what
    the slot table holds keys and values in; a backend that holds only fp16 is passed over by `auto` for q8_0.
    `passed_over`: backends `auto` skips for this model, each with its reason (a model that sees images runs its
    pictures on the PyTorch backends only)."""
    model_dir = Path(model_dir).expanduser()
    memo = memo if memo is not None else BackendMemo(default_cache_dir())

    def on_hang(backend: str) -> Callable[[str], None]:
        return lambda reason: memo.avoid(model_dir, backend, reason)

    def opened(name: str) -> Backend:
        backend = registry[name].open(model_dir, resolve_quantize(name, quantize), on_hang(name))
        if kv_type is not KVType.F16:
            backend.set_kv_type(kv_type)
        return backend

    if name != "auto":
        if name not in registry:
            raise BackendUnavailable(f"Unknown backend {name!r}; choose one of auto, {', '.join(registry)}.")
        probe = registry[name].probe()
        if not probe.available:
            raise BackendUnavailable(probe.reason)
        return BackendChoice(opened(name), ())
    skipped: list[BackendProbe] = []
    avoided = memo.avoided(model_dir)
    for candidate in AUTO_ORDER:
        probe = registry[candidate].probe()
        if probe.available and candidate in avoided:
            probe = BackendProbe(candidate, False, f"earlier on this model: {avoided[candidate]}")
        if probe.available and passed_over and candidate in passed_over:
            probe = BackendProbe(candidate, False, passed_over[candidate])
        if not probe.available:
            skipped.append(probe)
            continue
        try:
            return BackendChoice(opened(candidate), tuple(skipped))
        except BackendUnavailable as exc:  # e.g. a Core ML conversion that failed: fall through, keep the reason
            skipped.append(BackendProbe(candidate, False, str(exc)))
    raise BackendUnavailable("No compute backend is available on this machine.")
