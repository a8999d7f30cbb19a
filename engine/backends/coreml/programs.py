"""The converted programs' interface, shared by the converter (`coreml.wrapper`, `coreml.convert`) that writes
them and the host (`host`, `embedding`) that calls them: the ANE's rules, the functions, the inputs and states, the
mask value, and the compression and compute-unit names. The programs' inputs and outputs are described in
coreml.wrapper's module docstring."""

from __future__ import annotations

from engine.backends.coreml.errors import ConversionError
from engine.model.config import ModelConfig

# ANE rule: no tensor dimension may exceed 16384 (larger ones fall back to CPU or fail to compile), so a large
# vocabulary is split for the LM head into pieces of at most this many rows.
ANE_MAX_DIM = 16384
# ANE rule: state dimensions are multiples of 32 (the slot axis and head dim tile without padding).
ANE_STATE_ALIGN = 32
# ANE rule: Anemll keeps each ANE program at 1-2 GB; coremltools #2758 saw a 667 MB program fail ANE compilation
# silently. The converter splits layers into chunks of at most this many weight bytes and the lint checks it.
MAX_CHUNK_BYTES = 1 << 30
# The slot table a Core ML program is converted for: the cascade's geometry fitted to at most this many slots.
# Every decode step reads, rewrites and rotates the whole KV state and attends over all S slots, so that work
# grows with S past the weights' own on SmolLM2-135M's 8192-position context (figures: coreml/README.md's Core ML
# section). The engine fits its cascade to it through Backend.max_slots (CoreMLBackend.max_slots).
ANE_MAX_SLOTS = 2048
# function name -> tokens per call. 64 amortises the weights over many tokens; 8 and 1 cover the remainder of a
# run in at most 7 + 7 calls instead of 63 single-token calls.
FUNCTIONS: dict[str, int] = {"prefill": 64, "prefill_8": 8, "decode": 1}
# Additive mask value: exp() of it is 0 in any precision, and score + MASK_MIN stays finite in fp16 for any score
# above -35504 (fp16's own minimum overflowed to -inf on SmolLM2's real scores: ANE lint "no fp16 overflow").
MASK_MIN = -30000.0
# The chunk inputs a model with sliding-window layers adds (coreml.wrapper's module doc).
LOCAL_INPUTS = ("q_cos_l", "q_sin_l", "k_cos_l", "k_sin_l", "mask_l")
STATE_NAMES = ("k_cache", "v_cache")
# Suffixes coremltools appends to a weight's var name (fp16 cast, compression) after the traced parameter name.
_VAR_SUFFIXES = ("_quantized", "_palettized", "_promoted_to_fp16", "_to_fp16", "_promoted")

QUANTIZATIONS = ("none", "int8", "int4", "lut4", "lut6", "lut8")
DEFAULT_QUANTIZE = "none"  # measured: the most faithful Neural Engine choice (coreml/README.md "Compression")
COMPUTE_UNITS = ("CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY", "ALL")
DEFAULT_UNITS = "CPU_AND_NE"


def has_local_inputs(config: ModelConfig) -> bool:
    """Whether the model's chunks take LOCAL_INPUTS: some layer attends only within a sliding window."""
    return any(config.is_sliding(i) for i in range(config.num_hidden_layers))


def vocab_pieces(vocab: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of the LM head, each at most ANE_MAX_DIM rows."""
    return [(a, min(a + ANE_MAX_DIM, vocab)) for a in range(0, vocab, ANE_MAX_DIM)]


def strip_var_suffix(var: str) -> str:
    for suffix in _VAR_SUFFIXES:
        var = var.removesuffix(suffix)
    return var


def has_gpu(units: str) -> bool:
    return units in ("CPU_AND_GPU", "ALL")


def resolve(quantize: str | None, units: str) -> str:
    """The quantization to convert with for these compute units; refuses in one sentence what would not run."""
    if units not in COMPUTE_UNITS:
        raise ConversionError(f"Unknown Core ML compute units {units!r}; choose one of {', '.join(COMPUTE_UNITS)}.")
    q = DEFAULT_QUANTIZE if quantize in (None, "auto") else quantize
    if q not in QUANTIZATIONS:
        raise ConversionError(f"Unknown quantization {q!r}; choose one of auto, {', '.join(QUANTIZATIONS)}.")
    if q == "int4" and not has_gpu(units):
        raise ConversionError(
            f"int4 per-block weights run only on the GPU, so {units} would run them on the CPU; use int8, lut4 or lut6, or compute units with the GPU."
        )
    return q
