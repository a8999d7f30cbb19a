"""The inspector: one collapsible side pane that says in plain words what runs, what the model remembers (this
conversation, the documents and earlier conversations attached to it, what the last reply drew on), how fast it goes
and how the machine is doing; the detailed panels (tiers, thermal, memory, session) sit behind a
"Details" disclosure."""

from __future__ import annotations

import sys

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QPushButton,
    QScrollArea,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.inspector.hw_monitor import HardwareSample
from app.inspector.panels import (
    CachePanel,
    MemoryPanel,
    PerformancePanel,
    SessionPanel,
    ThermalPanel,
)
from app.inspector.panels.base import bytes_text
from app.worker.types import (
    AttachKind,
    AttachmentView,
    MemoryHeld,
    MemoryReport,
    ModelInfo,
    ReadProgress,
    TurnProgress,
    remote_name,
)
from engine import RemoteServer

REMOTE_MEMORY = "Does not apply to a remote model: the server keeps its own memory; Spark stores the transcript only."
THERMAL_WORDS = {
    "nominal": "Running cool.",
    "fair": "Warm; running normally.",
    "serious": "Hot: replies are slowed down to cool off.",
    "critical": "Very hot: replies pause until it cools.",
}


PLAIN_RUNS = {
    "coreml": "runs on the Neural Engine",
    "mlx": "runs on the Mac's graphics processor (MLX)",
    "mps": "runs on the Mac's graphics processor",
    "cuda": "runs on the graphics card",
    "cpu": "runs on the CPU",
}


def model_line(info: ModelInfo) -> str:
    """Where the model runs, in plain words; the weights, kernels and skipped backends are the Details' business."""
    runs, _, why = info.backend_detail.partition(" (skipped ")
    backend = runs.partition(", ")[0]
    text = f"{info.name} {PLAIN_RUNS.get(backend, 'runs on ' + backend)}"
    if backend != "coreml" and "coreml" in why:
        text += " (the Neural Engine needs a Mac with Apple silicon)"
    return text + "."


def memory_words(report: MemoryReport) -> str:
    """What the conversation's memory holds, as a reader would say it."""
    if report.remote:
        return REMOTE_MEMORY
    tiers = {t.name: t for t in report.tiers}
    working = tiers.get("working")
    episodic = tiers.get("episodic")
    if not report.tokens:
        return "Nothing yet: the conversation is empty."
    used = bytes_text(sum(t.bytes for t in report.tiers if t.name != "persistent"))
    if working is None or not working.evictions:
        return f"Remembers this whole conversation word for word ({report.tokens:,} tokens, {used} in RAM)."
    n = episodic.entries if episodic is not None else 0
    recall = f"and can recall {n:,} earlier passage{'s' if n != 1 else ''} when they matter" if n else ""
    return " ".join(
        p for p in (f"Remembers the last {working.entries:,} tokens word for word", recall, f"({used} in RAM).") if p
    )


NOTHING_ATTACHED = (
    "Nothing attached. Attach documents with the paperclip (or drop them on the window), or recall an earlier "
    "conversation from the sidebar's menu: the model reads each once and draws on it when a question needs it."
)


def attachment_line(view: AttachmentView) -> str:
    what = f"Earlier conversation “{view.shown}”" if view.kind == AttachKind.CONVERSATION else view.shown
    how = "read just now" if view.read_tokens else "read before, nothing read again"
    return f"{what}: {view.tokens:,} tokens, {bytes_text(view.disk_bytes)} on disk ({how})."


def attached_words(report: MemoryReport) -> str:
    """The documents and earlier conversations joined to this conversation's memory, and what the last reply drew
    on, one line each."""
    if report.remote:
        return "Documents cannot be attached to a remote model's conversation."
    if not report.attachments:
        return NOTHING_ATTACHED
    lines = [attachment_line(v) for v in report.attachments]
    if report.recalled:
        lines.append("The last reply drew on " + "; ".join(c.label for c in report.recalled) + ".")
    else:
        lines.append("Nothing was drawn from them for the last reply.")
    return "\n".join(lines)


HELD_WORDS = {
    MemoryHeld.RAM: "It stayed in RAM while you were elsewhere, so coming back read nothing.",
    MemoryHeld.DISK: "It was read back from the memory kept on disk, so nothing was recomputed.",
    MemoryHeld.RECOMPUTED: "It was recomputed from the conversation's record (no kept copy matched).",
}


def kept_words(report: MemoryReport) -> str:
    """Where this conversation's memory came from and whether a copy is kept on disk, in plain words."""
    if report.remote or not report.tokens:
        return ""
    parts = [HELD_WORDS.get(report.held, "")]
    if report.kept_bytes:
        parts.append(
            f"A copy is kept on disk ({bytes_text(report.kept_bytes)}), so reopening it after a restart is instant."
        )
    return " ".join(p for p in parts if p)


NO_REPLY_YET = "No reply yet."
NOT_MEASURED_SINCE_OPENED = "Measured as Spark answers: no reply since this conversation was opened."


class _Section(QWidget):
    def __init__(self, title: str) -> None:
        super().__init__()
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 8)
        layout.setSpacing(2)
        heading = QLabel(title)
        heading.setObjectName("inspectorHeading")
        self.body = QLabel("—")
        self.body.setObjectName("inspectorBody")
        self.body.setWordWrap(True)  # never cut off: the pane is narrow, sentences wrap
        self.body.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout.addWidget(heading)
        layout.addWidget(self.body)
        self.box = layout  # a section may add a control under its words


