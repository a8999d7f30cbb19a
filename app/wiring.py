"""Builds the window and everything it depends on, explicitly (no global registries): used by `python -m app`,
`--self-test` and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.inspector.hw_monitor import HardwareMonitor
from app.misc.standarddirs import StandardDirs
from app.server.local_server import LibraryServing, LocalServerController
from app.settings.kept_memory import KeptMemoryControl
from app.settings.preferences import Preferences
from app.window.dialogs import Dialogs
from app.window.main_window import MainWindow
from app.worker.client import ConversationClient
from engine import KeptMemory
from engine.hw import HardwarePolicy, SystemMemorySource, ThermalSource, default_thermal_source
from engine.openai.models import LoadSettings


def build_main_window(
    prefs: Preferences,
    dirs: StandardDirs,
    dialogs: Dialogs | None = None,
    thermal: ThermalSource | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> MainWindow:
    memory = SystemMemorySource()
    policy = HardwarePolicy(thermal or default_thermal_source(), memory)
    # The chat keeps its conversations' memories on disk (switching back and relaunching read them back).
    kept = KeptMemory(dirs.cache / "kept", prefs.kept_budget_bytes())
    client = ConversationClient("chat-worker", policy, dirs.cache, store=True, clock=clock, kept=kept)
    quick_client = ConversationClient("quick-prompt-worker", policy, dirs.cache)
    monitor = HardwareMonitor(policy, memory)

    # The Local Server serves the library's models too, loaded as the chat's are (its cache, policy and precision).
    def settings() -> LoadSettings:
        return LoadSettings(quantize=prefs.precision(), cache_dir=dirs.cache / "kv", policy=policy)

    local_server = LocalServerController(library=LibraryServing(dirs.models, settings))
    window = MainWindow(client, quick_client, monitor, local_server, prefs, dirs, dialogs)
    window.dialogs.kept = KeptMemoryControl(kept, prefs)
    # Parent the non-widget pieces to the window so they live exactly as long as it does.
    for obj in (client, quick_client, monitor, local_server):
        obj.setParent(window)
    monitor.start()
    return window
