"""`python -m app` and `python -m engine` end with their own exit code even when a daemon thread is still inside
torch at quit (a kept-memory write abandoned, a server's scheduler): finalizing the interpreter under such a thread
aborts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.packaging.loader import REPO

SPIN = textwrap.dedent(
    """
    import threading, time, torch
    a = torch.randn(256, 256)
    def spin():
        while True:
            torch.mm(a, a)  # releases the GIL inside torch's C++
    threading.Thread(target=spin, daemon=True).start()
    time.sleep(0.2)
    print("stored", flush=True)
    from engine import exit_process
    exit_process(3)  # sys.exit(3) here aborts with "terminate called without an active exception"
    """
)


def test_exit_with_a_daemon_thread_in_torch_keeps_the_exit_code() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", SPIN], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert (proc.returncode, proc.stdout) == (3, "stored\n"), proc.stderr[-300:]
    assert "terminate called" not in proc.stderr and "FATAL" not in proc.stderr
