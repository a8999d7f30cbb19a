"""The local server: serves the loaded model over the OpenAI-compatible API (engine.openai) on 127.0.0.1, beside
the app's own conversations (the scheduler's forwards take the engine's step lock, so a chat and API requests
interleave step by step), and every model of the library by the name a request sends, loaded just in time through
the same pool as `serve` (engine.openai.pool), on the pool's loading thread, never the GUI's. Its switch and "Copy
Server URL" sit in the window's Model menu and in the menu-bar item.

`LocalServerController` owns the server; `install_local_server_menu` adds the two actions to a QMenu. The
controller is told about the loaded engine through `attach(engine)`: it is shared with the window (never loaded
twice) and pinned; switching models restarts the server on the new one. The server binds loopback only: nothing
beyond this machine can reach it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtGui import QAction, QGuiApplication
from PySide6.QtWidgets import QMenu

from engine import AUTO_ORDER, Engine, SparkError
from engine.library.store import ModelStore
from engine.openai.models import LoadSettings, loader_for, model_size, servable_models
from engine.openai.pool import ModelPool, Servable
from engine.openai.server import LOOPBACK, LocalServer
from engine.openai.service import ModelService, ServeConfig, served_name

DEFAULT_PORT = 8080
MAX_MODELS = 2  # the loaded model and one more; fewer when the hardware policy's budget refuses a load
KEEP_ALIVE_S = 300.0  # a library model idle this long is unloaded (the loaded one stays: the window uses it)


@dataclass(frozen=True)
class LibraryServing:
    """Serving the library's models beside the loaded one: where they are and how they load (read at each start,
    so the Settings' weight precision of the moment applies)."""

    models_dir: Path
    settings: Callable[[], LoadSettings]
    max_models: int = MAX_MODELS
    keep_alive_s: float | None = KEEP_ALIVE_S


class LocalServerController(QObject):
    """Starts and stops the local server on the attached engine; says what it did through signals."""

    state_changed = Signal(bool, str)  # running, URL (empty when stopped)
    failed = Signal(str)  # one user-facing sentence

    def __init__(
        self, port: int = DEFAULT_PORT, library: LibraryServing | None = None, parent: QObject | None = None
    ) -> None:
        """`library` None: the loaded model only."""
        super().__init__(parent)
        self.port = port
        self.library = library
        self._engine: Engine | None = None
        self._server: LocalServer | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str:
        return self._server.url if self._server is not None else ""

    def attach(self, engine: Engine) -> None:
        """The model the server offers (the app calls this whenever a model finishes loading)."""
        was_running = self.running
        self.stop()
        self._engine = engine
        if was_running:
            self.start()

    @Slot(object)
    def on_model_loaded(self, loaded: object) -> None:
        """Connect to the worker's `loaded` signal (queued into the GUI thread, where the menu lives)."""
        engine = getattr(loaded, "engine", None)
        if isinstance(engine, Engine):
            self.attach(engine)

    @Slot(bool)
    def set_enabled(self, on: bool) -> None:
        self.start() if on else self.stop()

    def start(self) -> None:
        if self._server is not None:
            return
        if self._engine is None:
            self.failed.emit("Load a model first; the local server serves the loaded model.")
            self.state_changed.emit(False, "")
            return
        engine = self._engine
        try:
            config = ServeConfig(model_id=served_name(engine.model_dir))
            service = ModelService(engine.locked_fork(), engine.tokenizer, engine.memory_factory, config)
            try:
                self._server = LocalServer(self._pool(engine, service), LOOPBACK, self.port).start()
            except BaseException:
                service.close()
                raise
        except SparkError as exc:
            self.failed.emit(str(exc))
            self.state_changed.emit(False, "")
            return
        self.state_changed.emit(True, self._server.url)

    def _pool(self, engine: Engine, service: ModelService) -> ModelPool:
        """The loaded model (adopted and pinned: the window holds it) and, with a library, its models by name."""
        if self.library is None:
            return ModelPool.single(service)
        config = service.config
        default = Servable(config.model_id, engine.model_dir, model_size(engine.model_dir))
        servable = servable_models(default, [], ModelStore(self.library.models_dir).models())
        settings = self.library.settings()
        backend = engine.backend.name
        if settings.backend == "auto" and backend in AUTO_ORDER:
            settings = replace(settings, backend=backend)  # the others run where the loaded one runs
        pool = ModelPool(
            servable,
            config,
            loader_for(settings),
            max_models=self.library.max_models,
            keep_alive_s=self.library.keep_alive_s,
            metrics=service.metrics,
        )
        pool.adopt(config.model_id, service, pinned=True)
        return pool

    def stop(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.stop()
        self.state_changed.emit(False, "")


def switch_text(controller: LocalServerController) -> str:
    return f"Serve This Model on http://{LOOPBACK}:{controller.port or 'any port'}"


def local_server_actions(controller: LocalServerController, parent: QObject) -> tuple[QAction, QAction]:
    """The server's switch and "Copy Server URL", kept in step with the controller."""
    switch = QAction(switch_text(controller), parent)
    switch.setCheckable(True)
    copy = QAction("Copy Server URL", parent)
    copy.setEnabled(False)

    def on_state(running: bool, url: str) -> None:
        switch.blockSignals(True)
        switch.setChecked(running)
        switch.blockSignals(False)
        switch.setText(f"Serving This Model on {url}" if running else switch_text(controller))
        copy.setEnabled(running)

    switch.toggled.connect(controller.set_enabled)
    copy.triggered.connect(lambda: QGuiApplication.clipboard().setText(controller.url))
    controller.state_changed.connect(on_state)
    return switch, copy


def install_local_server_menu(menu: QMenu, controller: LocalServerController) -> tuple[QAction, QAction]:
    """Add the server's switch and "Copy Server URL" at the top of `menu` (the menu-bar item's); returns them."""
    switch, copy = local_server_actions(controller, menu)
    first = menu.actions()[0] if menu.actions() else None
    if first is None:
        menu.addActions([switch, copy])
    else:
        menu.insertActions(first, [switch, copy])
        menu.insertSeparator(first)
    return switch, copy
