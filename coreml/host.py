"""The host side of a converted package, shared by the Core ML runtime and the reference interpreter.

`PackageBackend` implements the engine's Backend protocol over "something that runs a package function against
a per-row state": it splits each step into calls of the package's fixed chunk sizes, computes the RoPE tables and
the additive mask, reassembles the split LM head, and maps read_kv / write_kv onto the (L, Hkv, S, D) states,
which are already the canonical KV layout.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from coreml.convert import REQUIRED_PROVENANCE, STATE_NAMES
from coreml.errors import PackageError
from coreml.wrapper import MASK_MIN
from engine.backends.base import CANONICAL_KV_DTYPE, Backend
from engine.config import ModelConfig
from engine.model import SlotBatch, rope_inv_freq


@dataclass(frozen=True)
class Call:
    """One function call: step rows [row0, row0 + size) written to slots [start, start + size)."""

    function: str
    row0: int
    size: int
    start: int


def plan_calls(write_slots: list[int], functions: dict[str, int]) -> list[Call]:
    """Split a step's write slots into contiguous runs, and each run greedily into the available chunk sizes.

    Runs execute in order, so a token attends before later runs of the same step are written. That matches the
    torch engine (which writes the whole step first) whenever no token may attend a slot written by a later token
    of the same step, which holds for every causal plan the cascade makes.
    """
    sizes = sorted(((t, n) for n, t in functions.items()), reverse=True)
    if not sizes or sizes[-1][0] != 1:
        raise PackageError("The package has no single-token function, so it cannot run an arbitrary step.")
    calls: list[Call] = []
    t = 0
    while t < len(write_slots):
        run = 1
        while t + run < len(write_slots) and write_slots[t + run] == write_slots[t] + run:
            run += 1
        at = 0
        while at < run:
            size, name = next((s, n) for s, n in sizes if s <= run - at)
            calls.append(Call(name, t + at, size, write_slots[t + at]))
            at += size
        t += run
    return calls


class RopeHost:
    """cos/sin of arbitrary positions, computed exactly as engine.model.RotaryTable does (fp32, then fp16)."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv = rope_inv_freq(config)  # (D/2,) fp32

    def __call__(self, positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """positions (N,) long -> cos, sin (N, D) fp16."""
        freqs = torch.outer(positions.to(torch.float32), self.inv)  # (N, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
        return emb.cos().to(torch.float16).numpy(), emb.sin().to(torch.float16).numpy()


def config_from_provenance(prov: dict[str, str]) -> ModelConfig:
    missing = [k for k in REQUIRED_PROVENANCE if k not in prov]
    if missing:
        raise PackageError(f"The package lacks MLoT Spark provenance ({missing[0]}); convert it with `python -m coreml convert`.")
    return ModelConfig.from_dict(json.loads(prov["config"]))


class PackageBackend(Backend):
    """Backend over a converted package; subclasses run functions and move state."""

    config: ModelConfig
    functions: dict[str, int]  # function name -> tokens per call
    vocab_pieces: list[tuple[int, int]]
    slots: int

    def _setup_host(self, prov: dict[str, str]) -> None:
        self.config = config_from_provenance(prov)
        self.fingerprint = prov["fingerprint"]
        self.functions = {k: int(v) for k, v in json.loads(prov["functions"]).items()}
        self.vocab_pieces = [tuple(p) for p in json.loads(prov["vocab_pieces"])]
        self.slots = int(prov["slots"])
        self.rope = RopeHost(self.config)

    # -------------------------------------------------------------- what a subclass provides
    @abstractmethod
    def _predict(self, row: int, function: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run `function` on row `row`'s state; returns the outputs (logits_i)."""

    @abstractmethod
    def _read_state(self, row: int, name: str) -> np.ndarray:
        """The whole state `name` of row `row`, (L, Hkv, S, D) fp16."""

    @abstractmethod
    def _write_state(self, row: int, name: str, value: np.ndarray) -> None: ...

    # -------------------------------------------------------------- Backend
    @property
    def num_slots(self) -> int:
        return self.slots

    def step_inputs(self, tokens: torch.Tensor, batch: SlotBatch, row: int, call: Call, k_rope: tuple[np.ndarray, np.ndarray]) -> dict[str, np.ndarray]:
        rows = slice(call.row0, call.row0 + call.size)
        q_cos, q_sin = self.rope(batch.positions[row, rows])  # (T, D) each
        mask = batch.mask[row, 0, rows].numpy()  # (T, S) bool
        return {
            "input_ids": tokens[row, rows].numpy().astype(np.int32)[None],  # (1, T)
            "q_cos": q_cos[None, None],  # (1, 1, T, D)
            "q_sin": q_sin[None, None],
            "k_cos": k_rope[0][None, None],  # (1, 1, S, D)
            "k_sin": k_rope[1][None, None],
            "mask": np.where(mask, 0.0, MASK_MIN).astype(np.float16)[None, None],  # (1, 1, T, S) additive
            "write_start": np.array([call.start], dtype=np.int32),  # (1,)
        }

    def forward(self, tokens: torch.Tensor, batch: SlotBatch, last_only: bool = False) -> torch.Tensor:
        b, t = tokens.shape
        if b != self.batch:
            raise ValueError(f"forward got {b} rows but the slot table has {self.batch}")
        live = batch.slot_positions.shape[-1]
        if live > self.slots:
            raise ValueError(f"the plan covers {live} slots but the package has {self.slots}")
        if live < self.slots:
            # Only the leading S' slots take part (SlotBatch); the fixed-shape program sees the rest masked off.
            pad = self.slots - live
            batch = SlotBatch(
                batch.positions,
                batch.write_slots,
                torch.nn.functional.pad(batch.slot_positions, (0, pad)),
                torch.nn.functional.pad(batch.mask, (0, pad), value=False),
            )
        rows_out = []
        for row in range(b):
            k_rope = self.rope(batch.slot_positions[row])  # (S, D) each, once per step
            calls = plan_calls(batch.write_slots[row].tolist(), self.functions)
            if last_only:
                calls_needed = calls[-1:]
                for call in calls[:-1]:
                    self._predict(row, call.function, self.step_inputs(tokens, batch, row, call, k_rope))
            else:
                calls_needed = calls
            pieces = []
            for call in calls_needed:
                out = self._predict(row, call.function, self.step_inputs(tokens, batch, row, call, k_rope))
                logits = np.concatenate([out[f"logits_{i}"] for i in range(len(self.vocab_pieces))], axis=-1)  # (1, T, V)
                pieces.append(logits[0])
            logits = np.concatenate(pieces, axis=0)  # (T or last call's T, V)
            rows_out.append(logits[-1:] if last_only else logits)
        return torch.from_numpy(np.stack(rows_out).astype(np.float32))  # (B, T, V) or (B, 1, V)

    def read_kv(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = slots.numpy()
        k, v = (torch.from_numpy(np.ascontiguousarray(self._read_state(row, n)[:, :, idx])) for n in STATE_NAMES)
        return k.to(CANONICAL_KV_DTYPE), v.to(CANONICAL_KV_DTYPE)  # (L, Hkv, n, D) each

    def write_kv(self, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        idx = slots.numpy()
        for name, new in zip(STATE_NAMES, (k, v)):
            state = self._read_state(row, name).copy()
            state[:, :, idx] = new.to(torch.float16).numpy()
            self._write_state(row, name, state)
