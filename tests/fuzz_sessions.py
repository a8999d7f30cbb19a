"""`make fuzz`: mutated `.spark` files through `session verify` (with the model) and restore, at scale.

    python -m tests.fuzz_sessions [--files 10000] [--seed 0] [--workers 2] [--time-limit 20] [--memory-cap-mb 1024]

Each file is a schema-aware mutation of a real cascade session on a tiny model (tests/engine/session/session_fuzzing.py).
Worker processes run verify, then restore into a fresh memory over a persistent store, then spill and generate one
token; each runs under an address-space cap, and a file that takes longer than the time limit has its worker
killed. Outcomes, printed as a table:

    clean rejection   verify and restore both refused it with one SessionFileError sentence
    accepted          verify passed, restore succeeded, the memory spilled and generated a finite step
    traceback         any other exception, or verify and restore disagreeing (a verify-OK file that fails restore)
    hang              past the per-file time limit
    over memory cap   MemoryError, or the worker died (the kernel's answer to an allocation past the cap)

The goal is only the first two. Exit status 0 when that holds, 1 otherwise.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

OUTCOMES = ("clean rejection", "accepted", "traceback", "hang", "over memory cap")


def _worker(conn: Connection, model: str, store_root: str, cap: int) -> None:
    """Runs in a spawned process: answers (path) with (outcome, detail) until the pipe closes."""
    import torch

    torch.set_num_threads(1)
    from engine.backends.torch_backend import TorchBackend
    from engine.errors import SessionFileError
    from engine.memory.cascade import CascadeMemory, PersistentStore
    from engine.session.file import RestoredSession, restore, verify_session
    from tests.engine.session.session_fuzzing import CONFIG, memory_cap

    stores = [
        PersistentStore(Path(store_root) / str(i), TorchBackend(model, "cpu").fingerprint, "cpu-fp32", 1 << 30)
        for i in range(2)
    ]
    fingerprint = TorchBackend(model, "cpu").fingerprint
    target = CascadeMemory(TorchBackend(model, "cpu"), CONFIG).state_target()
    with memory_cap(cap):
        while True:
            try:
                path = conn.recv()
            except EOFError:
                return
            try:
                try:
                    verify_session(path, target, fingerprint)
                    verified = True
                except SessionFileError as exc:
                    verified = False
                    one_line = "\n" not in str(exc) and str(exc).endswith(".")
                backend = TorchBackend(model, "cpu")
                store = stores[random.randrange(2)]
                try:
                    outcome = restore(path, backend, lambda b, store=store: CascadeMemory(b, CONFIG, store=store))
                except SessionFileError as exc:
                    if verified:
                        conn.send(("traceback", f"verify passed, restore refused: {exc}"))
                    elif not (one_line and "\n" not in str(exc)):
                        conn.send(("traceback", f"not one sentence: {exc}"))
                    else:
                        conn.send(("clean rejection", ""))
                    continue
                if not verified:
                    conn.send(("traceback", f"verify refused a file restore accepted ({type(outcome).__name__})"))
                    continue
                if not isinstance(outcome, RestoredSession):  # another model's file: its transcript only, as designed
                    conn.send(("accepted", "transcript only"))
                    continue
                memory = outcome.memory
                memory.spill()
                plan = memory.plan([outcome.data.pending_token or 1])
                logits = backend.forward(
                    torch.tensor([[outcome.data.pending_token or 1]]), plan.as_batch(), last_only=True
                )
                memory.after_forward()
                conn.send(
                    ("accepted", "")
                    if bool(torch.isfinite(logits).all())
                    else ("traceback", "non-finite logits after restore")
                )
            except MemoryError:
                conn.send(("over memory cap", "MemoryError"))
            except Exception as exc:
                site = traceback.extract_tb(exc.__traceback__)[-1]
                conn.send(
                    ("traceback", f"{type(exc).__name__} at {Path(site.filename).name}:{site.lineno}: {str(exc)[:120]}")
                )


class _Pool:
    """Worker processes, each answering one file at a time; a hung or dead worker is replaced."""

    def __init__(self, n: int, args: tuple, target: Callable[..., None] | None = None) -> None:
        self.ctx = mp.get_context("spawn")
        self.args = args
        self.target = target or _worker
        self.workers = [self._start() for _ in range(n)]

    def _start(self) -> tuple[mp.process.BaseProcess, Connection]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(
        self, files: list[tuple[Path, str]], time_limit: float, startup: float = 180.0
    ) -> list[tuple[str, str, str]]:
        results: list[tuple[str, str, str]] = []
        pending = list(reversed(files))
        busy: dict[int, tuple[Path, str, float]] = {}
        fresh = set(range(len(self.workers)))  # still importing torch: the first file's clock starts later
        while pending or busy:
            for i, (_proc, conn) in enumerate(self.workers):
                if i not in busy and pending:
                    path, what = pending.pop()
                    conn.send(str(path))
                    busy[i] = (path, what, time.monotonic() + (startup if i in fresh else time_limit))
            for i in list(busy):
                proc, conn = self.workers[i]
                path, what, deadline = busy[i]
                if conn.poll(0.01):
                    try:
                        outcome, detail = conn.recv()
                    except (EOFError, OSError):
                        outcome, detail = "over memory cap", f"worker died (exit {proc.exitcode})"
                        self._replace(i)
                    fresh.discard(i)
                    results.append((outcome, what, detail))
                    del busy[i]
                elif not proc.is_alive():
                    results.append(("over memory cap", what, f"worker died (exit {proc.exitcode})"))
                    self._replace(i)
                    fresh.add(i)
                    del busy[i]
                elif time.monotonic() > deadline:
                    results.append(("hang", what, f"over {time_limit:g} s"))
                    self._replace(i)
                    fresh.add(i)
                    del busy[i]
        return results

    def _replace(self, i: int) -> None:
        proc, conn = self.workers[i]
        proc.kill()
        proc.join()
        conn.close()
        self.workers[i] = self._start()

    def close(self) -> None:
        for proc, conn in self.workers:
            conn.close()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz_sessions", description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds per file")
    parser.add_argument("--memory-cap-mb", type=int, default=1024, help="address space a worker may add per file")
    args = parser.parse_args(argv)

    from tests.engine.session.session_fuzzing import World, mutated_file

    root = Path(tempfile.mkdtemp(prefix="spark-fuzz-"))
    started = time.monotonic()
    world = World(root / "world")
    files = []
    for i in range(args.files):
        path = root / "files" / f"{i:05d}.spark"
        path.parent.mkdir(exist_ok=True)
        files.append((path, mutated_file(world, random.Random(args.seed * 1_000_003 + i), path)))
    made = time.monotonic() - started
    pool = _Pool(args.workers, (str(world.model), str(root / "l3"), args.memory_cap_mb << 20))
    before = _outside_the_store(root)
    try:
        results = pool.run(files, args.time_limit)
    finally:
        pool.close()
    changed = sorted(set(_outside_the_store(root).items()) ^ set(before.items()))
    counts = Counter(outcome for outcome, _, _ in results)
    print(
        f"{len(results)} mutated session files (seed {args.seed}; made in {made:.0f} s, checked in {time.monotonic() - started - made:.0f} s, "
        f"{args.workers} workers, {args.time_limit:g} s and +{args.memory_cap_mb} MB per file)"
    )
    print(f"{'outcome':<18}{'files':>8}")
    for outcome in OUTCOMES:
        print(f"{outcome:<18}{counts[outcome]:>8}")
    defects = Counter((outcome, detail) for outcome, _, detail in results if outcome not in OUTCOMES[:2])
    example = {(outcome, detail): what for outcome, what, detail in results}
    for (outcome, detail), n in defects.most_common(20):
        print(f"  {n:>5} x {outcome}: {detail} (e.g. {example[outcome, detail]})")
    print(f"files written outside the stores: {len(changed)}" + "".join(f"\n  {p}" for p, _ in changed[:10]))
    by_kind = Counter((what.split(":")[0], outcome) for outcome, what, _ in results)
    print("by mutation: " + ", ".join(f"{k}/{o} {n}" for (k, o), n in sorted(by_kind.items())))
    return 0 if not defects and not changed else 1


def _outside_the_store(root: Path) -> dict[str, int]:
    """Every file under the fuzz folder but the stores and the mutated files themselves, with its mtime."""
    return {
        str(p): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] not in ("l3", "files")
    }


if __name__ == "__main__":
    sys.exit(main())
