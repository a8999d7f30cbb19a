"""What to download on this computer: which catalog models fit its memory, which its processors run at a
conversational pace, which to pick first.

- fits: the model's memory at 4k tokens (weights + KV + runtime, from the catalog) within the budget — three
  quarters of the machine's memory, since the system, the app and the user's other programs keep the rest (Metal's
  default working-set limit on Apple silicon is about the same share);
- speed: decoding reads every weight once per token, so tokens/s ≈ the bytes a second this computer reads through
  its weights ÷ the file's weight bytes. Where the app has measured the loaded model (its weight bytes × its decode
  tokens/s, a model big enough for the figure to be about reading weights), that rate is this computer's; otherwise
  it is estimated from its processors: per CPU thread the decoding threads' rate measured on a 1B Q4_K_M (SPR,
  1 thread: 800 MB × 10.9 tokens/s), up to the two-core streaming read measured on EPYC (31 GB/s), and with a graphics
  processor or Neural Engine (Core ML, MPS, CUDA) the rate that put 6 GB of weights at a conversational pace;
- runs well: it also fits at 32k tokens and decodes at CONVERSATIONAL_TOKENS_PER_S or faster; slow: it fits but
  decodes under SLOW_TOKENS_PER_S, which reads as stalling;
- pick first: the largest model that runs well (catalog order breaks ties); failing that, the fastest that fits
  without being slow. Nothing slow is ever the pick.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.library.catalog import Catalog, CatalogFile, CatalogModel, catalog_entry_json

BUDGET_SHARE = 0.75
CONVERSATIONAL_TOKENS_PER_S = 10.0  # faster than people read: the reply never seems to wait
SLOW_TOKENS_PER_S = 3.0  # under this a reply visibly stalls between words
CPU_BYTES_PER_S_PER_THREAD = 8.7e9  # docs/BENCHMARKS.md: the 1B's Q4_K_M decode, 1 thread on SPR (0.8 GB × 10.9/s)
CPU_BYTES_PER_S_MAX = 31e9  # docs/BENCHMARKS.md: both EPYC cores streaming (and the 1B's 2-thread decode) reach this
ACCELERATED_BYTES_PER_S = 60e9  # 6 GB of weights at CONVERSATIONAL_TOKENS_PER_S, the rule for accelerated machines
MEASURED_MIN_BYTES = 256 << 20  # a smaller model's tokens/s is about per-token overhead, not reading weights
UNKNOWN_CORES = 4
ACCELERATORS = ("coreml", "mps", "cuda")


class Fit(enum.Enum):
    RUNS_WELL = "runs_well"
    FITS = "fits"
    SLOW = "slow"  # fits the memory, but its processors decode it too slowly to chat
    TOO_BIG = "too_big"


@dataclass(frozen=True)
class Measured:
    """The loaded model's decoding on this computer: its weight bytes and the tokens a second it decoded."""

    weight_bytes: int
    tokens_per_s: float


@dataclass(frozen=True)
class Machine:
    total_bytes: int
    backends: tuple[str, ...]  # those available here
    threads: int | None = None  # the decoding threads this computer gives a model (None: not known)
    measured: Measured | None = None

    @property
    def accelerated(self) -> bool:
        return any(b in ACCELERATORS for b in self.backends)

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * BUDGET_SHARE)

    @property
    def bytes_per_s(self) -> float:
        """How fast this computer reads a model's weights while decoding (measured where it can be)."""
        m = self.measured
        if m is not None and m.weight_bytes >= MEASURED_MIN_BYTES and m.tokens_per_s > 0:
            return m.weight_bytes * m.tokens_per_s
        if self.accelerated:
            return ACCELERATED_BYTES_PER_S
        threads = self.threads or UNKNOWN_CORES - 1
        return min(CPU_BYTES_PER_S_MAX, CPU_BYTES_PER_S_PER_THREAD * max(1, threads))

    def tokens_per_s(self, weight_bytes: int) -> float:
        return self.bytes_per_s / max(1, weight_bytes)

    @property
    def processors(self) -> str:
        """Its processors in words: "4 CPU threads and a graphics processor"."""
        threads = f"{self.threads} CPU thread{'s' if self.threads != 1 else ''}" if self.threads else "its CPU"
        extra = [
            w
            for b, w in (
                ("coreml", "the Neural Engine"),
                ("mps", "a graphics processor"),
                ("cuda", "a CUDA graphics card"),
            )
            if b in self.backends
        ]
        return " and ".join([threads, *extra[:1]]) if len(extra) <= 1 else f"{threads}, {', '.join(extra)}"


@dataclass(frozen=True)
class Recommendation:
    model: CatalogModel
    file: CatalogFile
    fit: Fit
    first_pick: bool
    tokens_per_s: float  # the estimated decoding speed here

    def as_json(self) -> dict[str, Any]:
        return {
            **catalog_entry_json(self.model, self.file.quantization),
            "fit": self.fit.value,
            "fits": self.fit is not Fit.TOO_BIG,
            "first_pick": self.first_pick,
            "tokens_per_s_estimate": round(self.tokens_per_s, 1),
        }


def this_machine(measured: Measured | None = None) -> Machine:
    """Memory, decoding threads and available backends, from engine.hw and the backend probes; `measured`: the loaded
    model's decoding, where the caller has it."""
    from engine.backends import probe_all
    from engine.hw import SystemMemorySource
    from engine.hw.chip import default_chip_source, recommended_threads

    total = SystemMemorySource().snapshot().total_bytes
    chip = default_chip_source().read()
    threads = recommended_threads(chip) if chip.cores else None
    backends = tuple(name for name, probe in probe_all().items() if probe.available)
    return Machine(total, backends, threads, measured)


def _fit(f: CatalogFile, machine: Machine) -> Fit:
    if f.memory_4k_bytes > machine.budget_bytes:
        return Fit.TOO_BIG
    speed = machine.tokens_per_s(f.size_bytes)
    if speed < SLOW_TOKENS_PER_S:
        return Fit.SLOW
    if f.memory_32k_bytes <= machine.budget_bytes and speed >= CONVERSATIONAL_TOKENS_PER_S:
        return Fit.RUNS_WELL
    return Fit.FITS


def recommend(catalog: Catalog, machine: Machine) -> list[Recommendation]:
    """One recommendation per downloadable catalog model (its default file, or a smaller one that fits better)."""
    rows: list[tuple[CatalogModel, CatalogFile, Fit]] = []
    for model in catalog.models:
        if model.bundled:
            continue
        best = model.file()
        fit = _fit(best, machine)
        for f in sorted(model.files, key=lambda f: f.size_bytes):
            if _rank(_fit(f, machine)) > _rank(fit):
                best, fit = f, _fit(f, machine)
        rows.append((model, best, fit))
    # The first pick is a chat model: a vision model is listed with its fit, for whoever wants pictures.
    well = [r for r in rows if r[2] is Fit.RUNS_WELL and not r[0].vision]
    fits = [r for r in rows if r[2] is Fit.FITS and not r[0].vision]
    if well:
        pick = max(well, key=lambda r: (r[0].parameters, -rows.index(r)))
    elif fits:
        pick = min(fits, key=lambda r: r[1].size_bytes)  # the fastest
    else:
        pick = None
    return [Recommendation(m, f, fit, (m, f, fit) == pick, machine.tokens_per_s(f.size_bytes)) for m, f, fit in rows]


def _rank(fit: Fit) -> int:
    return {Fit.TOO_BIG: 0, Fit.SLOW: 1, Fit.FITS: 2, Fit.RUNS_WELL: 3}[fit]
