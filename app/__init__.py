"""The MLoT Spark desktop app (PySide6): windows, panels, the menu-bar quick prompt and the engine worker thread.

The app talks to `engine/` only through `app.worker.client` and its `app.worker.worker` (a QObject living in a QThread) and never touches tensors.
"""
