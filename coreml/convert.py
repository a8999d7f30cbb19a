"""torch -> Core ML: the model as a bundle of stateful, fp16, static-shape, multifunction ML Programs.

Steps (each reported to the progress callback, which may cancel between steps):
  0. check memory: a conversion peaks near CONVERT_PEAK_FACTOR x the fp16 bytes of its largest program
  1. plan the layer chunks (≤ max_chunk_bytes of weights each, at the chosen compression)
  2. per program (each chunk, then the head) and per function (prefill T=64, prefill_8 T=8, decode T=1):
     trace the wrapper (coreml.wrapper), ct.convert (macOS 15 target: states need it), compress
  3. merge each program's functions (ct.utils.save_multifunction stores the shared weights once)
  4. the untied input embedding as raw fp16 for the host's mmap lookup; bundle.json with provenance
  5. the ANE lint (coreml.ane_rules): an error fails the build
  6. rename the finished bundle into place: a half-written bundle is never where a reader looks

Why over ~400 lines: the steps above are one pipeline sharing the progress/cancel callback, the memory check and
the bundle being built; apart, each would need the others' state (compression, ANE rules and the bundle layout
already live in their own modules).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coreml import compress
from coreml.errors import ConversionCancelled
from coreml.wrapper import Head, LayerChunk
from engine import fileio
from engine.backends.coreml.bundle import EMBED_FILE, FORMAT_VERSION, HEAD, MANIFEST, Bundle, chunk_name
from engine.backends.coreml.cache import Geometry, cache_key, cached, default_cache_root, tool_versions
from engine.backends.coreml.errors import ConversionError
from engine.backends.coreml.programs import (
    ANE_MAX_SLOTS,
    ANE_STATE_ALIGN,
    DEFAULT_UNITS,
    LOCAL_INPUTS,
    MAX_CHUNK_BYTES,
    STATE_NAMES,
    has_local_inputs,
    resolve,
    vocab_pieces,
)
from engine.loading.model_files import read_config
from engine.model.config import ModelConfig
from engine.model.network import Transformer

DEFAULT_SLOTS = 512  # only when the model's cascade geometry is unknown; convert() uses the model's own
DEFAULT_GEOMETRY = Geometry(DEFAULT_SLOTS)
CHUNK_INPUTS = ("hidden", "q_cos", "q_sin", "k_cos", "k_sin", "mask", "write", "keep")  # + LOCAL_INPUTS (programs)
# Peak memory of one program's conversion in multiples of its fp16 weight bytes (measured ~10x: README).
CONVERT_PEAK_FACTOR = 12

Progress = Callable[[str, float], None]  # (stage sentence, fraction done 0..1)


def _no_progress(stage: str, fraction: float) -> None:
    pass


def check_geometry(config: ModelConfig, geometry: Geometry) -> None:
    """Refuse, in one sentence, what the ANE rules or the function chunks make impossible."""
    s, d = geometry.slots, config.head_dim
    biggest = max(t for _, t in geometry.functions)
    if s % ANE_STATE_ALIGN or s < biggest:
        raise ConversionError(
            f"A Core ML slot table of {s} slots is not possible: it must be a multiple of {ANE_STATE_ALIGN} and at least {biggest}."
        )
    if d % ANE_STATE_ALIGN:
        raise ConversionError(
            f"The model's head dimension {d} is not a multiple of {ANE_STATE_ALIGN}, which the Neural Engine's KV state needs."
        )
    if 1 not in dict(geometry.functions).values():
        raise ConversionError("A Core ML bundle needs a single-token function to run every step.")


def layer_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    """Weight shapes of one decoder layer (matrices and vectors), as the conversion stores them."""
    c, i, h, kv, d = (
        config.hidden_size,
        config.intermediate_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    shapes: list[tuple[int, ...]] = [
        (h * d, c),
        (kv * d, c),
        (kv * d, c),
        (c, h * d),
        (i, c),
        (i, c),
        (c, i),
        (c,),
        (c,),
    ]
    if config.qkv_bias:
        shapes += [(h * d,), (kv * d,), (kv * d,)]
    if config.o_bias:
        shapes.append((c,))
    if config.mlp_bias:
        shapes += [(i,), (i,), (c,)]
    if config.sandwich_norms:
        shapes += [(c,), (c,)]
    if config.qk_norm:
        shapes += [(d,), (d,)]
    return shapes


def head_shapes(config: ModelConfig) -> list[tuple[int, ...]]:
    return [(b - a, config.hidden_size) for a, b in vocab_pieces(config.vocab_size)] + [(config.hidden_size,)]


def plan_chunks(config: ModelConfig, quantize: str, max_bytes: int) -> list[tuple[int, int]]:
    """[first, last) layers per chunk: consecutive layers while the chunk's weights stay ≤ max_bytes."""
    per_layer = compress.nominal_bytes(layer_shapes(config), quantize)
    if per_layer > max_bytes:
        raise ConversionError(
            f"One decoder layer holds {per_layer / 1e6:.0f} MB of weights, more than the {max_bytes / 1e6:.0f} MB a Neural Engine program may hold."
        )
    n = max(1, max_bytes // per_layer)
    L = config.num_hidden_layers
    return [(a, min(a + n, L)) for a in range(0, L, n)]


def expected_bytes(config: ModelConfig, quantize: str) -> int:
    """The bundle's weights at this compression, each stored once (the size target: bundle ≤ 1.05 x this)."""
    total = config.num_hidden_layers * compress.nominal_bytes(layer_shapes(config), quantize) + compress.nominal_bytes(
        head_shapes(config), quantize
    )
    if not config.tie_word_embeddings:
        total += 2 * config.vocab_size * config.hidden_size
    return total


def check_memory(config: ModelConfig, chunks: list[tuple[int, int]], available: int | None = None) -> None:
    """Refuse in one sentence, before any work, a conversion that would exhaust memory."""
    import psutil

    largest = max(
        [compress.nominal_bytes(layer_shapes(config), "none") * (b - a) for a, b in chunks]
        + [compress.nominal_bytes(head_shapes(config), "none")]
    )
    model = expected_bytes(config, "none")
    need = model + CONVERT_PEAK_FACTOR * largest
    have = psutil.virtual_memory().available if available is None else available
    if need > have:
        raise ConversionError(
            f"Converting this model needs about {need / 1e9:.1f} GB of free memory and {have / 1e9:.1f} GB are available; close other apps or use a smaller model."
        )


def provenance(
    config: ModelConfig, fingerprint: str, geometry: Geometry, quantize: str, units: str, chunks: list[tuple[int, int]]
) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "architecture": config.architecture,
        "config": config.raw,
        "slots": geometry.slots,
        "functions": dict(geometry.functions),
        "chunks": [list(c) for c in chunks],
        "vocab_pieces": [list(p) for p in vocab_pieces(config.vocab_size)],
        "quantize": quantize,
        "units": units,
        "tied": bool(config.tie_word_embeddings),
        "cache_key": cache_key(fingerprint, geometry, quantize, units),
        **tool_versions(),
    }


