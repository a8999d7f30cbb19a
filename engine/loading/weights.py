"""Load a model: a Hugging Face folder (safetensors only, never pickle) or a GGUF file, memory-mapped, built on
the meta device.

We parse safetensors headers ourselves (8-byte little-endian length + JSON) so every way a file can be broken
— truncated download, absurd header, unknown dtype, offsets past the end — becomes one clear sentence, and so
tensors can be views of a private mmap of the file: weights are read from disk once, never copied twice.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.fileio import (
    DTYPES,
    HeaderError,
    HeaderFault,
    HeaderLimits,
    read_header_file,
)
from engine.loading.model_files import check_model_path, file_sha256, gguf_model, is_gguf_model
from engine.loading.rotary_rows import reorder_rows
from engine.model.config import ModelConfig
from engine.model.network import Transformer
from engine.model.quant import BlockType, StoredTensor, check_stored, scales_finite

SAFETENSORS_DTYPES = DTYPES  # the one dtype table (engine.fileio)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_DIM = 1 << 48  # any size or byte offset in a header: beyond this it cannot describe a real file
HEADER_LIMITS = HeaderLimits(MAX_HEADER_BYTES, max_dim=MAX_DIM)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_safetensors_header(path: Path) -> list[TensorInfo]:
    """Validated tensor table of one .safetensors file (raises ModelLoadError naming the problem)."""
    try:
        header = read_header_file(path, HEADER_LIMITS)
    except OSError as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc.strerror or exc}.") from None
    except HeaderError as exc:
        raise ModelLoadError(_header_sentence(path, exc)) from None
    return [TensorInfo(t.name, t.dtype, t.shape, t.start, t.end) for t in header.tensors.values()]


def _header_sentence(path: Path, exc: HeaderError) -> str:
    name, fault = exc.tensor, exc.fault
    if fault is HeaderFault.TRUNCATED:
        return f"{path.name} is empty or truncated; download it again."
    if fault is HeaderFault.HEADER_SIZE:
        return f"{path.name} has a corrupt header (claims {exc.detail}); it is truncated or not a safetensors file."
    if fault is HeaderFault.UNREADABLE:
        return f"{path.name} has an unreadable header; it is not a valid safetensors file."
    if fault is HeaderFault.TOO_MANY:
        return f"{path.name} lists {exc.detail}; it is not a model file MLoT Spark can load."
    if fault is HeaderFault.DTYPE:
        return f"{path.name} stores {name!r} as {exc.detail}, a dtype MLoT Spark cannot load."
    if fault is HeaderFault.SIZE:
        return f"{path.name} has inconsistent offsets for {name!r}; the file is corrupt."
    if fault is HeaderFault.PAST_END:
        return f"{path.name} is truncated ({exc.detail}); the download is incomplete."
    if fault is HeaderFault.OVERLAP:
        return f"{path.name} has overlapping data for {name!r}; the file is corrupt."
    return f"{path.name} has a malformed entry for tensor {name!r}; the file is corrupt."


def mmap_tensors(path: Path, infos: list[TensorInfo]) -> dict[str, torch.Tensor]:
    """Tensors viewing a copy-on-write mmap of the file (no read into RAM until touched)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else None
    out: dict[str, torch.Tensor] = {}
    for t in infos:
        dt = SAFETENSORS_DTYPES[t.dtype]
        count = (t.end - t.start) // torch.empty((), dtype=dt).element_size()
        if count == 0:
            out[t.name] = torch.empty(t.shape, dtype=dt)
            continue
        out[t.name] = torch.frombuffer(mm, dtype=dt, count=count, offset=t.start).view(t.shape)
    return out


