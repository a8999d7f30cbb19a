"""MCP tools in a conversation, through the worker's client: the demo stdio server's tools are offered, a call the
model writes is run only with the user's consent (answered on the GUI thread, injected here), its result goes back
to the model and the reply continues; a denied call runs nothing; the rounds of calls in one turn are bounded."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from app.tools.consent import ConsentRequest, Decision
from app.tools.mcp_host import McpServerSpec
from app.tools.toolbox import ToolRun
from app.worker.tool_turns import MAX_TOOL_ROUNDS, tools_note, without_tools_note
from app.worker.types import TurnResult
from engine import GenerationSettings, SamplingSettings
from engine.openai.tools import Tool, ToolChoice, ToolSpec, tool_grammar
from tests.helpers.app_window import WAIT_MS, running_client

SERVER = str(Path(__file__).resolve().parents[2] / "helpers" / "mcp_demo_server.py")
DEMO = McpServerSpec("demo", sys.executable, (SERVER,))
ADD = Tool(
    "demo__add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
)


def test_a_tool_call_runs_only_with_consent_and_its_result_continues_the_reply(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    # The tiny random model is made to call `add` every round (the settings' grammar: tool_choice "required"), so
    # the turn goes the whole bounded number of rounds: allowed once, denied, then allowed for the server.
    forced = tool_grammar(ToolSpec((ADD,), ToolChoice.REQUIRED, parallel=False))
    settings = GenerationSettings(max_tokens=160, sampling=SamplingSettings(seed=0), grammar=forced)
    answers = [Decision.ALLOW_ONCE, Decision.DENY, Decision.ALWAYS_FOR_SERVER]
    asked: list[ConsentRequest] = []
    runs: list[ToolRun] = []
    deltas: list[str] = []
    with running_client(qtbot, tmp_path, tiny_model) as client:

        def consent(request: ConsentRequest) -> None:  # on the GUI thread, as the window's dialog answers
            asked.append(request)
            request.answer(answers[min(len(asked), len(answers)) - 1])

        client.consent_needed.connect(consent)
        client.tool_ran.connect(runs.append)
        client.delta.connect(deltas.append)
        errors: list[str] = []
        client.error.connect(errors.append)
        client.set_tool_servers([DEMO])
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4) as blocker:
            client.send("Add two numbers.", settings)
        result: TurnResult = blocker.args[0]
        assert errors == []  # the server started
        qtbot.waitUntil(lambda: len(runs) == MAX_TOOL_ROUNDS, timeout=WAIT_MS)
        assert result.reason in ("stop", "length")
        # Asked for every call until "Always for this server"; after that, never again.
        assert len(asked) == 3 and all(r.call.server == "demo" and r.call.tool == "add" for r in asked)
        assert [r.allowed for r in runs] == [True, False, True, True]
        for run in (runs[0], runs[2], runs[3]):
            args = json.loads(run.arguments)
            assert run.outcome.ok and run.outcome.text.strip() == str(args["a"] + args["b"])
        assert runs[1].outcome.text == "The user did not allow this call."
        assert any(d.startswith("\n\n> Tool demo__add") for d in deltas)  # each call is shown in the reply
        session = client.worker.session
        assert session is not None
        # The model was told the tools, and got each result back as a message before it went on.
        assert tools_note(ToolSpec((ADD,), ToolChoice.AUTO)).split("\n")[0] in session.system_prompt
        responses = [m.content for m in session.messages if m.content.startswith("<tool_response>")]
        assert len(responses) == MAX_TOOL_ROUNDS and session.messages[-1].role == "assistant"
        assert str(runs[0].outcome.text.strip()) in responses[0]
        assert client.worker.conversation is not None and client.worker.conversation.system_prompt == ""


def test_the_tools_listing_is_never_taken_for_the_users_system_prompt() -> None:
    note = tools_note(ToolSpec((ADD,), ToolChoice.AUTO))
    assert without_tools_note(note) == ""
    assert without_tools_note(f"Be brief.\n\n{note}") == "Be brief."
    assert without_tools_note("Be brief.") == "Be brief."
