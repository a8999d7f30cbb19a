"""macOS `sysctlbyname(3)` through ctypes: microseconds per call, where spawning `sysctl` would cost milliseconds."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.sysctlbyname.argtypes = [
        ctypes.c_char_p,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_void_p,
        ctypes.c_size_t,
    ]
    libc.sysctlbyname.restype = ctypes.c_int
    return libc


def sysctl_bytes(name: str) -> bytes | None:
    """The raw value of `name`, or None where it does not exist (or this is not a BSD/macOS libc)."""
    try:
        libc = _libc()
    except (OSError, AttributeError):
        return None
    size = ctypes.c_size_t(0)
    if libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0) != 0 or size.value == 0:
        return None
    buf = ctypes.create_string_buffer(size.value)
    if libc.sysctlbyname(name.encode(), buf, ctypes.byref(size), None, 0) != 0:
        return None
    return buf.raw[: size.value]


def sysctl_int(name: str) -> int | None:
    raw = sysctl_bytes(name)
    # Integer sysctls are 4 (int) or 8 (int64/quad) bytes, native (little-endian on every Mac we run on).
    return int.from_bytes(raw, "little", signed=True) if raw is not None and len(raw) in (4, 8) else None


def sysctl_str(name: str) -> str | None:
    raw = sysctl_bytes(name)
    return raw.rstrip(b"\0").decode(errors="replace") if raw is not None else None
