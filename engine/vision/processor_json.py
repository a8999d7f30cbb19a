"""A model folder's processor settings, as every vision family reads them: processor_config.json, and the image
processor's settings nested in it or in the older preprocessor_config.json. Sized before read; a damaged file is one
sentence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

MAX_PROCESSOR_BYTES = 1024 * 1024


def read_processor_json(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A folder's processor settings and its image processor's: processor_config.json, the image processor's
    nested in it or in the older preprocessor_config.json ({} for what is missing)."""
    proc = _read_json(folder / "processor_config.json")
    image = proc.get("image_processor")
    if not isinstance(image, dict):
        image = _read_json(folder / "preprocessor_config.json")
    return proc, image


def _read_json(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_PROCESSOR_BYTES:
            raise ModelLoadError(f"{path.name} is larger than any processor config; the model folder looks damaged.")
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        raise ModelLoadError(f"{path.name} is not valid JSON; the download may be incomplete.") from None
    return data if isinstance(data, dict) else {}
