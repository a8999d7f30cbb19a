"""What to download on this machine: which catalog models fit its memory, which run well, which to pick first.

- fits: the model's memory at 4k tokens (weights + KV + runtime, from the catalog) within the budget — three
  quarters of the machine's memory, since macOS, the app and the user's other programs keep the rest (Metal's
  default working-set limit on Apple silicon is about the same share);
- runs well: it also fits at 32k tokens, and its weights are small enough to decode at a conversational pace —
  decoding reads every weight once per token, so speed is memory bandwidth ÷ weight bytes: up to 2.5 GB of weights
  on the CPU alone, 6 GB with an accelerator (Core ML, MPS or CUDA);
- pick first: the largest model that runs well (catalog order breaks ties); failing that, the smallest that fits.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.library.catalog import Catalog, CatalogFile, CatalogModel, catalog_entry_json

BUDGET_SHARE = 0.75
FAST_WEIGHTS_CPU = int(2.5 * (1 << 30))
FAST_WEIGHTS_ACCELERATED = 6 << 30
ACCELERATORS = ("coreml", "mps", "cuda")


class Fit(enum.Enum):
    RUNS_WELL = "runs_well"
    FITS = "fits"
    TOO_BIG = "too_big"


@dataclass(frozen=True)
class Machine:
    total_bytes: int
    backends: tuple[str, ...]  # those available here

    @property
    def accelerated(self) -> bool:
        return any(b in ACCELERATORS for b in self.backends)

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * BUDGET_SHARE)


@dataclass(frozen=True)
class Recommendation:
    model: CatalogModel
    file: CatalogFile
    fit: Fit
    first_pick: bool

    def as_json(self) -> dict[str, Any]:
        return {
            **catalog_entry_json(self.model, self.file.quantization),
            "fit": self.fit.value,
            "fits": self.fit is not Fit.TOO_BIG,
            "first_pick": self.first_pick,
        }


def this_machine() -> Machine:
    """Memory and available backends, from engine.hw and the backend probes."""
    from engine.backends import probe_all
    from engine.hw import SystemMemorySource

    total = SystemMemorySource().snapshot().total_bytes
    return Machine(total, tuple(name for name, probe in probe_all().items() if probe.available))


def _fit(f: CatalogFile, machine: Machine) -> Fit:
    if f.memory_4k_bytes > machine.budget_bytes:
        return Fit.TOO_BIG
    fast = FAST_WEIGHTS_ACCELERATED if machine.accelerated else FAST_WEIGHTS_CPU
    if f.memory_32k_bytes <= machine.budget_bytes and f.size_bytes <= fast:
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
    well = [r for r in rows if r[2] is Fit.RUNS_WELL]
    fits = [r for r in rows if r[2] is Fit.FITS]
    if well:
        pick = max(well, key=lambda r: (r[0].parameters, -rows.index(r)))
    elif fits:
        pick = min(fits, key=lambda r: r[1].memory_4k_bytes)
    else:
        pick = None
    return [Recommendation(m, f, fit, (m, f, fit) == pick) for m, f, fit in rows]


def _rank(fit: Fit) -> int:
    return {Fit.TOO_BIG: 0, Fit.FITS: 1, Fit.RUNS_WELL: 2}[fit]
