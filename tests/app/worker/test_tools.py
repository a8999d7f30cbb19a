"""MCP tools in a conversation, through the worker's client: the demo stdio server's tools are offered, a call the
model writes is run only with the user's consent (answered on the GUI thread, injected here), its result goes back
to the model as a `tool` message and the reply continues; a denied call runs nothing; the rounds of calls in one turn
are bounded; Regenerate runs the tools like Send; a template that knows tools gets them as its own variables; the
calls and results come back exactly from the conversation's file."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from app.tools.consent import ConsentRequest, Decision
from app.tools.mcp_host import McpServerSpec
from app.tools.toolbox import ToolRun
from app.worker.client import ConversationClient
from app.worker.tool_turns import MAX_TOOL_ROUNDS, RESPONSE_OPEN, ToolStatus
from app.worker.types import TurnResult
from engine import FinishReason, GenerationSettings, SamplingSettings, load_session
from engine.tools.calls import ToolChoice, ToolSpec
from engine.tools.grammar import tool_grammar
from engine.tools.template import FALLBACK_SYSTEM, TOOL_ROLE
from tests.helpers.app_window import WAIT_MS, running_client
from tests.helpers.default_model import default_model_dir
from tests.helpers.tool_specs import add_tool

SERVER = str(Path(__file__).resolve().parents[2] / "helpers" / "mcp_demo_server.py")
DEMO = McpServerSpec("demo", sys.executable, (SERVER,))
ADD = add_tool("demo__add")
# The tiny random model is made to call `add` every round (the settings' grammar: tool_choice "required"), so a turn
# goes the whole bounded number of rounds.
FORCED = GenerationSettings(
    max_tokens=160,
    sampling=SamplingSettings(seed=0),
    grammar=tool_grammar(ToolSpec((ADD,), ToolChoice.REQUIRED, parallel=False)),
)
# A chat template that writes Hermes-style calls itself: tools, assistant tool_calls and tool messages are its own.
TOOLS_TEMPLATE = (
    "{# writes <tool_call> blocks its own way #}{{ bos_token }}{% if tools %}<|system|>\n<tools>"
    "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}</tools><|end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|>\n<tool_response>{{ m['content'] }}</tool_response>"
    "<|end|>\n{% elif m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}<|assistant|>\n"
    "{{ m['content'] }}{% for c in m['tool_calls'] %}<call name=\"{{ c['function']['name'] }}\">"
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}<|end|>\n{% else %}<|{{ m['role'] }}|>\n"
    "{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def answering(client: ConversationClient, answers: list[Decision]) -> list[ConsentRequest]:
    """Answer consent questions on the GUI thread, as the window's dialog does: `answers` in turn, the last after."""
    asked: list[ConsentRequest] = []

    def consent(request: ConsentRequest) -> None:
        asked.append(request)
        request.answer(answers[min(len(asked), len(answers)) - 1])

    client.consent_needed.connect(consent)
    return asked


def forced_turn(qtbot, client: ConversationClient, runs: list[ToolRun]) -> None:  # type: ignore[no-untyped-def]
    """One turn that calls the demo server's `add` every round, each call allowed for the server; `runs` gets them."""
    answering(client, [Decision.ALWAYS_FOR_SERVER])
    client.tool_ran.connect(runs.append)
    client.set_tool_servers([DEMO])
    with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4):
        client.send("Add two numbers.", FORCED)
    qtbot.waitUntil(lambda: len(runs) == MAX_TOOL_ROUNDS, timeout=WAIT_MS)


def test_a_tool_call_runs_only_with_consent_and_its_result_continues_the_reply(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    # The tiny random model is made to call `add` every round (the settings' grammar: tool_choice "required"), so
    # the turn goes the whole bounded number of rounds: allowed once, denied, then allowed for the server.
    runs: list[ToolRun] = []
    deltas: list[str] = []
    with running_client(qtbot, tmp_path, tiny_model) as client:
        asked = answering(client, [Decision.ALLOW_ONCE, Decision.DENY, Decision.ALWAYS_FOR_SERVER])
        client.tool_ran.connect(runs.append)
        client.delta.connect(deltas.append)
        errors: list[str] = []
        client.error.connect(errors.append)
        client.set_tool_servers([DEMO])
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4) as blocker:
            client.send("Add two numbers.", FORCED)
        result: TurnResult = blocker.args[0]
        assert errors == []  # the server started
        qtbot.waitUntil(lambda: len(runs) == MAX_TOOL_ROUNDS, timeout=WAIT_MS)
        # The last round's reply called again, beyond the turn's bound: the turn ends in calls nothing ran.
        assert result.reason in (FinishReason.TOOL_CALLS, FinishReason.LENGTH)
        # Asked for every call until "Always for this server"; after that, never again.
        assert len(asked) == 3 and all(r.call.server == "demo" and r.call.tool == "add" for r in asked)
        assert [r.allowed for r in runs] == [True, False, True, True]
        for run in (runs[0], runs[2], runs[3]):
            args = json.loads(run.arguments)
            assert run.outcome.ok and run.outcome.text.strip() == str(args["a"] + args["b"])
        assert runs[1].outcome.text == "The user did not allow this call."
        assert sum(d.startswith(f"\n{RESPONSE_OPEN}") for d in deltas) == MAX_TOOL_ROUNDS  # each result is shown
        session = client.worker.session
        assert session is not None
        # The model was told the tools (this template does not know them: the documented fallback), and got each
        # result back as a `tool` message before it went on.
        assert FALLBACK_SYSTEM.split("\n")[0] in session.known_text and "demo__add" in session.known_text
        results = [json.loads(m.content) for m in session.messages if m.role == TOOL_ROLE]
        assert [r["status"] for r in results] == [ToolStatus.OK, ToolStatus.DENIED, ToolStatus.OK, ToolStatus.OK]
        assert results[0]["content"] == runs[0].outcome.text and session.messages[-1].role == "assistant"
        assert f"{RESPONSE_OPEN}\n{session.messages[2].content}" in session.known_text  # as the fallback words it
        assert client.worker.conversation is not None and client.worker.conversation.system_prompt == ""


