"""The harness both `make fuzz` campaigns share (tests/fuzz_sessions.py, tests/fuzz_models.py): their command line,
a pool of capped worker processes that replaces a hung or dead worker, the check for files written where none
should be, and the printed table of outcomes."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

#: (outcome, what the file was, detail) — one per checked file.
Result = tuple[str, str, str]


@dataclass(frozen=True)
class CampaignArgs:
    files: int
    seed: int
    workers: int
    time_limit: float
    memory_cap_mb: int


def parse_args(
    prog: str, doc: str, argv: list[str] | None, *, files: int, time_limit: float, memory_cap_mb: int
) -> CampaignArgs:
    """The campaign's command line, with its own defaults."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--files", type=int, default=files)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=time_limit, help="seconds per file")
    parser.add_argument(
        "--memory-cap-mb", type=int, default=memory_cap_mb, help="address space a worker may add per file"
    )
    args = parser.parse_args(argv)
    return CampaignArgs(args.files, args.seed, args.workers, args.time_limit, args.memory_cap_mb)


class WorkerPool:
    """Worker processes, each answering one file at a time; a hung or dead worker is replaced.

    `target(conn, *args)` runs in a spawned process and answers each path it receives with (outcome, detail).
    """

    def __init__(self, n: int, target: Callable[..., None], args: tuple[object, ...]) -> None:
        self.ctx = mp.get_context("spawn")
        self.target = target
        self.args = args
        self.workers = [self._start() for _ in range(n)]

    def _start(self) -> tuple[mp.process.BaseProcess, Connection]:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=self.target, args=(child, *self.args), daemon=True)
        proc.start()
        child.close()
        return proc, parent

    def run(self, files: list[tuple[Path, str]], time_limit: float, startup: float = 180.0) -> list[Result]:
        results: list[Result] = []
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


def files_outside(root: Path, allowed: tuple[str, ...]) -> dict[str, int]:
    """Every file under `root` but those in its top-level folders `allowed`, with its mtime."""
    return {
        str(p): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and p.relative_to(root).parts[0] not in allowed
    }


def report(
    headline: str, outcomes: tuple[str, ...], good: int, results: list[Result], changed: list[str], where: str
) -> int:
    """Prints the table; 0 when every outcome is one of the first `good` and nothing was written outside `where`."""
    counts = Counter(outcome for outcome, _, _ in results)
    print(headline)
    print(f"{'outcome':<18}{'files':>8}")
    for outcome in outcomes:
        print(f"{outcome:<18}{counts[outcome]:>8}")
    defects = Counter((outcome, detail) for outcome, _, detail in results if outcome not in outcomes[:good])
    example = {(outcome, detail): what for outcome, what, detail in results}
    for (outcome, detail), n in defects.most_common(20):
        print(f"  {n:>5} x {outcome}: {detail} (e.g. {example[outcome, detail]})")
    print(f"files written outside {where}: {len(changed)}" + "".join(f"\n  {p}" for p in changed[:10]))
    by_kind = Counter((what.split(":")[0], outcome) for outcome, what, _ in results)
    print("by mutation: " + ", ".join(f"{k}/{o} {n}" for (k, o), n in sorted(by_kind.items())))
    return 0 if not defects and not changed else 1
