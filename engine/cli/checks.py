"""Range checks for command-line values, each failing with one sentence (a SparkError) before anything loads.

argparse only converts types; these decide what is sane: thread counts the machine can run, seeds the generator
takes, a token budget with a ceiling, text that is valid UTF-8, and a prompt file read with a bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import InputTooLarge, SparkError

MAX_NEW_TOKENS = 1_000_000  # the ceiling of one reply's --max-tokens (the cascade's cost per token is flat)
THREADS_PER_CORE = 4
MAX_PROMPT_FILE_BYTES = 4 * 1_000_000  # engine.session.engine.MAX_PROMPT_CHARS characters of up to 4 UTF-8 bytes


def check_threads(threads: int | None) -> None:
    cores = os.cpu_count() or 1
    if threads is not None and not 1 <= threads <= cores * THREADS_PER_CORE:
        raise SparkError(
            f"--threads must be between 1 and {cores * THREADS_PER_CORE} on this {cores}-core machine, not {threads}."
        )


def check_seed(seed: int | None) -> None:
    if seed is not None and not 0 <= seed <= 2**64 - 1:
        raise SparkError(f"--seed must be between 0 and 2**64 - 1 ({2**64 - 1}), not {seed}.")


def check_max_tokens(n: int) -> None:
    if not 1 <= n <= MAX_NEW_TOKENS:
        raise SparkError(f"--max-tokens must be between 1 and {MAX_NEW_TOKENS:,}, not {n}.")


def check_text(text: str | None, flag: str) -> None:
    """Text from the command line: undecodable bytes arrive as lone surrogates (surrogateescape); name them."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise SparkError(
            f"{flag} is not valid UTF-8 text (an invalid byte at character {exc.start}); check the terminal's encoding."
        ) from None


def read_text_file(path: Path, flag: str, max_bytes: int = MAX_PROMPT_FILE_BYTES) -> str:
    """A UTF-8 text file read with a bound: a regular file's size is checked before reading, anything else (a pipe,
    /dev/stdin) is read up to the bound and refused beyond it."""
    path = path.expanduser()
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise SparkError(f"{path} is a folder; {flag} needs a text file.")
        if stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
            raise InputTooLarge(
                f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} {flag} accepts; shorten it."
            )
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise SparkError(f"The file {path} given to {flag} does not exist.") from None
    except OSError as exc:
        raise SparkError(f"Cannot read {path} for {flag}: {exc.strerror or exc}.") from None
    if len(data) > max_bytes:
        raise InputTooLarge(f"{path} holds more than the {max_bytes:,} bytes {flag} accepts; shorten it.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SparkError(f"{path} is not UTF-8 text; {flag} needs a text file.") from None
