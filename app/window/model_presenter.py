"""The model side of the window: loading (its words and seconds in the status bar), the local model or remote server
that replies and what the panels show of it, its measured decoding speed, and the client's reports on memory, speed
and the hardware policy, passed to the inspector and the monitor; the Local Server adopts each loaded model."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot

from app.history.library import ConversationLibrary
from app.inspector.hw_monitor import HardwareMonitor
from app.server.local_server import LocalServerController
from app.settings.preferences import Preferences
from app.settings.remote_servers import RemoteServerList
from app.window.empty_state import greeting
from app.window.state import WindowState
from app.window.views import WindowViews
from app.worker.client import ConversationClient
from app.worker.types import LoadedModel, TurnProgress, TurnResult, remote_name
from engine import RemoteServer, SparkError, default_model_path

MEASURED_TOKENS = 16  # a reply this long gives a decoding speed worth recommending models by
RUNS_ON = {  # the status bar's words for where the model runs (the details are in the tooltip and the inspector)
    "coreml": "runs on the Neural Engine",
    "mlx": "runs on the Mac's graphics processor (MLX)",
    "mps": "runs on the Mac's graphics processor",
    "cuda": "runs on the graphics card",
    "cpu": "runs on the CPU",
}


class ModelPresenter(QObject):
    model_shown = Signal()  # a model (local or remote) replies now and the panels say so
    first_ready = Signal()  # the first model of this run is ready: the conversation can open

    def __init__(
        self,
        client: ConversationClient,
        quick_client: ConversationClient,
        monitor: HardwareMonitor,
        local_server: LocalServerController,
        state: WindowState,
        views: WindowViews,
        prefs: Preferences,
        library: ConversationLibrary,
        remote_servers: RemoteServerList,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._client = client
        self._quick_client = quick_client
        self._monitor = monitor
        self._state = state
        self._views = views
        self._prefs = prefs
        self._library = library
        self._remote_servers = remote_servers
        self.measured_decode: tuple[int, float] | None = None  # the local model's (weight bytes, tokens/s) here
        self._weight_bytes = 0
        c, inspector = client, views.inspector
        c.progress.connect(inspector.on_progress)
        c.progress.connect(self._on_progress)
        c.memory.connect(inspector.on_memory)
        c.reading.connect(inspector.on_reading)
        c.memory.connect(monitor.on_memory)
        c.policy.connect(inspector.thermal_panel.on_decision)
        c.loading.connect(self._on_loading)
        c.loaded.connect(self._on_loaded)
        c.load_cancelled.connect(self._on_load_cancelled)
        c.finished.connect(self._on_finished)
        c.error.connect(self._on_error)
        c.remote_ready.connect(self._on_remote_ready)
        c.loaded.connect(local_server.on_model_loaded)  # the Local Server adopts it (after the window has shown it)

    @Slot()
    def cancel_load(self) -> None:
        self._client.cancel_load()

    def load_model(self, model: Path | None, backend: str = "auto") -> None:
        if self._state.model_loaded and self._library.get(self._state.current_id):
            # The worker carries the open conversation over to the new model: no sending until then.
            self._state.opening = self._state.current_id
        self._client.load(model, backend, self._prefs.precision())

    def use_remote(self, server: RemoteServer) -> None:
        """Chat with `server` from now on; the open conversation goes on there as its transcript. (Requests are
        queued in order: a local model still loading finishes first, so the quick prompt keeps it, then this wins.)"""
        self._client.stop()
        self._client.use_remote(server)

    @Slot(str)
    def on_precision(self, _precision: str) -> None:
        if self._state.model_loaded and self._state.remote is None:  # a server's precision is its own business
            self.load_model(self._state.model_path)

    @Slot(str)
    def _on_loading(self, model_dir: str) -> None:
        """Say what is happening and how long it takes (the first load on a machine also builds its kernels)."""
        name = Path(model_dir).name if model_dir else "the default model"
        if self._prefs.loaded_once():
            text = f"Loading {name}…"
        else:
            text = (
                f"Preparing {name} for this computer: the first launch takes about a minute, later ones a few seconds."
            )
        self._views.status.show_loading(text)
        if self._views.chat.is_empty():
            self._views.chat.set_greeting(text, ())

    @Slot(LoadedModel)
    def _on_loaded(self, loaded: LoadedModel) -> None:
        info, v = loaded.info, self._views
        first = not self._state.model_loaded
        self._state.model_loaded = True
        self._state.remote = None
        v.status.end_loading()
        resume = self._last_remote() if first else None
        self._state.model_path = None if _is_default(info.path) else info.path
        self._state.model_sampling = info.sampling
        if self._weight_bytes != info.weight_bytes:
            self.measured_decode = None  # another model: its speed is measured anew
        self._weight_bytes = info.weight_bytes
        v.status.show_model(
            f"{info.name} · {RUNS_ON.get(info.backend, info.backend)}", f"{info.path}\n{info.backend_detail}"
        )
        v.chat.set_greeting(*greeting(info.name, info.weight_bytes))
        v.composer.set_counter(loaded.count_tokens, info.context_tokens)
        v.think_switch.set_model(loaded.engine.reasoning)
        v.menus.model_button.setText(f"Model: {info.name}")
        self._prefs.set_last_model(self._state.model_path)
        self._prefs.set_loaded_once()
        self._quick_client.attach(loaded.engine)
        self._client.set_system_prompt(v.system_prompt.text().strip())
        v.inspector.on_model(info)
        self._monitor.on_model(info)
        self.model_shown.emit()
        if resume is not None:  # the app was left chatting with a server: back to it (queued before the reopening)
            self.use_remote(resume)
        else:
            self._prefs.set_last_remote(None)
        if first:
            self.first_ready.emit()

    def _last_remote(self) -> RemoteServer | None:
        last = self._prefs.last_remote()
        return next((s for s in self._remote_servers.all() if (s.url, s.model) == last), None)

    @Slot(object)
    def _on_remote_ready(self, server: RemoteServer) -> None:
        v = self._views
        first = not self._state.model_loaded
        self._state.model_loaded = True
        self._state.remote = server
        self._prefs.set_last_remote(server.url, server.model)
        v.status.show_model(f"{remote_name(server)} · remote server", server.url)
        v.menus.model_button.setText(f"Model: {server.model}")
        v.inspector.show_remote(server)
        v.chat.set_greeting(*greeting(server.model, 0, remote=True))
        v.composer.set_counter(None, 0)
        self.model_shown.emit()
        if first:
            self.first_ready.emit()

    @Slot()
    def _on_load_cancelled(self) -> None:
        self._state.opening = None
        self._views.status.end_loading()
        self._views.status.show_model("Model loading cancelled")

    @Slot(TurnProgress)
    def _on_progress(self, p: TurnProgress) -> None:
        if p.generated_tokens > 1:
            self._views.status.show_speed(f"{p.tokens_per_s:.1f} tokens/s")

    @Slot(TurnResult)
    def _on_finished(self, result: TurnResult) -> None:
        if self._state.remote is None and self._weight_bytes and result.progress.generated_tokens >= MEASURED_TOKENS:
            self.measured_decode = (self._weight_bytes, result.progress.tokens_per_s)  # Get Models… weighs speed by it

    @Slot(str)
    def _on_error(self, _message: str) -> None:
        if not self._state.model_loaded:  # the load failed (the conversation presenter shows why)
            self._views.status.end_loading()
            self._views.status.show_model("No model loaded")


def _is_default(path: Path) -> bool:
    try:
        return bool(path.resolve() == default_model_path().resolve())
    except (OSError, SparkError):  # not installed or damaged: nothing is the default
        return False