def chunk_inputs(config: ModelConfig) -> tuple[str, ...]:
    """The layer chunks' input names: CHUNK_INPUTS, and LOCAL_INPUTS for a model with sliding-window layers."""
    return (*CHUNK_INPUTS, *LOCAL_INPUTS) if has_local_inputs(config) else CHUNK_INPUTS


def chunk_example(config: ModelConfig, slots: int, t: int) -> tuple[torch.Tensor, ...]:
    d, h = config.head_dim, torch.float16
    local = (
        torch.ones(1, 1, t, d, dtype=h),  # q_cos_l
        torch.zeros(1, 1, t, d, dtype=h),  # q_sin_l
        torch.ones(1, 1, slots, d, dtype=h),  # k_cos_l
        torch.zeros(1, 1, slots, d, dtype=h),  # k_sin_l
        torch.zeros(1, 1, t, slots, dtype=h),  # mask_l
    )
    return (
        torch.zeros(1, config.hidden_size, 1, t, dtype=h),  # hidden
        torch.ones(1, 1, t, d, dtype=h),  # q_cos
        torch.zeros(1, 1, t, d, dtype=h),  # q_sin
        torch.ones(1, 1, slots, d, dtype=h),  # k_cos
        torch.zeros(1, 1, slots, d, dtype=h),  # k_sin
        torch.zeros(1, 1, t, slots, dtype=h),  # mask
        torch.zeros(1, 1, slots, t, dtype=h),  # write
        torch.ones(1, 1, slots, 1, dtype=h),  # keep
        *(local if has_local_inputs(config) else ()),
    )


_OP_RE = re.compile(r"op(?:eration)? '?([\w:.]+)'?", re.IGNORECASE)


