"""A tool server's processes: started in a process group of its own, and when it is closed, nothing it started is
left running — its children in the group, and on Linux also what escaped the group (a `setsid` double-forked
daemon).

Linux: the app becomes a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`), so an orphan of a server is re-parented
to the app instead of init, and every server carries a marker in its environment that its descendants inherit; on
close, the server's group is killed, then every process the app adopted that carries the server's marker, and those
are reaped. (A daemon that both escapes the group and clears its environment is beyond this; a cgroup would catch it.)
macOS and others: the process group only.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

MARKER = "MLOT_SPARK_MCP_SERVER"
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0  # after stdin closes, a server has this long to exit before its group is signalled
_subreaper = False


# What a server inherits of the app's environment (as other MCP clients do): a token or key in the app's
# environment is not every tool server's; the server's own `env` entry adds what it needs.
INHERITED = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TMPDIR")


def inherited_environment() -> dict[str, str]:
    return {k: v for k in INHERITED if (v := os.environ.get(k)) is not None and not v.startswith("()")}


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux); False where that is not available."""
    global _subreaper
    if _subreaper or not sys.platform.startswith("linux"):
        return _subreaper
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return _subreaper


class ServerProcess:
    """One server: its Popen (stdin, stdout and stderr piped), its group and its marker."""

    def __init__(self, command: str, args: Sequence[str], env: Mapping[str, str]) -> None:
        become_subreaper()
        self.marker = uuid.uuid4().hex
        full_env = {**inherited_environment(), **env, MARKER: self.marker}
        self.popen = subprocess.Popen(
            [command, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,  # a group (and session) of its own: killpg reaches its children
            close_fds=True,
        )
        self.pgid = self.popen.pid
        self._closing = threading.Lock()
        self._closed = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def close(self, grace_s: float = GRACE_S) -> None:
        """Close its stdin, give it `grace_s` to exit, then end its group and everything that carries its marker.
        Once: a second call returns at once."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
        if self.popen.stdin is not None:
            with contextlib.suppress(OSError):
                self.popen.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        killed: set[int] = set()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, sig)
            for pid in self._marked():
                killed.add(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            if sig is signal.SIGTERM:
                time.sleep(0.05)  # a moment to exit cleanly before the SIGKILL
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5.0)
        for pid in killed - {self.pid}:  # adopted (the app is their subreaper): their exit is collected here
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, 0)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def _marked(self) -> list[int]:
        """Processes still alive (not zombies) that carry this server's marker (Linux's /proc; none elsewhere)."""
        proc = Path("/proc")
        if not proc.is_dir():
            return []
        needle = f"{MARKER}={self.marker}".encode()
        found = []
        me = os.getpid()
        for entry in proc.iterdir():
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                state = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[0]
                if state == b"Z":
                    continue
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
        return found
