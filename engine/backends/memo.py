"""Backends remembered per model: a backend that hung or failed for a model is skipped by `auto` the next time,
with the reason it gave, instead of hanging again at every launch. A small JSON in the cache dir, written
atomically; a damaged or hostile file is treated as empty (it only ever holds hints)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.fileio import atomic_write

MEMO_NAME = "backend-choices.json"
MAX_MEMO_BYTES = 1 << 20
MAX_MODELS = 256  # the oldest entries go first beyond this
MAX_REASON_CHARS = 300


def model_key(model_dir: Path) -> str:
    """Which model: its resolved path with the size and time of its main file (a replaced file is a new model)."""
    p = Path(model_dir).expanduser().resolve()
    try:
        st = p.stat()
    except OSError:
        return str(p)
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


class BackendMemo:
    """model -> {backend name: why it is skipped}, in `folder`/backend-choices.json."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / MEMO_NAME

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            if self.path.stat().st_size > MAX_MEMO_BYTES:
                return {}
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: {b: r for b, r in v.items() if isinstance(b, str) and isinstance(r, str)}
            for k, v in data.items()
            if isinstance(k, str) and isinstance(v, dict)
        }

    def avoided(self, model_dir: Path) -> dict[str, str]:
        """Backends to skip for this model, each with its remembered reason."""
        return self._read().get(model_key(model_dir), {})

    def avoid(self, model_dir: Path, backend: str, reason: str) -> None:
        """Remember that `backend` should be skipped for this model; a cache that cannot be written is no error."""
        data = self._read()
        key = model_key(model_dir)
        entry = data.pop(key, {})
        entry[backend] = reason[:MAX_REASON_CHARS]
        data[key] = entry  # last: the most recent
        while len(data) > MAX_MODELS:
            data.pop(next(iter(data)))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, [json.dumps(data, ensure_ascii=False, indent=1).encode("utf-8")])
        except OSError:
            pass
