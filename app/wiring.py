"""Builds the window and everything it depends on, explicitly (no global registries): used by `python -m app`,
`--self-test` and the tests."""

from __future__ import annotations

import time
from collections.abc import Callable

from app.inspector.hw_monitor import HardwareMonitor
from app.misc.standarddirs import StandardDirs
from app.server.local_server import LocalServerController
from app.settings.kept_memory import KeptMemoryControl
from app.settings.preferences import Preferences
from app.window.dialogs import Dialogs
from app.window.main_window import MainWindow
from app.worker.client import ConversationClient
from engine import KeptMemory
from engine.hw import HardwarePolicy, SystemMemorySource, ThermalSource, default_thermal_source


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
    local_server = LocalServerController()
    window = MainWindow(client, quick_client, monitor, local_server, prefs, dirs, dialogs)
    window.dialogs.kept = KeptMemoryControl(kept, prefs)
    # Parent the non-widget pieces to the window so they live exactly as long as it does.
    for obj in (client, quick_client, monitor, local_server):
        obj.setParent(window)
    monitor.start()
    return window