def _ct_convert(
    module: torch.nn.Module, example: tuple[torch.Tensor, ...], names: tuple[str, ...], outputs: list[str], out: Path
) -> None:
    import coremltools as ct

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=torch.jit.TracerWarning)  # type: ignore[attr-defined]  # torch.jit has no __all__
        with torch.no_grad():
            traced = torch.jit.trace(module, example)  # type: ignore[no-untyped-call]  # torch.jit.trace is unannotated
    inputs = [
        ct.TensorType(name=n, shape=tuple(e.shape), dtype=np.float16) for n, e in zip(names, example, strict=True)
    ]
    states = [
        ct.StateType(wrapped_type=ct.TensorType(shape=tuple(getattr(module, n).shape), dtype=np.float16), name=n)
        for n in STATE_NAMES
        if hasattr(module, n)
    ]
    try:
        mlmodel = ct.convert(
            traced,
            inputs=inputs,
            outputs=[ct.TensorType(name=n, dtype=np.float16) for n in outputs],
            states=states or None,
            minimum_deployment_target=ct.target.macOS15,  # states and iOS18 compression ops need it
            compute_precision=ct.precision.FLOAT16,
            convert_to="mlprogram",
            skip_model_load=True,  # no Core ML runtime needed (and none on Linux)
        )
    except Exception as exc:
        m = _OP_RE.search(str(exc))
        what = (
            f"the op {m.group(1)!r}"
            if m
            else f"this model ({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})"
        )
        raise ConversionError(
            f"Core ML conversion failed: coremltools {ct.__version__} cannot convert {what}."
        ) from None
    mlmodel.save(str(out))


class _Steps:
    """Progress over a known number of steps; cancellation is checked at every step."""

    def __init__(self, total: int, progress: Progress, cancel: Callable[[], bool] | None) -> None:
        self.total, self.done, self.progress, self.cancel = total, 0, progress, cancel

    def __call__(self, stage: str) -> None:
        if self.cancel is not None and self.cancel():
            raise ConversionCancelled("The Core ML conversion was cancelled; nothing was written.")
        self.progress(stage, min(self.done / self.total, 1.0))
        self.done += 1


def build_bundle(
    model: Transformer,
    fingerprint: str,
    out: Path,
    *,
    quantize: str | None = None,
    units: str = DEFAULT_UNITS,
    geometry: Geometry = DEFAULT_GEOMETRY,
    progress: Progress = _no_progress,
    cancel: Callable[[], bool] | None = None,
    available_memory: int | None = None,
) -> Path:
    """Convert an in-memory fp16 `model` to the bundle `out` (written atomically; replaces an existing one)."""
    import coremltools as ct

    from coreml import ane_rules

    quantize = resolve(quantize, units)
    config = model.config
    check_geometry(config, geometry)
    chunks = plan_chunks(config, quantize, geometry.max_chunk_bytes)
    check_memory(config, chunks, available_memory)
    n_fn = len(geometry.functions)
    step = _Steps((len(chunks) + 1) * (2 * n_fn + 1) + 2, progress, cancel)

    def layer_chunk(a: int, b: int) -> Callable[[int], torch.nn.Module]:
        return lambda t: LayerChunk(model, a, b, geometry.slots, t)

    programs: list[tuple[str, Callable[[int], torch.nn.Module], tuple[str, ...], list[str]]] = [
        (chunk_name(i), layer_chunk(a, b), chunk_inputs(config), ["hidden_out", "qsum"])
        for i, (a, b) in enumerate(chunks)
    ]
    programs.append(
        (HEAD, lambda t: Head(model), ("hidden",), [f"logits_{i}" for i in range(len(vocab_pieces(config.vocab_size)))])
    )
    with atomic_dir(out) as tmp, tempfile.TemporaryDirectory(prefix="spark-coreml-") as work:
        tmp.mkdir()
        for name, make, input_names, outputs in programs:
            parts: dict[str, Path] = {}
            for fname, t in geometry.functions:
                step(f"Converting {name} ({fname}, {t} tokens per call)")
                module = make(t).eval()
                example = (
                    chunk_example(config, geometry.slots, t)
                    if name != HEAD
                    else (chunk_example(config, geometry.slots, t)[0],)
                )
                parts[fname] = Path(work) / f"{name}-{fname}.mlpackage"
                _ct_convert(module, example, input_names, outputs, parts[fname])
                del module
                step(f"Compressing {name} ({fname}, {quantize})")
                if quantize != "none":
                    compress.compress_package(parts[fname], quantize)
            step(f"Merging the functions of {name}")
            desc = ct.utils.MultiFunctionDescriptor()
            for fname, path in parts.items():
                desc.add_function(str(path), src_function_name="main", target_function_name=fname)
            desc.default_function_name = "decode" if "decode" in parts else next(iter(parts))
            ct.utils.save_multifunction(desc, str(tmp / f"{name}.mlpackage"))
            for path in parts.values():
                shutil.rmtree(path, ignore_errors=True)
            compress.clear_memo()
        step("Writing the host embedding and the manifest")
        if not config.tie_word_embeddings:
            assert isinstance(model.model.embed_tokens, nn.Embedding)  # the converter's model keeps the lookup as built
            emb = model.model.embed_tokens.weight.detach().to(torch.float16).contiguous().numpy()  # (V, C)
            emb.tofile(tmp / EMBED_FILE)
        prov = provenance(config, fingerprint, geometry, quantize, units, chunks)
        (tmp / MANIFEST).write_text(json.dumps(prov, sort_keys=True), encoding="utf-8")
        step("Checking the Neural Engine rules")
        errors = [f for f in ane_rules.lint_bundle(Bundle.open(tmp)) if f.error]
        if errors:
            raise ConversionError(
                f"The converted program breaks an ANE rule: {errors[0]} ({len(errors)} error(s) in all)."
            )
    progress("Done", 1.0)
    return out


