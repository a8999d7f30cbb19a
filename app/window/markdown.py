"""Markdown for the chat: CommonMark with tables (markdown-it-py), code blocks coloured by Pygments, as the HTML
subset QTextDocument lays out (inline styles, tables with cell padding, no CSS classes).

Raw HTML in a reply is shown as text, never interpreted (the model's output is untrusted). Each fenced or indented
code block gets a "Copy" link above it whose href names the block (`copycode:<prefix>N`); the block's text is returned
beside the HTML so the view can put exactly that on the clipboard.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from dataclasses import dataclass

from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound


@dataclass(frozen=True)
class Palette:
    """The colours the HTML uses, from the view's light or dark palette."""

    text: str
    dim: str
    link: str
    code_background: str
    border: str
    dark: bool


@dataclass(frozen=True)
class Rendered:
    html: str
    code_blocks: tuple[str, ...]  # the text of each code block, in order (what its Copy link copies)


MONO = "font-family:'SF Mono','Menlo','DejaVu Sans Mono',monospace"
# Code keeps its spaces and line breaks, and a line wider than the chat wraps: Qt's rich text has no scrolling box
# of its own, so an unwrapped line would widen the whole conversation and scroll it sideways. Copy gives the lines
# as written.
PRE = MONO + "; white-space:pre-wrap"
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)")
# Lines that begin code a model wrote without an opening fence (it then "closes" one it never opened).
CODE_START = re.compile(
    r"^\s*(def |class |async def |import |from \S+ import |@\w|#include|#!|function |const |let |var |fn |func |"
    r"package |public |private |SELECT |CREATE |<\?|<!DOCTYPE|<html)"
)
LIGHT_STYLE = "default"
DARK_STYLE = "monokai"


class _Renderer(RendererHTML):
    """markdown-it's HTML renderer with code blocks through Pygments and a Copy link above each."""

    def __init__(self, parser: MarkdownIt) -> None:
        super().__init__(parser)
        self.palette = Palette("#1d1d1f", "#6e6e73", "#0a66d9", "#f5f5f7", "#d2d2d7", False)
        self.blocks: list[str] = []
        self.prefix = ""  # code blocks are named prefix + their number (the view passes the message's index)

    def fence(self, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
        token = tokens[idx]
        language = token.info.strip().split(" ")[0] if token.info else ""
        return self._code(token.content, language)

    def code_block(self, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType) -> str:
        return self._code(tokens[idx].content, "")

    def _code(self, code: str, language: str) -> str:
        code = code.rstrip("\n")
        n = f"{self.prefix}{len(self.blocks)}"
        self.blocks.append(code)
        p = self.palette
        formatter = HtmlFormatter(nowrap=True, noclasses=True, style=DARK_STYLE if p.dark else LIGHT_STYLE)
        body = highlight(code, _lexer(code, language), formatter).rstrip("\n")
        label = html.escape(language) if language else "code"
        head = (
            f'<table width="100%" cellspacing="0" cellpadding="0" style="margin-top:6px">'
            f'<tr><td style="color:{p.dim}; font-size:small">{label}</td>'
            f'<td align="right" style="font-size:small"><a style="color:{p.link}; text-decoration:none" '
            f'href="copycode:{n}">Copy</a></td></tr></table>'
        )
        block = (
            f'<table width="100%" cellspacing="0" cellpadding="10" bgcolor="{p.code_background}" '
            f'style="margin-bottom:8px"><tr><td><pre style="{PRE}; margin:0">{body}</pre></td></tr></table>'
        )
        return head + block


def _unclosed_fence(lines: list[str]) -> int | None:
    """The line index of a code fence left open at the end of `lines` (None: every fence is closed)."""
    opened: tuple[int, str, int] | None = None  # (line, fence character, fence length)
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if m is None:
            continue
        mark = m.group(1)
        if opened is None:
            opened = (i, mark[0], len(mark))
        elif mark[0] == opened[1] and len(mark) >= opened[2] and not m.group(2) and not line.strip(mark[0] + " \t"):
            opened = None
    return None if opened is None else opened[0]


def open_fence(text: str) -> bool:
    """Whether `text` ends inside a code block (a streaming reply's code, not yet closed)."""
    return _unclosed_fence(text.splitlines()) is not None


def mend_fences(text: str) -> str:
    """A reply's stray closing fence mended: a bare fence that opens nothing but the end of the reply closes code
    written without its opening fence, so that code (from its first line that reads as code) becomes the block; with
    no such line the fence goes. Otherwise Markdown would join the code's lines into one paragraph and show an empty
    code block after it. A fence still open with text after it (code streaming in) is left as it is."""
    lines = text.splitlines()
    i = _unclosed_fence(lines)
    if i is None or FENCE.match(lines[i]).group(2) or any(line.strip() for line in lines[i + 1 :]):  # type: ignore[union-attr]
        return text
    start = 0
    for k in range(i - 1, -1, -1):  # the code may only begin after the last fenced block
        if FENCE.match(lines[k]):
            start = k + 1
            break
    code = next((k for k in range(start, i) if CODE_START.match(lines[k])), None)
    if code is None:
        return "\n".join(lines[:i])
    return "\n".join([*lines[:code], lines[i].strip(), *lines[code : i + 1]])


def _lexer(code: str, language: str) -> Lexer:
    lexer: Lexer = TextLexer()
    try:
        if language:
            lexer = get_lexer_by_name(language)
        elif len(code) > 40:  # too short to guess from
            lexer = guess_lexer(code)
    except ClassNotFound:
        pass
    return lexer


class MarkdownRenderer:
    """Renders one message's Markdown to the view's HTML; one instance per view (it keeps the parser)."""

    def __init__(self) -> None:
        # "commonmark" with tables and strikethrough; html off: tags in a reply show as text.
        self._md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(["table", "strikethrough"])
        self._renderer = _Renderer(self._md)
        self._md.renderer = self._renderer

    def render(self, text: str, palette: Palette, block_prefix: str = "") -> Rendered:
        r = self._renderer
        r.palette, r.blocks, r.prefix = palette, [], block_prefix
        body = self._md.render(mend_fences(text))
        return Rendered(_style(body, palette), tuple(r.blocks))


def _style(body: str, p: Palette) -> str:
    """QTextDocument ignores <style> for most of these: the look goes inline, tag by tag."""
    mono = MONO
    replacements = {
        "<code>": f'<code style="{mono}; background-color:{p.code_background}">',
        "<table>": f'<table cellspacing="0" cellpadding="6" border="1" style="border-color:{p.border}; '
        'border-collapse:collapse; margin:6px 0">',
        "<th>": f'<th bgcolor="{p.code_background}">',
        "<blockquote>": f'<blockquote style="color:{p.dim}; margin-left:12px">',
        "<a href=": f'<a style="color:{p.link}" href=',
        "<pre>": f'<pre style="{PRE}">',
    }
    for tag, styled in replacements.items():
        body = body.replace(tag, styled)
    return body
