"""Tool calls in a reply, shown as cards: the tool's name, its arguments pretty-printed, whether the user allowed it,
and its result folded to a few lines, instead of the `<tool_call>` / `<tool_response>` text the reply holds
(app.worker.tool_turns writes it, live and restored alike).

`segments` splits a reply's text into Markdown text and cards; `card_html` lays a card out in the HTML subset
QTextDocument knows. Everything the model or a tool wrote is escaped: it is shown, never interpreted.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, replace

from app.tools.display import shown
from app.window.markdown import MONO, Palette
from app.worker.tool_turns import RESPONSE_CLOSE, RESPONSE_OPEN, ToolStatus
from engine.tools.calls import CLOSE, OPEN

FOLDED_CHARS = 300  # of a result, in the card (the model got it whole)
MAX_ARGUMENT_LINE = 2000  # characters of one line of a call's arguments, in the card
BLOCK = re.compile(
    f"{re.escape(OPEN)}(.*?){re.escape(CLOSE)}|{re.escape(RESPONSE_OPEN)}(.*?){re.escape(RESPONSE_CLOSE)}"
    f"|{re.escape(OPEN)}(.*)$",  # a call still being written (the stream has not closed it yet)
    re.DOTALL,
)
STATUS_TEXT = {
    ToolStatus.OK: "Allowed · ran",
    ToolStatus.ERROR: "Allowed · the tool reported an error",
    ToolStatus.DENIED: "Denied · did not run",
}


@dataclass(frozen=True)
class Card:
    name: str  # "" while the call is still being written
    arguments: str  # pretty-printed JSON
    status: ToolStatus | None = None  # None: no result yet (waiting for consent, or running)
    result: str = ""


def _call(body: str) -> Card | None:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return Card(obj["name"], json.dumps(obj.get("arguments", {}), indent=2, ensure_ascii=False))


def _result(body: str) -> tuple[str, ToolStatus, str] | None:
    """A result block's (tool name, status, text); None when it is not one of ours."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("status") not in set(ToolStatus):
        return None
    return str(obj.get("name", "")), ToolStatus(obj["status"]), str(obj.get("content", ""))


def segments(text: str) -> list[str | Card]:
    """A reply's text as Markdown text and cards, in order; each result fills the first card still waiting for
    one (calls and results come in the same order). A block that is not a call or a result stays text."""
    out: list[str | Card] = []
    at = 0
    for m in BLOCK.finditer(text):
        call, result, writing = m.group(1), m.group(2), m.group(3)
        if call is not None and (card := _call(call.strip())) is not None:
            out += [text[at : m.start()], card]
        elif result is not None and (got := _result(result.strip())) is not None:
            out.append(text[at : m.start()])
            name, status, content = got
            waiting = next((i for i, s in enumerate(out) if isinstance(s, Card) and s.status is None), None)
            if waiting is None:  # a result without its call (a hand-made file): a card of its own
                out.append(Card(name, "", status, content))
            else:
                called = out[waiting]
                assert isinstance(called, Card)
                out[waiting] = replace(called, status=status, result=content)
        elif writing is not None:
            out += [text[at : m.start()], Card("", "")]
        else:
            continue
        at = m.end()
    out.append(text[at:])
    return [s for s in out if isinstance(s, Card) or s.strip()]


def folded(result: str) -> str:
    text = " ".join(result.split())
    return text if len(text) <= FOLDED_CHARS else text[:FOLDED_CHARS] + "…"


def card_html(card: Card, palette: Palette) -> str:
    """One card: a framed box with the name and state on top, the arguments in monospace, the result below."""
    e = html.escape
    if not card.name:
        head = f'<span style="color:{palette.dim}">Calling a tool…</span>'
    else:
        state = STATUS_TEXT[card.status] if card.status is not None else "Waiting for your answer…"
        head = f'<b>Tool · {e(shown(card.name, 64))}</b> <span style="color:{palette.dim}">— {e(state)}</span>'
    rows = [f"<p>{head}</p>"]
    if card.arguments and card.arguments != "{}":
        # Line by line: bidi and invisible characters escaped (JSON already escapes controls), the layout kept.
        arguments = "\n".join(shown(line, MAX_ARGUMENT_LINE) for line in card.arguments.splitlines())
        rows.append(f'<pre style="{MONO}">{e(arguments)}</pre>')
    if card.status is not None and card.status is not ToolStatus.DENIED:
        result = shown(folded(card.result), FOLDED_CHARS + 1)
        rows.append(f'<p style="color:{palette.dim}">Result: {e(result) or "(empty)"}</p>')
    return (
        f'<table width="100%" cellspacing="0" cellpadding="8" border="1" '
        f'style="border-color:{palette.border}; border-style:solid; background-color:{palette.code_background}">'
        f"<tr><td>{''.join(rows)}</td></tr></table>"
    )
