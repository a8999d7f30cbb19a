"""torch -> Core ML: one stateful, fp16, static-shape, multifunction ML Program per (model, slots, quantization).

Steps (each reported to the progress callback):
  1. build a CoreMLWrapper per function (prefill T=64, prefill_8 T=8, decode T=1; see coreml.wrapper) and trace it
  2. ct.convert each (macOS 15 target: states need it), KV buffers declared as ct.StateType
  3. compress each function's weights (coremltools.optimize.coreml; deterministic, so identical weights stay
     identical and are stored once)
  4. merge into one multifunction package (ct.utils.save_multifunction deduplicates the shared weights)
  5. write provenance into the package metadata and check the ANE rules (a violation fails the build)
  6. rename the finished package into place: a half-written package is never where a reader looks
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from coreml.errors import ConversionError, PackageError
from coreml.package import Package
from coreml.wrapper import ANE_STATE_ALIGN, FUNCTIONS, CoreMLWrapper, vocab_pieces
from engine.config import ModelConfig
from engine.model_files import read_config
from engine.model import Transformer

FORMAT_VERSION = "1"  # bump when the wrapper's inputs, outputs or state layout change: invalidates the cache
QUANTIZATIONS = ("none", "int8", "int4", "lut4", "lut6")
DEFAULT_SLOTS = 512
STATE_NAMES = ("k_cache", "v_cache")
INPUT_NAMES = ("input_ids", "q_cos", "q_sin", "k_cos", "k_sin", "mask", "write_start")
REQUIRED_PROVENANCE = (
    "format", "fingerprint", "architecture", "config", "slots", "functions", "vocab_pieces", "quantize",
    "coremltools", "torch", "cache_key",
)
# Weights smaller than this stay fp16: compressing them saves nothing and costs accuracy.
QUANT_MIN_WEIGHT = 1024
INT4_BLOCK = 32
LUT_GROUP = 16  # output channels sharing one palette (iOS18 grouped-channel palettization)

Progress = Callable[[str, float], None]  # (stage sentence, fraction done 0..1)


def _no_progress(stage: str, fraction: float) -> None:
    pass


@dataclass(frozen=True)
class Geometry:
    """What a package is specialised for besides the weights."""

    slots: int
    functions: tuple[tuple[str, int], ...] = tuple(FUNCTIONS.items())


def tool_versions() -> dict[str, str]:
    import coremltools as ct

    return {"coremltools": ct.__version__, "torch": torch.__version__}


def cache_key(fingerprint: str, geometry: Geometry, quantize: str) -> str:
    """Everything that changes the package's bytes: model, geometry, compression, format and tool versions."""
    ident = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "slots": geometry.slots,
        "functions": list(geometry.functions),
        "quantize": quantize,
        **tool_versions(),
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def provenance(config: ModelConfig, fingerprint: str, geometry: Geometry, quantize: str) -> dict[str, str]:
    return {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "architecture": config.architecture,
        "config": json.dumps(config.raw, sort_keys=True),
        "slots": str(geometry.slots),
        "functions": json.dumps(dict(geometry.functions)),
        "layers": str(config.num_hidden_layers),
        "kv_heads": str(config.num_key_value_heads),
        "head_dim": str(config.head_dim),
        "vocab_size": str(config.vocab_size),
        "vocab_pieces": json.dumps(vocab_pieces(config.vocab_size)),
        "quantize": quantize,
        "cache_key": cache_key(fingerprint, geometry, quantize),
        **tool_versions(),
    }


def check_geometry(config: ModelConfig, geometry: Geometry) -> None:
    """Refuse, in one sentence, what the ANE rules or the function chunks make impossible."""
    s, d = geometry.slots, config.head_dim
    biggest = max(t for _, t in geometry.functions)
    if s % ANE_STATE_ALIGN or s < biggest:
        raise ConversionError(
            f"A Core ML slot table of {s} slots is not possible: it must be a multiple of {ANE_STATE_ALIGN} and at least {biggest}."
        )
    if d % ANE_STATE_ALIGN:
        raise ConversionError(f"The model's head dimension {d} is not a multiple of {ANE_STATE_ALIGN}, which the Neural Engine's KV state needs.")


