"""Outside text made safe: JSON's nesting measured before the parser recurses (brackets inside strings, escaped
quotes included, do not count), and names printed on one line with control, bidi and zero-width characters
escaped and their length bounded."""

from __future__ import annotations

import json

import pytest

from engine.untrusted import JsonTooDeep, JsonTooLarge, json_depth, loads_bounded, shown


def test_depth_ignores_brackets_inside_strings() -> None:
    assert json_depth(json.dumps({"a": '[[[\\"[[{', "b": [[1]]})) == 3
    assert json_depth("[" * 10 + "]" * 10) == 10
    assert json_depth(json.dumps(["a\\", ["[b"]])) == 2  # an escaped backslash before a closing quote


def test_loads_bounded_refuses_deep_and_large_before_parsing() -> None:
    with pytest.raises(JsonTooDeep):
        loads_bounded(b"[" * 100_000 + b"]" * 100_000, max_bytes=1 << 20, max_depth=64)
    with pytest.raises(JsonTooLarge):
        loads_bounded(b"[" + b"1," * 1000 + b"1]", max_bytes=100, max_depth=64)
    with pytest.raises(ValueError):
        loads_bounded(b"\xff\xfe", max_bytes=100, max_depth=8)
    assert loads_bounded(b'{"a": ["]]]"]}', max_bytes=100, max_depth=2) == {"a": ["]]]"]}


@pytest.mark.parametrize(
    "name", ["a\nb", "x\x1b[2Jy", "evil\u202etxt", "zero\u200bwidth", "nul\x00", "bell\x07", "ls\u2028ps"]
)
def test_shown_escapes_what_changes_how_a_line_reads(name: str) -> None:
    out = shown(name)
    assert out.isprintable() and "\\" in out


def test_shown_bounds_the_length_and_says_so() -> None:
    out = shown("x" * 10_000, 50)
    assert out.startswith("x" * 50) and "9950" in out and len(out) < 80
    assert shown("Qwen3-4B-Q4_K_M.gguf") == "Qwen3-4B-Q4_K_M.gguf"