def load_for_conversion(model_dir: str | Path) -> tuple[Transformer, str]:
    from engine.loading.weights import load_model

    loaded = load_model(model_dir, dtype=torch.float16)  # the bundle's weights are these fp16 values exactly
    return loaded.model, loaded.fingerprint


def default_slots(model_dir: str | Path, config: ModelConfig) -> int:
    """The slot count the memory cascade uses for this model on Core ML: its default geometry fitted to
    ANE_MAX_SLOTS, exactly as engine.session.engine fits it to CoreMLBackend.max_slots (so `make app` ships that bundle)."""
    from engine.loading.model_files import settings_dir
    from engine.memory.cascade import CascadeConfig

    return CascadeConfig.for_model(settings_dir(model_dir), config, max_slots=ANE_MAX_SLOTS).num_slots


def convert(
    model_dir: str | Path,
    out: str | Path,
    *,
    quantize: str | None = None,
    units: str = DEFAULT_UNITS,
    slots: int | None = None,
    max_chunk_bytes: int = MAX_CHUNK_BYTES,
    progress: Progress = _no_progress,
    cancel: Callable[[], bool] | None = None,
) -> Path:
    """`python -m coreml convert`: the model folder -> the bundle `out`."""
    model, fp = load_for_conversion(model_dir)
    slots = slots if slots is not None else default_slots(model_dir, model.config)
    geometry = Geometry(slots, max_chunk_bytes=max_chunk_bytes)
    return build_bundle(
        model,
        fp,
        Path(out).expanduser(),
        quantize=quantize,
        units=units,
        geometry=geometry,
        progress=progress,
        cancel=cancel,
    )


# ------------------------------------------------------------------------------------------------ atomic + cache
@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary path; on success rename it to `final`, on any error (or cancel) remove it.

    The temporary folder lives inside a hidden '.partial-*' folder next to `final` (same filesystem, so the
    rename is atomic), so neither the cache lookup (which opens exactly `final`) nor a user browsing the folder
    finds a half-written bundle: `final` is absent, the old bundle, or the complete new one. Every file is
    fsynced before the rename, and the folder after it (engine.fileio.atomic_dir).
    """
    with fileio.atomic_dir(Path(final)) as tmp:
        yield tmp


def cached_bundle(
    model_dir: str | Path,
    *,
    slots: int | None = None,
    quantize: str | None = None,
    units: str = DEFAULT_UNITS,
    cache_dir: str | Path | None = None,
    progress: Progress = _no_progress,
    cancel: Callable[[], bool] | None = None,
) -> Path:
    """The bundle for this model/geometry/compression/units/tool versions, converting (once) if the cache lacks it."""
    from engine.loading.weights import model_fingerprint

    model_dir = Path(model_dir).expanduser()
    config = read_config(model_dir)
    fp = model_fingerprint(model_dir)
    quantize = resolve(quantize, units)
    geometry = Geometry(slots if slots is not None else default_slots(model_dir, config))
    check_geometry(config, geometry)
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    path = root / cache_key(fp, geometry, quantize, units)
    if cached(path):  # an unreadable cache entry is rebuilt (atomically replaced), never trusted
        progress("Using the cached Core ML model", 1.0)
        return path
    model, _ = load_for_conversion(model_dir)
    return build_bundle(
        model, fp, path, quantize=quantize, units=units, geometry=geometry, progress=progress, cancel=cancel
    )