def weight_files(model_dir: Path) -> list[Path]:
    """The .safetensors files of a model folder, single or sharded; refuses pickles with a reason."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index.name} is unreadable; the sharded model download may be incomplete.") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"The model is missing shard {missing[0]}; download the whole folder again.")
        return files
    if single.is_file():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{model_dir.name} holds only pickle weights ({pickles[0]}), which can run code and are never loaded; "
            "convert them to safetensors (or download the safetensors version)."
        )
    raise ModelLoadError(
        f"{model_dir} has no model.safetensors; choose a Hugging Face model folder with safetensors weights."
    )


def fingerprint(config: ModelConfig, files: list[Path], tables: list[list[TensorInfo]]) -> str:
    """Model identity for caches and sessions: hash of config.json, every tensor's name/dtype/shape, and 64 KiB
    sampled from the start, middle and end of each file's data (cheap, yet a retrained checkpoint of the same
    architecture gets a different fingerprint, so its caches never mix)."""
    h = hashlib.sha256()
    h.update(json.dumps(config.raw, sort_keys=True).encode())
    for path, table in zip(files, tables, strict=True):
        for t in sorted(table, key=lambda t: t.name):
            h.update(f"{t.name}|{t.dtype}|{t.shape}".encode())
        if table:
            lo, hi = min(t.start for t in table), max(t.end for t in table)
            with open(path, "rb") as f:
                for at in (lo, (lo + hi) // 2, max(lo, hi - 65536)):
                    f.seek(at)
                    h.update(f.read(min(65536, hi - at)))
    return h.hexdigest()[:32]


@dataclass
class LoadedModel:
    model: Transformer
    config: ModelConfig
    fingerprint: str
    path: Path
    # A GGUF's block-quantized weights as stored, by parameter name, for backends that run them without
    # re-quantizing; empty for a Hugging Face folder.
    stored: dict[str, StoredTensor] = field(default_factory=dict)


def _assign(
    model: Transformer,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    device: str | torch.device,
    dtype: torch.dtype,
    left: Mapping[str, tuple[int, int]] | None = None,
) -> None:
    """Check `state` against the model's parameters and assign it (converted to `dtype` on `device`). The names in
    `left` (with their shapes) are checked but stay on the meta device: a backend builds those layers itself."""
    left = left or {}
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        state.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state) - set(left))
    if missing:
        raise ModelLoadError(
            f"The weights lack {missing[0]} (and {len(missing) - 1} more); they do not match the model's configuration."
        )
    converted: dict[str, torch.Tensor] = {}
    for name, ref in expected.items():
        if name in left and name not in state:
            if left[name] != tuple(ref.shape):
                raise ModelLoadError(
                    f"Tensor {name} has shape {left[name]} but the configuration implies {tuple(ref.shape)}."
                )
            continue
        t = state[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ModelLoadError(
                f"Tensor {name} has shape {tuple(t.shape)} but the configuration implies {tuple(ref.shape)}."
            )
        if not t.is_floating_point():
            raise ModelLoadError(f"Tensor {name} is stored as {t.dtype}; a Llama-family weight must be floating point.")
        # A dtype/device change copies once; same dtype on CPU stays a view of the mmap.
        converted[name] = t.to(device=device, dtype=dtype)
        # One NaN or inf anywhere makes the sum non-finite (real weights are far too small to overflow an fp32 sum);
        # 3x cheaper than isfinite().all(). NaN weights would otherwise only fail later, while sampling.
        if not bool(torch.isfinite(converted[name].sum(dtype=torch.float32))):
            raise ModelLoadError(
                f"Tensor {name} holds NaN or infinite values; the model file is corrupt, download it again."
            )
    model.load_state_dict(converted, strict=False, assign=True)
    if config.tie_word_embeddings:
        assert isinstance(model.model.embed_tokens, nn.Embedding)  # as the model was built
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.setup_rope()


def hf_family_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors in the network's layout: Phi-3's fused q/k/v and gate/up split into the
    Llama projections (views, no copy), Gemma's norm weights w stored as the 1 + w they scale by (as llama.cpp's
    converter stores them in a GGUF), and a partial-rotary model's q/k rows reordered (engine.loading.rotary_rows).
    Other families pass through."""
    out: dict[str, torch.Tensor] = {}
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    for name, t in state.items():
        if name.endswith("self_attn.qkv_proj.weight") and t.shape[0] == q_rows + 2 * kv_rows:
            stem = name.removesuffix("qkv_proj.weight")
            q, k, v = torch.split(t, [q_rows, kv_rows, kv_rows])
            out.update({stem + "q_proj.weight": q, stem + "k_proj.weight": k, stem + "v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight") and t.shape[0] == 2 * config.intermediate_size:
            stem = name.removesuffix("gate_up_proj.weight")
            gate, up = t.chunk(2)
            out.update({stem + "gate_proj.weight": gate, stem + "up_proj.weight": up})
        elif config.sandwich_norms and name.endswith("norm.weight") and t.is_floating_point():
            out[name] = t.float() + 1.0  # Gemma scales by (1 + w), computed in fp32 as transformers does
        else:
            out[name] = t
    if config.rotary_dims:
        for name, t in out.items():
            heads = _qk_heads(config, name)
            if heads:
                out[name] = reorder_rows(t, heads, config.head_dim, config.rotary_dims)
    return out


# A vision-language checkpoint's text model: Idefics3's, and Gemma 3's as published and as transformers 5 names it.
TEXT_MODEL_PREFIXES = ("model.text_model.", "language_model.model.", "model.language_model.")


def text_model_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint's text model under the network's names (`model.text_model.` and the like ->
    `model.`); its vision tower and projector are engine.vision's. A text-only checkpoint passes through."""
    prefix = next((p for p in TEXT_MODEL_PREFIXES if any(name.startswith(p) for name in state)), None)
    if prefix is None:
        return state
    out = {"model." + n.removeprefix(prefix): t for n, t in state.items() if n.startswith(prefix)}
    for head in ("lm_head.weight", "language_model.lm_head.weight"):
        if head in state:
            out["lm_head.weight"] = state[head]
    return out


def _qk_heads(config: ModelConfig, name: str) -> int:
    """The heads of a q or k projection's weight or bias (rows to reorder for partial rotary), else 0."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return config.num_attention_heads
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return config.num_key_value_heads
    return 0


def model_fingerprint(model_path: Path) -> str:
    """The fingerprint `load_model` gives a model, from its file(s) alone (no weight is converted)."""
    if is_gguf_model(model_path):
        return file_sha256(gguf_model(model_path).path)[:32]
    config = ModelConfig.from_file(model_path / "config.json")
    files = weight_files(model_path)
    return fingerprint(config, files, [read_safetensors_header(f) for f in files])


def stored_weight_bytes(model_path: Path) -> int:
    """Bytes the model's weights take in its file(s), as stored (no weight is read)."""
    if is_gguf_model(model_path):
        return sum(int(t.data.nbytes) for t in gguf_model(model_path).tensor_shapes())
    return sum(t.end - t.start for f in weight_files(model_path) for t in read_safetensors_header(f))


def _load_gguf(path: Path, device: str | torch.device, dtype: torch.dtype, leave_stored: bool) -> LoadedModel:
    gm = gguf_model(path)
    stored = gm.stored_tensors()
    # Left undecoded only when every matrix can run so: a fused q/k/v or gate/up must not mix undecoded and decoded
    # parts (a Q5_K_M file's Q5_K q beside its Q6_K v), and one format without a kernel reads the model in fp32 anyway.
    runnable = all(t.qtype in BlockType.__members__ for t in stored.values())
    left = dict(stored) if leave_stored and runnable else {}
    for name, blocks in left.items():  # never dequantized here, so checked here as _assign checks the others
        try:
            check_stored(blocks, name)
        except ValueError as exc:
            raise ModelLoadError(f"{path.name}: {exc}; the file is damaged.") from None
        for rows in blocks.row_chunks():  # each chunk's pages given back once read: never the whole file at once
            if not scales_finite(blocks, rows):
                raise ModelLoadError(
                    f"Tensor {name} holds NaN or infinite values; the model file is corrupt, download it again."
                )
            blocks.release(rows)
        blocks.release()  # the pages that straddle two chunks
    with torch.device("meta"):
        model = Transformer(gm.config)
    state: dict[str, torch.Tensor] = {}
    for name, t in gm.dequantized_state(skip=left):
        # Converted as it is read, so at most one fp32 copy of the weights exists at any time.
        state[name] = t if (t.dtype == dtype and str(device) == "cpu") else t.to(device=device, dtype=dtype)
    _assign(model, gm.config, state, device, dtype, {name: blocks.shape for name, blocks in left.items()})
    # The fingerprint covers the whole file: any changed byte is another model for caches and sessions.
    return LoadedModel(model, gm.config, model_fingerprint(gm.path), gm.path, stored)


def load_model(
    model_path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    leave_stored: bool = False,
) -> LoadedModel:
    """Build on the meta device, then assign mmap-backed (or converted) tensors: one copy of the weights at most.

    `model_path`: a Hugging Face folder, a .gguf file, or a folder holding one .gguf. `leave_stored`: a GGUF's
    matrices in a block format (engine.model.quant.BlockType) stay on the meta device, never dequantized, for a backend
    that builds those layers from `LoadedModel.stored`."""
    model_path = Path(model_path).expanduser()
    check_model_path(model_path)
    if is_gguf_model(model_path):
        return _load_gguf(model_path, device, dtype, leave_stored)
    config = ModelConfig.from_file(model_path / "config.json")
    files = weight_files(model_path)
    tables = [read_safetensors_header(f) for f in files]
    state: dict[str, torch.Tensor] = {}
    for f, table in zip(files, tables, strict=True):
        state.update(mmap_tensors(f, table))
    state = hf_family_state(config, text_model_state(state))
    with torch.device("meta"):
        model = Transformer(config)
    _assign(model, config, state, device, dtype)
    return LoadedModel(model, config, fingerprint(config, files, tables), model_path)
