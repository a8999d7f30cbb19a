"""`make fuzz`: mutated GGUF files through `validate_gguf` and, when it accepts one, a real load and a reply.

    python -m tests.fuzz_models [--files 2000] [--seed 0] [--workers 2] [--time-limit 120] [--memory-cap-mb 3072]

Each file is a structure-aware mutation of the default model's GGUF (tests/engine/loading/gguf_fuzzing.py), its
tensor data kept. Worker processes run `engine.loading.validate.validate_gguf`; a file it accepts is loaded on the
CPU backend and answers one greedy chat turn of two tokens. Each runs under an address-space cap, and a file that
takes longer than the time limit has its worker killed. Outcomes, printed as a table:

    clean refusal     validate_gguf refused it with one SparkError sentence
    loaded            validate_gguf accepted it, and it loaded and answered with finite logits
    missed            validate_gguf accepted it but loading or the reply refused it (validation is incomplete)
    traceback         any other exception, or a refusal that is not one sentence
    hang              past the per-file time limit
    over memory cap   MemoryError, or the worker died (the kernel's answer to an allocation past the cap)

Files written anywhere under the run's folder but its cache and the mutated files themselves are counted too. The
goal is only the first two outcomes and no such writes. Exit status 0 when that holds, 1 otherwise.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path

from tests.helpers import fuzz_campaign as campaign

OUTCOMES = ("clean refusal", "loaded", "missed", "traceback", "hang", "over memory cap")


def _one_sentence(exc: BaseException) -> bool:
    text = str(exc)
    return bool(text) and "\n" not in text and len(text) <= 600 and text.rstrip().endswith((".", "?", "!"))


def _worker(conn: Connection, cache: str, cap: int) -> None:
    """Runs in a spawned process: answers (path) with (outcome, detail) until the pipe closes."""
    os.environ["MLOT_SPARK_CACHE_DIR"] = cache
    os.environ["MLOT_SPARK_DATA_DIR"] = cache
    import torch

    torch.set_num_threads(1)
    import engine
    from engine.errors import SparkError
    from engine.loading.validate import validate_gguf
    from tests.engine.session.session_fuzzing import memory_cap

    with memory_cap(cap):
        while True:
            try:
                path = conn.recv()
            except EOFError:
                return
            eng = session = None
            _forget()  # the previous file's mapping and model: each file starts from the same address space
            try:
                try:
                    validate_gguf(path)
                except SparkError as exc:
                    conn.send(
                        ("clean refusal", "") if _one_sentence(exc) else ("traceback", f"not one sentence: {exc}")
                    )
                    continue
                try:
                    eng = engine.load(path, "cpu", cache_dir=Path(cache), prefix_cache=False)
                    session = eng.new_session()
                    text = "".join(
                        e.text
                        for e in session.chat(
                            "Hi", engine.GenerationSettings(max_tokens=2, sampling=engine.SamplingSettings(greedy=True))
                        )
                    )
                except SparkError as exc:
                    conn.send(("missed", f"{type(exc).__name__}: {str(exc)[:160]}"))
                    continue
                conn.send(("loaded", f"{len(text)} characters"))
            except MemoryError:
                conn.send(("over memory cap", "MemoryError"))
            except Exception as exc:
                if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):  # torch's allocator
                    conn.send(("over memory cap", f"RuntimeError: {str(exc)[:120]}"))
                    continue
                site = traceback.extract_tb(exc.__traceback__)[-1]
                conn.send(
                    ("traceback", f"{type(exc).__name__} at {Path(site.filename).name}:{site.lineno}: {str(exc)[:120]}")
                )


def _forget() -> None:
    import gc

    from engine.loading.model_files import _open_gguf

    _open_gguf.cache_clear()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    args = campaign.parse_args(
        "python -m tests.fuzz_models", __doc__ or "", argv, files=2_000, time_limit=120.0, memory_cap_mb=3072
    )

    from engine.loading.model_files import default_model_path
    from tests.engine.loading.gguf_fuzzing import Seed, mutated_file

    root = Path(tempfile.mkdtemp(prefix="spark-fuzz-models-"))
    (root / "files").mkdir()
    seed = Seed.read(default_model_path())
    started = time.monotonic()
    pool = campaign.WorkerPool(args.workers, _worker, (str(root / "cache"), args.memory_cap_mb << 20))
    before = campaign.files_outside(root, ("cache", "files"))
    results: list[campaign.Result] = []
    batch = 4 * max(1, args.workers)

    def make(start: int) -> list[tuple[Path, str]]:
        files = []
        for i in range(start, min(args.files, start + batch)):
            path = root / "files" / f"{i:05d}.gguf"
            files.append((path, mutated_file(seed, random.Random(args.seed * 1_000_003 + i), path)))
        return files

    try:
        # Files are made a batch ahead on a thread (each keeps the model's ~100 MB of tensors), removed once checked.
        with ThreadPoolExecutor(1) as maker:
            upcoming = maker.submit(make, 0)
            for start in range(0, args.files, batch):
                files = upcoming.result()
                if start + batch < args.files:
                    upcoming = maker.submit(make, start + batch)
                checked = pool.run(files, args.time_limit)
                for outcome, what, detail in checked:
                    if outcome not in OUTCOMES[:2]:  # each defect as it happens: a long run can be read while it runs
                        print(f"  {outcome}: {detail} ({what})", file=sys.stderr, flush=True)
                results += checked
                for path, _ in files:
                    path.unlink(missing_ok=True)
                if len(results) // 100 > (len(results) - len(checked)) // 100:
                    so_far = Counter(outcome for outcome, _, _ in results)
                    print(
                        f"  {len(results)} files, {time.monotonic() - started:.0f} s: "
                        + ", ".join(f"{o} {so_far[o]}" for o in OUTCOMES),
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        pool.close()
    changed = sorted(p for p, _ in set(campaign.files_outside(root, ("cache", "files")).items()) ^ set(before.items()))
    shutil.rmtree(root, ignore_errors=True)
    return campaign.report(
        f"{len(results)} mutated GGUF files of the default model (seed {args.seed}; "
        f"{time.monotonic() - started:.0f} s, {args.workers} workers, {args.time_limit:g} s and "
        f"+{args.memory_cap_mb} MB per file)",
        OUTCOMES,
        2,
        results,
        changed,
        "the cache",
    )


if __name__ == "__main__":
    sys.exit(main())
