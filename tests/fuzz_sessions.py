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

import random
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

from tests.helpers import fuzz_campaign as campaign

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


def main(argv: list[str] | None = None) -> int:
    args = campaign.parse_args(
        "python -m tests.fuzz_sessions", __doc__ or "", argv, files=10_000, time_limit=20.0, memory_cap_mb=1024
    )

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
    pool = campaign.WorkerPool(args.workers, _worker, (str(world.model), str(root / "l3"), args.memory_cap_mb << 20))
    before = campaign.files_outside(root, ("l3", "files"))
    try:
        results = pool.run(files, args.time_limit)
    finally:
        pool.close()
    changed = sorted(p for p, _ in set(campaign.files_outside(root, ("l3", "files")).items()) ^ set(before.items()))
    return campaign.report(
        f"{len(results)} mutated session files (seed {args.seed}; made in {made:.0f} s, "
        f"checked in {time.monotonic() - started - made:.0f} s, {args.workers} workers, "
        f"{args.time_limit:g} s and +{args.memory_cap_mb} MB per file)",
        OUTCOMES,
        2,
        results,
        changed,
        "the stores",
    )


if __name__ == "__main__":
    sys.exit(main())