def _quant_config(quantize: str):  # -> coremltools.optimize.coreml.OptimizationConfig
    import coremltools.optimize.coreml as cto

    if quantize == "int8":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=QUANT_MIN_WEIGHT)
    elif quantize == "int4":
        op = cto.OpLinearQuantizerConfig(
            mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=INT4_BLOCK, weight_threshold=QUANT_MIN_WEIGHT
        )
    else:
        bits = {"lut4": 4, "lut6": 6}[quantize]
        op = cto.OpPalettizerConfig(
            mode="custom", lut_function=kmeans_lut(bits), granularity="per_grouped_channel", group_size=LUT_GROUP, weight_threshold=QUANT_MIN_WEIGHT
        )
    # Only the matmul weights (1x1 convs) and embedding tables: norms and RoPE-free scalars stay fp16.
    return cto.OptimizationConfig(op_type_configs={"conv": op, "gather": op})


def kmeans_lut(bits: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Deterministic 1-D k-means palette (Lloyd's algorithm from quantile seeds).

    Deterministic on purpose: every function of the package compresses the same weights, and only identical
    results are deduplicated by save_multifunction. (coremltools' own kmeans mode also needs scikit-learn.)
    """

    def lut_function(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w = np.asarray(weight, dtype=np.float32).ravel()
        k = 1 << bits
        centers = np.quantile(w, (np.arange(k) + 0.5) / k)
        for _ in range(16):
            centers = np.sort(centers)
            idx = np.searchsorted((centers[1:] + centers[:-1]) / 2, w)
            sums = np.bincount(idx, weights=w, minlength=k)
            counts = np.bincount(idx, minlength=k)
            centers = np.where(counts > 0, sums / np.maximum(counts, 1), centers)
        centers = np.sort(centers)
        idx = np.searchsorted((centers[1:] + centers[:-1]) / 2, w)
        return centers.astype(weight.dtype), idx.astype(np.uint8)

    return lut_function


def example_inputs(config: ModelConfig, slots: int, chunk: int) -> tuple[torch.Tensor, ...]:
    d, h = config.head_dim, torch.float16
    return (
        torch.zeros(1, chunk, dtype=torch.int32),  # input_ids
        torch.ones(1, 1, chunk, d, dtype=h),  # q_cos
        torch.zeros(1, 1, chunk, d, dtype=h),  # q_sin
        torch.ones(1, 1, slots, d, dtype=h),  # k_cos
        torch.zeros(1, 1, slots, d, dtype=h),  # k_sin
        torch.zeros(1, 1, chunk, slots, dtype=h),  # mask
        torch.zeros(1, dtype=torch.int32),  # write_start
    )


_OP_RE = re.compile(r"op(?:eration)? '?([\w:.]+)'?", re.IGNORECASE)


def _convert_function(model: Transformer, slots: int, chunk: int, out: Path) -> None:
    import coremltools as ct

    wrapper = CoreMLWrapper(model, slots, chunk).eval()
    example = example_inputs(model.config, slots, chunk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
        with torch.no_grad():
            traced = torch.jit.trace(wrapper, example)
    inputs = [
        ct.TensorType(name=n, shape=tuple(e.shape), dtype=np.int32 if e.dtype == torch.int32 else np.float16)
        for n, e in zip(INPUT_NAMES, example)
    ]
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=tuple(wrapper.k_cache.shape), dtype=np.float16), name=n) for n in STATE_NAMES
    ]
    outputs = [ct.TensorType(name=f"logits_{i}", dtype=np.float16) for i in range(len(wrapper.pieces))]
    try:
        mlmodel = ct.convert(
            traced,
            inputs=inputs,
            outputs=outputs,
            states=states,
            minimum_deployment_target=ct.target.macOS15,  # states and iOS18 compression ops need it
            compute_precision=ct.precision.FLOAT16,
            convert_to="mlprogram",
            skip_model_load=True,  # no Core ML runtime needed (and none on Linux)
        )
    except Exception as exc:  # coremltools raises bare RuntimeError/ValueError/NotImplementedError for unsupported ops
        m = _OP_RE.search(str(exc))
        what = f"the op {m.group(1)!r}" if m else f"this model ({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})"
        raise ConversionError(f"Core ML conversion failed: coremltools {ct.__version__} cannot convert {what}.") from None
    mlmodel.save(str(out))


def _compress(path: Path, quantize: str) -> None:
    import coremltools as ct
    import coremltools.optimize.coreml as cto

    model = ct.models.MLModel(str(path), skip_model_load=True)
    cfg = _quant_config(quantize)
    fn = cto.linear_quantize_weights if quantize.startswith("int") else cto.palettize_weights
    compressed = fn(model, cfg)
    shutil.rmtree(path)
    compressed.save(str(path))


def build_package(
    model: Transformer,
    fingerprint: str,
    out: Path,
    *,
    quantize: str = "none",
    geometry: Geometry = Geometry(DEFAULT_SLOTS),
    progress: Progress = _no_progress,
) -> Path:
    """Convert an in-memory fp16 `model` to the package `out` (written atomically; replaces an existing one)."""
    import coremltools as ct

    from coreml import ane_rules

    if quantize not in QUANTIZATIONS:
        raise ConversionError(f"Unknown quantization {quantize!r}; choose one of {', '.join(QUANTIZATIONS)}.")
    config = model.config
    check_geometry(config, geometry)
    steps = 2 * len(geometry.functions) + 2
    done = 0
    with atomic_package(out) as tmp, tempfile.TemporaryDirectory(prefix="spark-coreml-") as work:
        parts: dict[str, Path] = {}
        for name, chunk in geometry.functions:
            progress(f"Converting the {name} function ({chunk} tokens per call)", done / steps)
            parts[name] = Path(work) / f"{name}.mlpackage"
            _convert_function(model, geometry.slots, chunk, parts[name])
            done += 1
            if quantize != "none":
                progress(f"Compressing the {name} function's weights ({quantize})", done / steps)
                _compress(parts[name], quantize)
            done += 1
        progress("Merging the functions into one package", done / steps)
        desc = ct.utils.MultiFunctionDescriptor()
        for name, path in parts.items():
            desc.add_function(str(path), src_function_name="main", target_function_name=name)
        desc.default_function_name = "decode"
        ct.utils.save_multifunction(desc, str(tmp))
        done += 1
        progress("Checking the Neural Engine rules", done / steps)
        pkg = Package.open(tmp)
        pkg.set_provenance(provenance(config, fingerprint, geometry, quantize))
        violations = ane_rules.check_package(pkg)
        if violations:
            raise ConversionError(f"The converted program breaks an ANE rule: {violations[0]} ({len(violations)} violation(s) in all).")
    progress("Done", 1.0)
    return out


def load_for_conversion(model_dir: str | Path) -> tuple[Transformer, str]:
    from engine.weights import load_model

    loaded = load_model(model_dir, dtype=torch.float16)  # the package's weights are these fp16 values exactly
    return loaded.model, loaded.fingerprint


def convert(
    model_dir: str | Path,
    out: str | Path,
    *,
    quantize: str = "none",
    slots: int = DEFAULT_SLOTS,
    progress: Progress = _no_progress,
) -> Path:
    """`python -m coreml convert`: the model folder -> the package `out`."""
    model, fp = load_for_conversion(model_dir)
    return build_package(model, fp, Path(out).expanduser(), quantize=quantize, geometry=Geometry(slots), progress=progress)


# ------------------------------------------------------------------------------------------------ atomic + cache
@contextmanager
def atomic_package(final: Path) -> Iterator[Path]:
    """Yield a temporary package path; on success rename it to `final`, on any error remove it.

    The temporary package lives inside a hidden '.partial-*' folder next to `final` (same filesystem, so the
    rename is atomic), so neither the cache lookup (which opens exactly `final`) nor a user browsing the folder
    finds a half-written package: `final` is absent, the old package, or the complete new one.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = final.parent / f".partial-{final.stem}-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        tmp = work / "package.mlpackage"  # coremltools insists on the extension
        yield tmp
        if final.exists():
            old = work / "replaced.mlpackage"
            os.rename(final, old)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_cache_root() -> Path:
    from engine.paths import default_cache_dir

    return default_cache_dir() / "coreml"


def cached_package_path(cache_root: Path, key: str) -> Path:
    return cache_root / f"{key}.mlpackage"


def cached_package(
    model_dir: str | Path,
    *,
    slots: int = DEFAULT_SLOTS,
    quantize: str = "none",
    cache_dir: str | Path | None = None,
    progress: Progress = _no_progress,
) -> Path:
    """The package for this model/geometry/quantization/tool versions, converting (once) if the cache lacks it."""
    from engine.weights import fingerprint, read_safetensors_header, weight_files

    model_dir = Path(model_dir).expanduser()
    config = read_config(model_dir)
    files = weight_files(model_dir)
    fp = fingerprint(config, files, [read_safetensors_header(f) for f in files])
    geometry = Geometry(slots)
    check_geometry(config, geometry)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    path = cached_package_path(root, cache_key(fp, geometry, quantize))
    if path.is_dir():
        try:
            if Package.open(path).provenance.get("cache_key") == path.stem:
                progress("Using the cached Core ML package", 1.0)
                return path
        except PackageError:
            pass  # an unreadable cache entry is rebuilt (atomically replaced), never trusted
    model, _ = load_for_conversion(model_dir)
    return build_package(model, fp, path, quantize=quantize, geometry=geometry, progress=progress)
