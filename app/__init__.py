"""The MLoT Spark desktop app (PySide6): windows, panels, the menu-bar quick prompt and the engine worker thread.

The app talks to `engine/` only through `app.client` and its `app.worker` (a QObject living in a QThread) and never touches tensors.
"""
