"""The MLX backend: the network, its slot table and its weights in MLX (Apple's array framework), on the Apple GPU
through Metal where MLX has it, on the CPU elsewhere (Linux's `mlx-cpu`: the same graph on CPU kernels, so the
backend is checked in CI on every change though it pays only on a Mac).

`probe_mlx` is the one place that imports `mlx` to ask whether it is there; the backend itself lives in
engine.backends.mlx.backend, imported only when opened (the registry, engine.backends).
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from engine.backends.base import BackendProbe


def mlx_device() -> str | None:
    """Where MLX runs here: "gpu" (Metal), "cpu", or None when mlx cannot be imported."""
    try:
        import mlx.core as mx
    except ImportError:
        return None
    return "gpu" if mx.metal.is_available() else "cpu"


def probe_mlx() -> BackendProbe:
    try:
        import mlx.core as mx
    except ImportError:
        return BackendProbe("mlx", False, "MLX is not installed (pip install -e '.[mlx]' adds it).")
    try:
        release = version("mlx")
    except PackageNotFoundError:  # a build from source without its metadata
        release = "(unknown version)"
    if mx.metal.is_available():
        return BackendProbe("mlx", True, f"MLX {release} on the Apple GPU (Metal)")
    name = str(mx.device_info().get("device_name", platform.machine()))
    return BackendProbe("mlx", True, f"MLX {release} on the CPU ({name}; a correctness path, not a fast one)")