def test_regenerate_runs_the_tools_again_and_the_file_restores_the_calls_exactly(
    qtbot, tmp_path: Path, tiny_model: Path
) -> None:  # type: ignore[no-untyped-def]
    runs: list[ToolRun] = []
    with running_client(qtbot, tmp_path, tiny_model) as client:
        forced_turn(qtbot, client, runs)
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 4) as blocker:
            client.regenerate(FORCED)
        qtbot.waitUntil(lambda: len(runs) == 2 * MAX_TOOL_ROUNDS, timeout=WAIT_MS)  # the regenerated reply called too
        conversation = client.worker.conversation
        assert conversation is not None
        roles = [r for r, _ in conversation.messages]
        # One turn, not two: the first turn's calls and results went with its reply.
        assert roles == ["user"] + ["assistant", TOOL_ROLE] * MAX_TOOL_ROUNDS + ["assistant"]
        result: TurnResult = blocker.args[0]
        assert result.messages == len(roles)
        before = list(conversation.messages)
        path = tmp_path / "tools.spark"
        with qtbot.waitSignal(client.saved, timeout=WAIT_MS):
            client.save(path)
    data = load_session(path)
    assert [(m.role, m.content) for m in data.messages] == before
    with running_client(qtbot, tmp_path, tiny_model) as again:
        with qtbot.waitSignal(again.restored, timeout=WAIT_MS * 4):
            again.restore(path)
        assert again.worker.conversation is not None and again.worker.conversation.messages == before


def test_a_template_that_knows_tools_gets_them_as_its_own(qtbot, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    runs: list[ToolRun] = []
    with running_client(qtbot, tmp_path, model) as client:
        forced_turn(qtbot, client, runs)
        session = client.worker.session
        assert session is not None
        prompt = session.known_text
        assert "[demo__add]" in prompt.partition("<tools>")[2].partition("</tools>")[0]  # the template's own listing
        assert f'<call name="demo__add">{runs[0].arguments}</call>' in prompt  # the call, as the template writes it
        assert FALLBACK_SYSTEM.split("\n")[0] not in prompt  # ...not the fallback's
        first_result = next(m.content for m in session.messages if m.role == TOOL_ROLE)
        assert f"<|user|>\n<tool_response>{first_result}</tool_response>" in prompt  # the template's tool turn


def test_the_default_model_answers_through_the_worker_with_a_tool_server_attached(qtbot, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # The real default model (SmolLM2-135M-Instruct, whose template does not know tools: the documented fallback),
    # offered the demo server's tools with tool_choice "auto": it answers, and whatever call it starts is held to
    # the tools' schemas, so each call it makes parses and runs.
    runs: list[ToolRun] = []
    deltas: list[str] = []
    errors: list[str] = []
    greedy = GenerationSettings(max_tokens=96, sampling=SamplingSettings(greedy=True))
    with running_client(qtbot, tmp_path, default_model_dir()) as client:
        answering(client, [Decision.ALWAYS_FOR_SERVER])
        client.tool_ran.connect(runs.append)
        client.delta.connect(deltas.append)
        client.error.connect(errors.append)
        client.set_tool_servers([DEMO])
        with qtbot.waitSignal(client.finished, timeout=WAIT_MS * 8) as blocker:
            client.send("What is 17 plus 25? Use the demo__add tool.", greedy)
        result: TurnResult = blocker.args[0]
        session = client.worker.session
        assert session is not None
        reply = "".join(deltas)
        print(f"\nthe default model's turn ({result.reason}): {reply!r}")
        assert errors == [] and reply.strip()
        assert "demo__add" in session.known_text  # the tools were offered
        for run in runs:  # every call it made parsed as a call of an offered tool, and ran
            assert run.name == "demo__add" and run.allowed and set(json.loads(run.arguments)) <= {"a", "b"}
        results = [m for m in session.messages if m.role == TOOL_ROLE]
        assert len(results) == len(runs) and session.messages[-1].role == "assistant"
