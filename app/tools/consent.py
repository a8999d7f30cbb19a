"""Consent for tool calls: nothing runs unless the user allowed it, once or for every call to that server.

The question is asked through an injected `Ask` (the window shows "Allow once / Always for this server / Deny";
tests answer it directly), so the rule lives here and the dialog stays a view.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from app.tools.display import shown


class Decision(StrEnum):
    ALLOW_ONCE = "allow_once"
    ALWAYS_FOR_SERVER = "always_for_server"
    DENY = "deny"


@dataclass(frozen=True)
class PendingCall:
    """A call the model asked for, as the user is shown it before anything runs."""

    server: str
    tool: str
    arguments: dict[str, Any]

    def summary(self) -> str:
        """The call as the question shows it: names and arguments escaped and bounded (app.tools.display), so a
        name cannot hide what it does behind newlines, bidi overrides or ten thousand characters."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return f"{shown(self.server, 64)} → {shown(self.tool, 64)}({shown(arguments, 500)})"


Ask = Callable[[PendingCall], Decision]


class ConsentGate:
    """Asks `ask` for every call unless its server was allowed always (this run of the app)."""

    def __init__(self, ask: Ask, always: frozenset[str] = frozenset()) -> None:
        self._ask = ask
        self.always = set(always)  # servers the user allowed for every call

    def allows(self, call: PendingCall) -> bool:
        if call.server in self.always:
            return True
        decision = self._ask(call)
        if decision is Decision.ALWAYS_FOR_SERVER:
            self.always.add(call.server)
        return decision is not Decision.DENY


class ConsentRequest:
    """A question crossing from the worker's thread to the GUI's: the worker waits on `answered` (checking Stop
    while it waits); the GUI calls `answer` once the user chose."""

    def __init__(self, call: PendingCall) -> None:
        self.call = call
        self.decision = Decision.DENY
        self.answered = threading.Event()

    def answer(self, decision: Decision) -> None:
        self.decision = decision
        self.answered.set()
