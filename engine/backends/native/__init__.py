"""Native CPU kernels (spark_kernels.c: GGUF block formats, a threaded decoding step of one token or a few;
spark_attention.c: its attention over the slot table as stored; the block products per instruction-set family in
ref/, x86/ and arm/, spark_blocks.h says how): built on first use with the machine's C compiler, loaded with ctypes.

The library is compiled once per source version, compiler and CPU into the cache dir (a few seconds), tuned for
the CPU it runs on (-march=native on x86, -mcpu=native on Arm); a packaged app ships one built for its platform. Where no C compiler is found (a Mac without the
Xcode Command Line Tools) or the build fails, `load_kernels()` returns None with the reason, and the engine runs
its PyTorch path. Nothing here executes code from a model file: the library is built from our own source.

The ABI is plain C structs of pointers (spark_kernels.h), mirrored below with ctypes and checked by size when the
library is bound; every tensor passed must stay alive and unmoved while the library holds its pointer (the modules
here keep them as buffers).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from engine.fileio import atomic_path
from engine.paths import bundle_root, default_cache_dir

NATIVE_DIR = Path(__file__).parent
# The library's translation units: the common part, the attention, and one file per instruction-set family (a family
# the compiler does not target compiles to an empty registration, so every build compiles the same list).
SOURCES = tuple(
    NATIVE_DIR / name
    for name in ("spark_kernels.c", "spark_attention.c", "ref/quants.c", "x86/quants.c", "arm/quants.c")
)
COMPILER_ENV = "CC"  # the compiler to use, as for any C build; else cc, clang, gcc in that order
DISABLE_ENV = "MLOT_SPARK_NO_NATIVE"
BUNDLED_DIR = "engine_native"  # where a packaged app keeps its prebuilt library  # set to 1 to run the PyTorch path (comparisons, troubleshooting)


class QMat(ctypes.Structure):
    """spark_qmat: a block-quantized matrix (N, K) in a GGUF layout (engine.model.quant) with an optional bias, and
    the next part of a fused matrix whose parts differ in format (NULL: none)."""


QMat._fields_ = [
    ("blocks", ctypes.c_void_p),
    ("bias", ctypes.c_void_p),
    ("n", ctypes.c_int32),
    ("k", ctypes.c_int32),
    ("type", ctypes.c_int32),
    ("act_parts", ctypes.c_int32),  # 1: int8 activations per block of 32 (llama.cpp's Q8); 2: int16
    ("next", ctypes.POINTER(QMat)),  # the decoding step follows it; spark_qgemm computes this part only
]


class ModelDesc(ctypes.Structure):
    """spark_model: the decoder's shape and per-layer weights."""

    _fields_ = [
        ("n_layers", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("attn_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("mlp_norm", ctypes.POINTER(ctypes.c_void_p)),
        ("qkv", ctypes.POINTER(QMat)),
        ("o", ctypes.POINTER(QMat)),
        ("gate_up", ctypes.POINTER(QMat)),
        ("down", ctypes.POINTER(QMat)),
        ("final_norm", ctypes.c_void_p),
        ("lm_head", ctypes.POINTER(QMat)),
    ]


class CacheDesc(ctypes.Structure):
    """spark_cache: one row of the slot table (engine.model.slots.KVCache), keys unrotated."""

    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("capacity", ctypes.c_int64),
        ("half", ctypes.c_int32),
    ]


class StepDesc(ctypes.Structure):
    """spark_step: one token's rotations and addresses in a decoding step (engine.model.slots.DirectReads)."""

    _fields_ = [
        ("cos_new", ctypes.c_void_p),
        ("sin_new", ctypes.c_void_p),
        ("cos_plain", ctypes.c_void_p),
        ("sin_plain", ctypes.c_void_p),
        ("slot", ctypes.c_int64),
        ("width", ctypes.c_int32),
        ("split", ctypes.c_int32),
        ("slots", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("cos_table", ctypes.c_void_p),
        ("sin_table", ctypes.c_void_p),
        ("qsum", ctypes.c_void_p),
    ]


class AttnDesc(ctypes.Structure):
    """spark_attn: one layer's attention of a decoding step over one row's table (spark_attention.c)."""

    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("capacity", ctypes.c_int64),
        ("half", ctypes.c_int32),
        ("slots", ctypes.c_void_p),
        ("positions", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("width", ctypes.c_int32),
        ("split", ctypes.c_int32),
        ("q_new", ctypes.c_void_p),
        ("q_plain", ctypes.c_void_p),
        ("n_heads", ctypes.c_int32),
        ("n_kv_heads", ctypes.c_int32),
        ("d", ctypes.c_int32),
        ("scale", ctypes.c_float),
        ("chunk", ctypes.c_int32),
        ("partial", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("rotated", ctypes.c_void_p),  # keys rotated for several tokens (spark_decode_rows); NULL: rotate on read
        ("rank_of", ctypes.c_void_p),
        ("rotated_width", ctypes.c_int64),
    ]


# Block formats whose matrices take int8 activations on AVX-512 VNNI unless told otherwise (ggml ids of Q4_K and
# Q6_K, the bulk of every Q4_K_M, Q5_K_M and Q6_K file): there the kernels multiply their quants by int8 rows byte
# by byte (64 products an instruction, where int16 activations take 32), as llama.cpp does with its q8_K
# activations, and the divergence stays below llama.cpp's on the same file (docs/BENCHMARKS.md, bench quant). The
# other builds keep int16 for them: AVX2's and NEON's int8 routes for these formats go block by block (on AVX2 2 to
# 5 times slower than their int16 routes; NEON's is not measured).
INT8_ACTIVATION_TYPES = frozenset({12, 14})
INT8_ACTIVATION_ISAS = frozenset({"avx512-vnni"})
# Kernels on which a speculative verify in one native call (spark_decode_rows) is measured to pay in greedy open chat
# (bench speculative, docs/BENCHMARKS.md): 1.07-1.26x on two AVX-512 VNNI CPUs, with AMX tiles or without. The AVX2
# build gave 1.01x (0.97-1.21 over repeats): no gain to count on. NEON is not measured on a Mac.
VERIFY_PAYS_ISAS = frozenset({"avx512-vnni"})


def activation_parts(ggml_ids: Sequence[int], isa: str) -> int:
    """QMat.act_parts for a matrix whose parts are in these block formats, on kernels of `isa`: 1 (int8) where
    every part is one of INT8_ACTIVATION_TYPES on one of INT8_ACTIVATION_ISAS, else 2 (int16): a fused matrix's
    parts share one quantization of its input."""
    return 1 if isa in INT8_ACTIVATION_ISAS and all(i in INT8_ACTIVATION_TYPES for i in ggml_ids) else 2


def activation_numerics(act_parts: Collection[int]) -> str:
    """The label of the activation formats (QMat.act_parts) a model's matrices take, for a backend's numerics string
    (which keys the disk prefix cache): "a8" llama.cpp's int8 blocks everywhere; "a16i" int16 blocks with one scale
    everywhere (which replaced two int8 parts, "a16", computing slightly different bits); "a16ik8" both, by format
    (activation_parts): the Q4_K and Q6_K matrices' bits changed when they moved to int8, so caches written before
    are not reused."""
    return "a8" if set(act_parts) == {1} else "a16i" if set(act_parts) <= {2} else "a16ik8"


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library: `lib` with typed entry points, and the instruction set its dot products use."""

    lib: ctypes.CDLL
    isa: str
    max_head_dim: int

    def use_threads(self, n: int) -> int:
        """Size the library's persistent thread pool (the caller counts as one); cheap when unchanged."""
        return int(self.lib.spark_set_threads(max(1, n)))

    def use_amx(self, use: bool) -> bool:
        """Let the products of a few or many rows use AMX tiles where the CPU has them (the default) or not (to
        compare routes: their bits are the same); returns whether they now do."""
        return bool(self.lib.spark_use_amx(1 if use else 0))


@dataclass(frozen=True)
class NativeStatus:
    """What `load_kernels` found: the kernels, or None and one sentence saying why not."""

    kernels: NativeKernels | None
    reason: str


def _compiler() -> str | None:
    named = os.environ.get(COMPILER_ENV)
    if named:
        return shutil.which(named)
    for name in ("cc", "clang", "gcc"):
        found = shutil.which(name)
        if found:
            return found
    return None


def compile_flags(portable: bool = False) -> list[str]:
    """Optimise for this very CPU (the library is built where it runs), or with `portable` for any CPU of the
    family that a packaged app may meet: x86-64-v3 (AVX2, 2015 on), Armv8.2 with the dot-product instructions."""
    arm = platform.machine().lower() in ("arm64", "aarch64")
    if arm and sys.platform == "darwin":
        tune = ["-mcpu=apple-m1"]  # every Apple Silicon core has the int8 dot-product instructions: portable as is
    elif arm:
        tune = ["-march=armv8.2-a+dotprod"] if portable else ["-mcpu=native"]
    else:
        tune = ["-march=x86-64-v3"] if portable else ["-march=native"]
    shared = ["-dynamiclib"] if sys.platform == "darwin" else ["-shared"]
    # No fused multiply-add contraction: products round as PyTorch's do, so a key the kernel rotates equals the
    # one PyTorch would (the slot table's read copies are compared exactly) and decode and prefill agree bit for bit.
    # libm never needs to set errno here, and without it the compiler inlines and vectorizes sqrtf and lrintf.
    return ["-O3", "-std=gnu11", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-math-errno", *tune, *shared]


def _compiler_identity(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else cc
    except (OSError, subprocess.SubprocessError):
        return cc


def source_files() -> list[Path]:
    """Every file the library is built from (C sources and headers, in every instruction-set folder): its identity."""
    return sorted(p for p in NATIVE_DIR.rglob("*") if p.suffix in (".c", ".h") and p.is_file())


def library_path(cache_root: Path, cc: str, flags: Sequence[str]) -> Path:
    """Where the library for these sources, compiler, flags and machine lives in the cache."""
    sources = [f"{p.relative_to(NATIVE_DIR).as_posix()}\n{p.read_text()}" for p in source_files()]
    ident = "|".join([*sources, _compiler_identity(cc), " ".join(flags), platform.machine(), sys.platform])
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    suffix = ".dylib" if sys.platform == "darwin" else ".so"
    return cache_root / "native" / f"spark_kernels-{digest}{suffix}"


def build_library(cache_root: Path | None = None, extra_flags: Sequence[str] = (), portable: bool = False) -> Path:
    """Compile the kernels into the cache (once) and return the library's path. Raises RuntimeError with a
    sentence naming what is missing or what the compiler said. `extra_flags` follow the tuning flags (e.g.
    -mno-avx512f builds the AVX2 kernel on an AVX-512 machine, which the tests compare); `portable` builds for
    distribution (packaging/spark.spec) instead of for this CPU."""
    cc = _compiler()
    if cc is None:
        hint = (
            "install the Xcode Command Line Tools (xcode-select --install)"
            if sys.platform == "darwin"
            else "install a C compiler (gcc or clang)"
        )
        raise RuntimeError(f"no C compiler was found; {hint} to enable the native CPU kernels")
    flags = [*compile_flags(portable), *extra_flags]
    out = library_path(cache_root or default_cache_dir(), cc, flags)
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process or an interrupted build never leaves half a file.
    with atomic_path(out, prefix=out.stem + "-", suffix=out.suffix) as tmp:
        done = subprocess.run(
            [cc, *flags, *map(str, SOURCES), "-o", str(tmp), "-lm"], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
            raise RuntimeError(f"the native CPU kernels did not compile with {cc}: {first}")
    return out


# Each ABI struct's ctypes mirror, by the name of its size export (spark_sizeof_<name>) in spark_kernels.h.
MIRRORS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("qmat", QMat),
    ("model", ModelDesc),
    ("cache", CacheDesc),
    ("step", StepDesc),
    ("attn", AttnDesc),
)


def check_mirrors(lib: ctypes.CDLL) -> None:
    """Raise RuntimeError, in one sentence, where a struct's size in the library differs from its ctypes mirror's
    (a field added or changed on one side only): every call would misread it."""
    for name, mirror in MIRRORS:
        try:
            size_of = getattr(lib, f"spark_sizeof_{name}")
        except AttributeError:
            raise RuntimeError(
                f"the native kernels library exports no spark_sizeof_{name}: it was built from another version"
            ) from None
        size_of.restype = ctypes.c_int64
        size_of.argtypes = []
        size, mirrored = int(size_of()), ctypes.sizeof(mirror)
        if size != mirrored:
            raise RuntimeError(
                f"the native kernels' spark_{name} is {size} bytes but its ctypes mirror {mirror.__name__} is "
                f"{mirrored}: spark_kernels.h and engine/backends/native/__init__.py disagree"
            )


def bind(path: Path) -> NativeKernels:
    """Load a built library, check its structs against their mirrors and declare its entry points."""
    lib = ctypes.CDLL(str(path))
    check_mirrors(lib)
    lib.spark_isa.restype = ctypes.c_char_p
    lib.spark_max_head_dim.restype = ctypes.c_int32
    lib.spark_max_threads.restype = ctypes.c_int32
    lib.spark_set_threads.restype = ctypes.c_int32
    lib.spark_set_threads.argtypes = [ctypes.c_int32]
    lib.spark_threads.restype = ctypes.c_int32
    lib.spark_use_amx.restype = ctypes.c_int32
    lib.spark_use_amx.argtypes = [ctypes.c_int32]
    lib.spark_block_bytes.restype = ctypes.c_int32
    lib.spark_block_bytes.argtypes = [ctypes.c_int32]
    lib.spark_act_bytes.restype = ctypes.c_int64
    lib.spark_act_bytes.argtypes = [ctypes.c_int32, ctypes.c_int32]
    lib.spark_qgemm.restype = None
    lib.spark_qgemm.argtypes = [ctypes.POINTER(QMat), ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]
    lib.spark_dequant_rows.restype = ctypes.c_int32
    lib.spark_dequant_rows.argtypes = [ctypes.POINTER(QMat), ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p]
    lib.spark_decode_scratch_floats.restype = ctypes.c_int64
    lib.spark_decode_scratch_floats.argtypes = [ctypes.POINTER(ModelDesc)]
    lib.spark_attend_floats.restype = ctypes.c_int64
    lib.spark_attend_floats.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    lib.spark_attend.restype = None
    lib.spark_attend.argtypes = [ctypes.POINTER(AttnDesc)]
    lib.spark_decode.restype = None
    lib.spark_decode.argtypes = [
        ctypes.POINTER(ModelDesc),
        ctypes.POINTER(CacheDesc),
        ctypes.POINTER(StepDesc),
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.spark_decode_rows_scratch_floats.restype = ctypes.c_int64
    lib.spark_decode_rows_scratch_floats.argtypes = [ctypes.POINTER(ModelDesc), ctypes.c_int32]
    lib.spark_decode_rows.restype = ctypes.c_int32
    lib.spark_decode_rows.argtypes = [
        ctypes.POINTER(ModelDesc),
        ctypes.POINTER(CacheDesc),
        ctypes.POINTER(StepDesc),  # (T,) one per token
        ctypes.c_int32,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    return NativeKernels(lib, lib.spark_isa().decode(), int(lib.spark_max_head_dim()))


def load_kernels() -> NativeStatus:
    """Build (first time) and load the native kernels for this process; None with the reason when unavailable."""
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return NativeStatus(None, f"the native CPU kernels are turned off ({DISABLE_ENV} is set)")
    return _load()


def bundled_library() -> Path | None:
    """The library a packaged app ships (built by packaging/spark.spec), which needs no compiler on the Mac."""
    root = bundle_root()
    if root is None:
        return None
    found = sorted((root / BUNDLED_DIR).glob("spark_kernels-*"))
    return found[0] if found else None


@cache  # one build and one loaded library per process
def _load() -> NativeStatus:
    try:
        kernels = bind(bundled_library() or build_library())
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return NativeStatus(None, str(exc))
    return NativeStatus(kernels, f"native CPU kernels ({kernels.isa})")
