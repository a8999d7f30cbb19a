"""Process-wide settings the engine runs under, set where it starts running (`python -m engine`, the face's first
name, hence `python -m app`), never by importing a module.

OpenMP workers sleep when idle (OMP_WAIT_POLICY=PASSIVE) instead of spinning. The native kernels' thread pool runs
every matrix product; PyTorch's workers, left spinning after each of its own operations (attention, norms), took
the cores the pool's workers and the GUI thread need (a 2-thread prefill ran slower than a 1-thread one). OpenMP
reads the variable once, when PyTorch loads it, so this runs before anything imports torch. A user's own setting
wins, and the benchmarks' peers get it back (`user_omp_wait_policy`).

A process ends through `exit_process`: a daemon thread (a kept-memory write abandoned at quit, a server's scheduler)
still inside PyTorch when the interpreter finalizes is unwound by glibc's forced unwinding through PyTorch's
`catch (...)` frames, which aborts ("terminate called without an active exception") and turns a clean quit into a
crash.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn

_user_omp_wait_policy: str | None = None
_prepared = False


def prepare_process() -> None:
    """Set the process-wide settings once; later calls do nothing."""
    global _prepared, _user_omp_wait_policy
    if _prepared:
        return
    _user_omp_wait_policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _prepared = True


def user_omp_wait_policy() -> str | None:
    """OMP_WAIT_POLICY as the user gave it, before `prepare_process` (None: not set)."""
    return _user_omp_wait_policy if _prepared else os.environ.get("OMP_WAIT_POLICY")


def exit_process(code: int) -> NoReturn:
    """End the process with `code`; by now everything of the user's is stored, so with a daemon thread alive it ends
    without finalizing the interpreter (see above)."""
    if any(t.daemon and t.is_alive() for t in threading.enumerate()):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