class Inspector(QScrollArea):
    sampling_requested = Signal()  # "Change…" under Sampling: the conversation's own sampling sheet

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("inspector")
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        body = QWidget()
        body.setObjectName("inspectorBodyWidget")
        layout = QVBoxLayout(body)
        layout.setContentsMargins(14, 12, 14, 12)
        layout.setSpacing(6)
        self.model = _Section("Model")
        self.memory = _Section("Memory")
        self.attached = _Section("Attached")  # short: a heading does not wrap, and sets the pane's width
        self.attached.body.setText(NOTHING_ATTACHED)
        self.speed = _Section("Speed")
        self.sampling = _Section("Sampling")
        self.sampling_button = QPushButton("Change for This Conversation…")
        self.sampling_button.setObjectName("inspectorLink")
        self.sampling_button.setFlat(True)
        self.sampling_button.clicked.connect(self.sampling_requested)
        self.sampling.box.addWidget(self.sampling_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.machine = _Section("This Mac" if sys.platform == "darwin" else "This computer")
        self.conversation = _Section("Conversation")
        for s in (self.model, self.memory, self.attached, self.speed, self.sampling, self.machine, self.conversation):
            layout.addWidget(s)
        self.details_button = QToolButton()
        self.details_button.setObjectName("disclosure")
        self.details_button.setCheckable(True)
        self.details_button.setText("Details")
        self.details_button.setArrowType(Qt.ArrowType.RightArrow)
        self.details_button.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.details_button.setAutoRaise(True)
        self.details_button.toggled.connect(self._on_details)
        layout.addWidget(self.details_button)
        self.details = QWidget()
        details = QVBoxLayout(self.details)
        details.setContentsMargins(0, 0, 0, 0)
        self.cache_panel = CachePanel()
        self.performance_panel = PerformancePanel()
        self.thermal_panel = ThermalPanel()
        self.memory_panel = MemoryPanel()
        self.session_panel = SessionPanel()
        for p in self.panels:
            details.addWidget(p)
        self.details.hide()
        layout.addWidget(self.details)
        layout.addStretch(1)
        self.setWidget(body)
        self._measured = False  # a reply's speed is shown (on_progress) since the conversation was opened
        self.speed.body.setText(NO_REPLY_YET)
        self.conversation.body.setText("Stored automatically as you chat.")

    @property
    def panels(self) -> list[QWidget]:
        return [self.performance_panel, self.cache_panel, self.memory_panel, self.thermal_panel, self.session_panel]

    @Slot(bool)
    def _on_details(self, shown: bool) -> None:
        self.details.setVisible(shown)
        self.details_button.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    # -- updates -------------------------------------------------------------------------------------------------------
    @Slot(ModelInfo)
    def on_model(self, info: ModelInfo) -> None:
        self.model.body.setText(model_line(info))
        self.model.body.setToolTip(str(info.path))
        self.performance_panel.on_model(info)
        self.memory_panel.on_model(info)

    def show_remote(self, server: RemoteServer) -> None:
        """A remote server is the model: say where it runs; the memory rows say they do not apply (see on_memory)."""
        self.model.body.setText(
            f"{remote_name(server)} runs on the server at {server.url}; Spark sends it the conversation and streams the reply."
        )
        self.model.body.setToolTip(server.url)
        self.performance_panel.backend.setText(f"remote server ({server.url})")
        self.performance_panel.skipped.setText("does not apply (remote model)")
        self.memory_panel.model.setText("on the server")

    @Slot(MemoryReport)
    def on_memory(self, report: MemoryReport) -> None:
        self.memory.body.setText(" ".join(p for p in (memory_words(report), kept_words(report)) if p))
        self.attached.body.setText(attached_words(report))
        self.cache_panel.on_memory(report)
        self.memory_panel.on_memory(report)
        self.session_panel.on_memory(report)

    @Slot(ReadProgress)
    def on_reading(self, p: ReadProgress) -> None:
        """A conversation's memory is being recomputed (no kept copy matched its record): say so while it lasts."""
        if p.kind == "restore" and p.done < p.total:
            self.memory.body.setText(
                f"Being recomputed from the conversation's record: {p.done:,} of {p.total:,} tokens (no kept copy matched)."
            )

    def show_transcript(self, replies: int) -> None:
        """A conversation's transcript is shown (opened, or back after an undo): with replies from before but none
        measured since it was opened, say so instead of "no reply yet"."""
        if not self._measured:
            self.speed.body.setText(NOT_MEASURED_SINCE_OPENED if replies else NO_REPLY_YET)

    @Slot(TurnProgress)
    def on_progress(self, p: TurnProgress) -> None:
        self.performance_panel.on_progress(p)
        if p.generated_tokens:
            self._measured = True
            self.speed.body.setText(
                f"{p.tokens_per_s:.0f} tokens a second; the first came {p.ttft_s * 1000:,.0f} ms after sending ({p.prompt_tokens:,} tokens read)."
            )

    @Slot(HardwareSample)
    def on_sample(self, sample: HardwareSample) -> None:
        self.thermal_panel.on_sample(sample)
        self.memory_panel.on_sample(sample)
        m = sample.memory
        heat = THERMAL_WORDS.get(sample.thermal.state.value, "This computer does not report its temperature.")
        self.machine.body.setText(
            f"{heat} {bytes_text(m.available_bytes)} of memory free; Spark uses {bytes_text(m.rss_bytes)}."
        )

    def reset_conversation(self) -> None:
        """A new, empty conversation: nothing said about the previous one stays (its speed, its message count)."""
        self._measured = False
        self.speed.body.setText(NO_REPLY_YET)
        self.conversation.body.setText("Stored automatically as you chat.")
        self.performance_panel.reset()
        self.session_panel.show_untitled(None)

    def show_sampling(self, text: str) -> None:
        """Which settings replies use (or the last reply used), and whose choice they are."""
        self.sampling.body.setText(text)

    def show_stored(self, text: str) -> None:
        self.conversation.body.setText(text)
